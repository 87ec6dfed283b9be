"""The search-agent half of the demo as data: warm start, training arms, evaluation.

:class:`SearchDesign` holds every setting the search arms share (the comparison is
fair only when each arm gets the same ones); :data:`FULL_SEARCH` is the design the
full demo and the multi-seed study run, :data:`QUICK_SEARCH` the smoke run's.
:func:`train_overrides` turns a design and an arm into the trainer's ``key=value``
overrides, and :func:`eval_settings` into held-out decoding settings, so that the
demo, the study and a pilot script train and evaluate the same way.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.policy import AgentTeacher
    from calibrl.trainer.eval import EvalSettings

# The arms, each from the same base agent with the same design (docs/design.md, "Comparing arms").
ARMS = {
    "grpo": "GRPO (answer F1 x format)",
    "calibadv": "CalibAdv (answer F1 x format)",
}
RETRIEVAL_MODE = "bm25"


@dataclass(frozen=True)
class SearchDesign:
    """Settings shared by every search-agent arm of one demo or study run."""

    warm_steps: int  # supervised warm-start steps of the base agent (batch 8)
    single_hop: int  # one-search warm-start trajectories beside the two-search ones
    steps: int  # RL steps per arm
    prompts_per_step: int  # questions per RL step
    group_size: int  # rollouts per question (G)
    lr: float  # AdamW learning rate of every arm
    kl_beta: float = 0.08  # weight of the KL penalty to the frozen reference
    max_turns: int = 3  # generated turns per trajectory, the answer turn included
    top_k: int = 1  # documents per <search>
    max_new_tokens: int = 40  # per turn
    max_obs_tokens: int = 200  # retrieved tokens per observation
    temperature: float = 1.0  # sampling temperature of the rollouts
    checkpoints: int = 2  # held-out evaluations per arm (the curve's points)
    eval_questions: int = 0  # held-out questions evaluated, the first ones of the file (0 = all)
    value_swaps: int = 2  # warm start: copies of each careful trajectory whose answer passage states another value
    shortcut_share: float = 0.0  # warm start: share of two-search demonstrations with the careless second search
    verbose_share: float = 0.6  # warm start: share of answers giving the whole quoted phrase instead of the value

    def teacher(self) -> "AgentTeacher":
        """The warm start's reference trajectories (:class:`calibrl.demo.policy.AgentTeacher`)."""
        from calibrl.demo.policy import AgentTeacher

        return AgentTeacher(single_hop=self.single_hop, value_swaps=self.value_swaps,
                            shortcut_share=self.shortcut_share, verbose_share=self.verbose_share)

    def with_overrides(self, **changes: object) -> "SearchDesign":
        """A copy with some fields changed (a stress setting, a pilot)."""
        return replace(self, **changes)


# Fixed from the untrained base's error analysis and pilots of both arms with identical settings
# (docs/getting-started/demo.md): the full demo and the multi-seed study run FULL_SEARCH.
# warm_steps: the smallest probed length (300, 600, 900, ... steps) after which the base finds the bridge
# document on every probed training question (benchmarks/probe_warm_start.py; the base alone, no arm
# trained). Shorter warm starts leave it writing a memorised account or fund name of the same shape in
# its first search. On the 120-question domain that was 600; on the 360-question domain (more names,
# fewer passes over each) 600 missed 3 of 110 probed training bridges, 900 and 1200 one, 1500 none.
# steps: the smallest multiple of 30 after which the 10-step mean training reward, averaged over GRPO and
# CalibAdv, rises by less than 0.01 over the next 30 steps (benchmarks/probe_rl_budget.py, training reward
# only): 30 from the 600-step base on the 120-question domain, 60 from the 1500-step base on this one.
FULL_SEARCH = SearchDesign(warm_steps=1500, single_hop=200, steps=60, prompts_per_step=4, group_size=8, lr=5e-4)
QUICK_SEARCH = SearchDesign(warm_steps=100, single_hop=60, steps=3, prompts_per_step=4, group_size=4, lr=5e-4,
                            checkpoints=1, eval_questions=24)


def describe_design(design: SearchDesign) -> str:
    """One line for the report's settings table."""
    return (f"{design.steps} steps x {design.prompts_per_step} questions x G={design.group_size}, lr {design.lr:g}, "
            f"KL beta {design.kl_beta:g}, up to {design.max_turns} turns, {design.top_k} documents per search, "
            f"reward answer F1 x format; warm start {design.warm_steps} steps on a teacher that answers with the whole "
            f"quoted phrase in {design.verbose_share:.0%} of its answers and searches the question's own entity "
            f"second in {design.shortcut_share:.0%} of its two-search demonstrations")


def train_overrides(design: SearchDesign, arm: str, *, policy: str | pathlib.Path, tasks: str | pathlib.Path,
                    output_dir: str | pathlib.Path, retrieval: str, seed: int, progress: bool = False,
                    extra: Sequence[str] = ()) -> list[str]:
    """The trainer overrides of one search arm (``retrieval``: a host:port target, or
    ``inprocess`` followed by ``services.index_dir=...`` in ``extra``)."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}: must be one of {sorted(ARMS)}")
    return [
        f"policy.path={policy}", "policy.device=cpu", f"tasks.path={tasks}", f"seed={seed}", f"steps={design.steps}",
        f"services.retrieval={retrieval}", f"reward.mode={RETRIEVAL_MODE}", f"output_dir={output_dir}",
        f"checkpoint_every={max(1, design.steps // design.checkpoints)}", "keep_checkpoints=0", "max_grad_norm=0.5",
        f"loss.beta={design.kl_beta}", f"progress_bar={str(progress).lower()}",
        f"rollout.group_size={design.group_size}", f"rollout.prompts_per_step={design.prompts_per_step}",
        f"rollout.max_new_tokens={design.max_new_tokens}", f"rollout.max_turns={design.max_turns}",
        f"rollout.search_top_k={design.top_k}", f"rollout.max_obs_tokens={design.max_obs_tokens}",
        f"rollout.temperature={design.temperature}",
        f"optimizer.lr={design.lr}", "services.judge=none", "reward.answer_metric=f1", "reward.w_rubric=0",
        f"advantage.type={arm}", *(["advantage.use_gold=true"] if arm == "calibadv" else []), *extra,
    ]


def eval_settings(design: SearchDesign) -> "EvalSettings":
    """Greedy held-out decoding with the design's turn, document and token budgets."""
    from calibrl.trainer.eval import EvalSettings

    return EvalSettings(top_k=design.top_k, mode=RETRIEVAL_MODE, max_new_tokens=design.max_new_tokens,
                        max_turns=design.max_turns, search_top_k=design.top_k, max_obs_tokens=design.max_obs_tokens,
                        device="cpu")


__all__ = ["ARMS", "FULL_SEARCH", "QUICK_SEARCH", "SearchDesign", "describe_design", "eval_settings", "train_overrides"]
