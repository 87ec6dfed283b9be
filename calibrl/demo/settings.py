"""The demo's sizes (:class:`DemoSettings`, :data:`FULL`, :data:`QUICK`) and the names its
stages share: the rubric ids, the retrieval mode, the validation gate and which runs train
as processes. The runs themselves are data in :mod:`calibrl.demo.arms`."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from calibrl.demo.arms import arms_of
from calibrl.demo.search_design import FULL_SEARCH, QUICK_SEARCH, SearchDesign

# The demo's seed: no design knob was ever chosen on it, nor its results read before this default was
# set (design choices read seeds 0-2; experiments/LOG.md).
DEFAULT_SEED = 6
RUBRIC_ID = "demo-rewriter"
STEP_RUBRIC_ID = "search-steps"  # the search agent's step rubric, served by the same judge as the rewriter's
STEP_RUBRIC = pathlib.Path(__file__).resolve().parents[2] / "configs" / "rubrics" / f"{STEP_RUBRIC_ID}.yaml"
REWRITE_ARMS = tuple(arm.name for arm in arms_of("rewrite"))  # the rewriter's training runs
SEARCH_ARMS = tuple(arm.name for arm in arms_of("search"))  # the search agent's (calibrl.demo.search_design.ARMS)
# Two agents, two rubrics, one judge server: these two runs are `calibrl train` processes, started together.
CONCURRENT_PAIR = ("dense", "grpo")
# Then the others. The full demo (DemoSettings.more_processes) starts each as a process too, the longest
# first, whenever one of the two running ends (CalibAdv beside the GRPO agent, the binary arms beside
# CalibAdv), so both cores stay busy; the quick demo trains them one after another in the demo process,
# since a process start (torch, transformers) costs 10-15 s, more than a quick run's training
# (benchmarks/README, "Two agents at once").
OTHER_RUNS = ("calibadv", "calibadv_silver", "binary", "binary_ds")
# Torch threads of the two warm starts, which run one after the other in the demo process: the demo's
# two cores (a warm start's model does not depend on the count: calibrl.demo.policy.build_base_policies).
WARM_THREADS = 2
# Arms whose checkpoints are evaluated at once (Python threads of the demo process:
# calibrl.demo.training.evaluate_checkpoints says why the figures are those of one arm after another).
EVAL_THREADS = 2
MARKER = ".calibrl-demo"  # marks a folder as a demo run's output, which a later run may replace
RETRIEVAL_MODE = "bm25"
# The judge passes a golden item when its rubric total reaches a threshold picked on the NON-golden
# reviews (best kappa, calibrl.judge_server.authoring.validation.pick_pass_threshold); the gate passes when the
# whole 95% bootstrap interval of the golden kappa is at least min_kappa (docs/concepts/simulated-experts.md).
PASS_THRESHOLD = "auto"
GATE = "lower_bound"


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run (``FULL`` or ``QUICK``)."""

    name: str
    warm_rewriter_steps: int
    rewrite_steps: int
    group_size: int
    prompts_per_step: int
    checkpoints: int  # held-out evaluations per rewriter training run (the curve's points)
    search: SearchDesign  # the search agent's warm start, arms and evaluation (calibrl.demo.search_design)
    lr: float = 2e-4
    kl_beta: float = 0.08  # weight of the KL penalty to the frozen reference
    hit_k: int = 1  # held-out hit@k and the binary reward's k
    dense_k: int = 10  # cut-off of the dense retrieval signal (MRR@k)
    max_new_tokens: int = 24  # per rewrite
    rewrite_examples: int = 4000
    max_sampling_rounds: int = 3  # binary + dynamic sampling: most rounds of tasks per step
    judge_warm_steps: int = 120  # the LLM judge's warm start on the domain text
    judge_epochs: int = 3  # train-judge epochs
    more_processes: tuple[str, ...] = ()  # runs of OTHER_RUNS trained as processes after the pair (module constants)

    def processes(self) -> tuple[str, ...]:
        """The runs trained as `calibrl train` processes, two at once, in start order."""
        return (*CONCURRENT_PAIR, *self.more_processes)

    def in_process(self) -> tuple[str, ...]:
        """The runs the demo trains itself afterwards, one after another."""
        return tuple(name for name in OTHER_RUNS if name not in self.processes())

    @property
    def quick(self) -> bool:
        return self.name == "quick"


FULL = DemoSettings(
    name="full", warm_rewriter_steps=400, rewrite_steps=60, group_size=4, prompts_per_step=16, checkpoints=3,
    search=FULL_SEARCH, more_processes=("calibadv", "calibadv_silver", "binary_ds", "binary"),  # the longest first
)
QUICK = DemoSettings(
    name="quick", warm_rewriter_steps=120, rewrite_steps=12, group_size=4, prompts_per_step=8, checkpoints=2,
    search=QUICK_SEARCH, rewrite_examples=1500, judge_warm_steps=40, judge_epochs=2,
)
