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
    from calibrl.demo.policy import AgentTeacher, PolicySpec
    from calibrl.trainer.eval import EvalSettings

# The arms, each from the same base agent with the same design (docs/design.md, "Comparing arms").
ARMS = {
    "grpo": "GRPO (answer F1 x format)",
    "calibadv": "CalibAdv, gold documents as silver (answer F1 x format)",
    "calibadv_silver": "CalibAdv, the authors' silver documents (answer F1 x format)",
}
# Each arm's advantage estimator and where CalibAdv takes its silver documents from: the tasks' gold
# documents (``use_gold``), or the group's best well-formed rollouts, as its authors do (no gold labels needed).
ESTIMATORS = {"grpo": ("grpo", None), "calibadv": ("calibadv", True), "calibadv_silver": ("calibadv", False)}
RETRIEVAL_MODE = "bm25"


@dataclass(frozen=True)
class SearchDesign:
    """Settings shared by every search-agent arm of one demo or study run."""

    warm_steps: int  # supervised warm-start steps of the base agent (batch 8)
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
    value_swaps: int = 2  # warm start: copies of each trajectory whose answer passage states another value
    fresh_values: bool = False  # warm start: no demonstration states its training passage's own value
    careless_first: float = 0.5  # warm start: share of first queries without the plan's industry word
    careless_second: float = 0.5  # warm start: share of second queries without the fund's style word
    agent_hidden: int = 96  # the base agent's hidden size (the rewriter keeps the demo's policy size)
    agent_layers: int = 3  # the base agent's decoder layers
    chunk_prompts: int = 0  # questions generated per chunk of a step (0: the trainer's auto, two chunks)
    share_generation_prompts: str = "auto"  # rollout.share_generation_prompts (auto: as the recorded forward, off)

    def teacher(self) -> "AgentTeacher":
        """The warm start's reference trajectories (:class:`calibrl.demo.policy.AgentTeacher`)."""
        from calibrl.demo.policy import AgentTeacher

        return AgentTeacher(careless_first=self.careless_first, careless_second=self.careless_second,
                            value_swaps=self.value_swaps, fresh_values=self.fresh_values)

    def agent_spec(self) -> "PolicySpec":
        """The base agent's shape: the demo's policy with the design's width and depth (the MLP
        8/3 of the width, as Llama sizes it)."""
        from calibrl.demo.policy import PolicySpec

        default = PolicySpec()
        if (self.agent_hidden, self.agent_layers) == (default.hidden_size, default.num_layers):
            return default
        return replace(default, hidden_size=self.agent_hidden, num_layers=self.agent_layers,
                       intermediate_size=self.agent_hidden * 8 // 3)

    def with_overrides(self, **changes: object) -> "SearchDesign":
        """A copy with some fields changed (a stress setting, a pilot)."""
        return replace(self, **changes)


# Fixed by the rules of experiments/LOG.md (D11, D14, D15), written before any run of this domain, on the training
# and validation questions of seed 0 only (benchmarks/probe_warm_start.py; the base alone, no arm trained): the
# larger agent (hidden 192, 4 layers; the demo's size found no validation bridge), careless_first / careless_second
# 0.5, moved once to 0.75 (0.25) if the base finds the training bridge on more than 60% (fewer than 30%) of training
# questions; warm_steps: 1600, unless 2400 raises the training read-out rate by more than 10 points; go / no-go:
# validation bridge found >= 20% and training read-out >= 50%. steps: 40, so that three search arms take the time
# two arms of 60 steps took (a wall-time rule, read on no result).
# Measured (experiments/LOG.md, D15): training read-out 75.0% at 1600 vs 99.0% at 2400 -> 2400; training bridge
# found 47.2% -> careless_first stays 0.5; validation bridge found 45.1% -> go.
# D17 (experiments/LOG.md; D16's fresh values, passages without tickers): warm_steps 2400 unless 3600 raises the
# validation read-out by more than 10 points; go / no-go: validation bridge found >= 20%, validation and training
# read-out >= 50%. Measured: validation read-out 75.0% at 2400 vs 74.5% at 3600 -> 2400; training bridge found
# 39.9% -> careless_first stays 0.5; validation bridge found 43.1%, training read-out 96.3% -> go.
# D18 (experiments/LOG.md; D17 with a smaller agent, for the demo's and the study's wall time): hidden 128, 3 layers;
# the same rules as D17. Measured: training bridge found 34.7% -> careless_first stays 0.5; validation bridge found
# 35.4%, validation read-out 79.2%, training read-out 100.0% -> go.
# D19 (experiments/LOG.md; D18 with a cheaper RL step, for the demo's and the study's wall time): all four questions
# of a step in one generation chunk, the engine's prefill shared between repeated prompts, and 30 steps per arm
# (a wall-time rule read on no result); the base agent is D18's, with D18's go / no-go.
FULL_SEARCH = SearchDesign(warm_steps=2400, steps=30, prompts_per_step=4, group_size=8, lr=5e-4, agent_hidden=128,
                           agent_layers=3, fresh_values=True, chunk_prompts=4, share_generation_prompts="on")
QUICK_SEARCH = SearchDesign(warm_steps=100, steps=3, prompts_per_step=4, group_size=4, lr=5e-4, checkpoints=1,
                            eval_questions=24, fresh_values=True)


def describe_design(design: SearchDesign) -> str:
    """One line for the report's settings table."""
    return (f"{design.steps} steps x {design.prompts_per_step} questions x G={design.group_size}, lr {design.lr:g}, "
            f"KL beta {design.kl_beta:g}, up to {design.max_turns} turns, {design.top_k} documents per search, "
            f"reward answer F1 x format; warm start {design.warm_steps} steps on a teacher that reads what it "
            f"retrieved and leaves out the plan's industry word in {design.careless_first:.0%} of its first queries "
            f"and the fund's style word in {design.careless_second:.0%} of its second queries"
            + (f"; {design.chunk_prompts} questions per generation chunk" if design.chunk_prompts else "")
            + ("; a prompt repeated in a generation batch prefilled once"
               if design.share_generation_prompts == "on" else ""))


# The demo's and the study's records were made with every rollout running its whole prompt. Sharing a
# group's prompt (the trainer's default) moves log-probs by float rounding, which a run of many steps
# amplifies: their runs keep the forward their records were made with, so that they reproduce them.
RECORDED_FORWARD = "rollout.share_prompt_prefix=false"


def train_overrides(design: SearchDesign, arm: str, *, policy: str | pathlib.Path, tasks: str | pathlib.Path,
                    output_dir: str | pathlib.Path, retrieval: str, seed: int, progress: bool = False,
                    extra: Sequence[str] = ()) -> list[str]:
    """The trainer overrides of one search arm (``retrieval``: a host:port target, or
    ``inprocess`` followed by ``services.index_dir=...`` in ``extra``)."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}: must be one of {sorted(ARMS)}")
    return [
        RECORDED_FORWARD,
        f"policy.path={policy}", "policy.device=cpu", f"tasks.path={tasks}", f"seed={seed}", f"steps={design.steps}",
        f"services.retrieval={retrieval}", f"reward.mode={RETRIEVAL_MODE}", f"output_dir={output_dir}",
        f"checkpoint_every={max(1, design.steps // design.checkpoints)}", "keep_checkpoints=0", "max_grad_norm=0.5",
        f"loss.beta={design.kl_beta}", f"progress_bar={str(progress).lower()}",
        f"rollout.group_size={design.group_size}", f"rollout.prompts_per_step={design.prompts_per_step}",
        f"rollout.max_new_tokens={design.max_new_tokens}", f"rollout.max_turns={design.max_turns}",
        f"rollout.search_top_k={design.top_k}", f"rollout.max_obs_tokens={design.max_obs_tokens}",
        f"rollout.temperature={design.temperature}",
        f"optimizer.lr={design.lr}", "services.judge=none", "reward.answer_metric=f1", "reward.w_rubric=0",
        *([f"rollout.chunk_prompts={design.chunk_prompts}"] if design.chunk_prompts else []),
        *([f"rollout.share_generation_prompts={design.share_generation_prompts}"]
          if design.share_generation_prompts != "auto" else []),
        *estimator_overrides(arm), *extra,
    ]


def estimator_overrides(arm: str) -> list[str]:
    """The trainer overrides that pick the arm's advantage estimator (and CalibAdv's silver documents)."""
    estimator, use_gold = ESTIMATORS[arm]
    return [f"advantage.type={estimator}", *([] if use_gold is None else [f"advantage.use_gold={str(use_gold).lower()}"])]


def eval_settings(design: SearchDesign) -> "EvalSettings":
    """Greedy held-out decoding with the design's turn, document and token budgets."""
    from calibrl.trainer.eval import EvalSettings

    return EvalSettings(top_k=design.top_k, mode=RETRIEVAL_MODE, max_new_tokens=design.max_new_tokens,
                        max_turns=design.max_turns, search_top_k=design.top_k, max_obs_tokens=design.max_obs_tokens,
                        device="cpu")


__all__ = ["ARMS", "ESTIMATORS", "estimator_overrides", "FULL_SEARCH", "QUICK_SEARCH", "SearchDesign", "describe_design", "eval_settings", "train_overrides"]
