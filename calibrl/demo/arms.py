"""The demo's training runs as data: one :class:`Arm` per run, one :class:`Agent` per policy.

An arm is a name, the agent it trains, the config overrides that make it differ from
the agent's other arms, and the words the demo prints and reports for it. The stages
(:mod:`calibrl.demo.cli`, :mod:`calibrl.demo.stages`) iterate over :data:`ARMS`; none of
them branches on an arm's name. The search arms' advantage estimators are
:data:`calibrl.demo.search_design.ESTIMATORS` (the study trains the same arms).

Text fields are ``str.format`` templates over :func:`arm_fields`: the run's sizes
(``hit_k``, ``dense_k``, ``max_sampling_rounds``), the dense reward's rubric
(``dense_rubric``) and the judge server's target (``judge``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.settings import DemoSettings

AgentKind = Literal["rewrite", "search"]


@dataclass(frozen=True)
class Agent:
    """A policy the demo trains arms of, and what its held-out evaluation reports."""

    kind: AgentKind
    base: str  # the untrained base's row name
    base_label: str
    headline: str  # the held-out metric printed per checkpoint and drawn as the curve
    heldout: tuple[tuple[str, str], ...]  # (report key, evaluation metric) of the results table
    optional: tuple[str, ...] = ()  # evaluation metrics that may be missing (reported as NaN)

    def heldout_row(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The results table's figures of one evaluation."""
        return {key: metrics.get(metric, float("nan")) if metric in self.optional else metrics[metric]
                for key, metric in self.heldout}


REWRITER = Agent("rewrite", "base", "base rewriter (untrained)", "hit@k",
                 (("hit", "hit@k"), ("mrr", "mrr"), ("ndcg", "ndcg@k")))
SEARCH_AGENT = Agent("search", "base_agent", "base search agent (untrained)", "f1",
                     (("em", "em"), ("f1", "f1"), ("well_formed", "well_formed"),
                      ("gold_doc_recall", "gold_doc_recall")),
                     optional=("gold_doc_recall",))
AGENTS = {agent.kind: agent for agent in (REWRITER, SEARCH_AGENT)}


@dataclass(frozen=True)
class Arm:
    """One training run of the demo."""

    name: str
    agent: AgentKind
    label: str  # the report's row label (template)
    describe: str  # the line printed when the run starts (template)
    overrides: tuple[str, ...] = ()  # trainer overrides beyond the agent's shared ones (templates)
    judged: bool = False  # its trajectory reward calls the rubric judge

    def fill(self, text: str, fields: Mapping[str, object]) -> str:
        return text.format(**fields)

    def label_for(self, fields: Mapping[str, object]) -> str:
        return self.fill(self.label, fields)

    def describe_for(self, fields: Mapping[str, object]) -> str:
        return self.fill(self.describe, fields)

    def overrides_for(self, fields: Mapping[str, object]) -> list[str]:
        return [self.fill(override, fields) for override in self.overrides]


_BINARY = ("reward.binary_only=true", "reward.top_k={hit_k}", "services.judge=none")

# In the order the report lists them: the rewriter's three rewards, then the search agent's three estimators.
ARMS: tuple[Arm, ...] = (
    Arm("binary", "rewrite", "GRPO, binary hit@{hit_k} reward", "rewriter, reward hit@{hit_k}", _BINARY),
    Arm("binary_ds", "rewrite", "GRPO, binary hit@{hit_k} reward + dynamic sampling",
        "rewriter, reward hit@{hit_k}, dynamic sampling (up to {max_sampling_rounds} rounds)",
        (*_BINARY, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds={max_sampling_rounds}")),
    Arm("dense", "rewrite", "GRPO, blended dense reward (0.7 MRR@{dense_k} + 0.3 rubric {dense_rubric})",
        "rewriter, reward 0.7 MRR@{dense_k} + 0.3 rubric {dense_rubric}",
        ("reward.retrieval_signal=mrr", "reward.top_k={dense_k}", "reward.w_retrieval=0.7", "reward.w_rubric=0.3",
         "reward.rubric_id={dense_rubric}", "services.judge={judge}"), judged=True),
    Arm("grpo", "search", "GRPO (answer F1)", "search agent, GRPO advantages"),
    Arm("calibadv", "search", "CalibAdv, gold as silver (answer F1)",
        "search agent, CalibAdv advantages, gold documents as silver"),
    Arm("calibadv_silver", "search", "CalibAdv, authors' silver (answer F1)",
        "search agent, CalibAdv advantages, silver documents from the group's best rollouts"),
)
ARM_BY_NAME = {arm.name: arm for arm in ARMS}
# The report's dynamic-sampling verdict compares these three rewriter arms (calibrl.demo.judge_report).
DYNAMIC_SAMPLING_COMPARISON = ("binary", "binary_ds", "dense")


def arms_of(agent: AgentKind) -> tuple[Arm, ...]:
    return tuple(arm for arm in ARMS if arm.agent == agent)


def arm_fields(settings: "DemoSettings", dense_rubric: str, judge: str = "") -> dict[str, object]:
    """What the arms' templates may name."""
    return {"hit_k": settings.hit_k, "dense_k": settings.dense_k, "max_sampling_rounds": settings.max_sampling_rounds,
            "dense_rubric": dense_rubric, "judge": judge}


def labels(fields: Mapping[str, object]) -> dict[str, str]:
    """Row labels of every evaluated model, bases included, in the report's order."""
    rows: dict[str, str] = {}
    for agent in AGENTS.values():
        rows[agent.base] = agent.base_label
        rows.update({arm.name: arm.label_for(fields) for arm in arms_of(agent.kind)})
    return rows


__all__ = ["AGENTS", "ARMS", "ARM_BY_NAME", "Agent", "Arm", "DYNAMIC_SAMPLING_COMPARISON", "REWRITER",
           "SEARCH_AGENT", "arm_fields", "arms_of", "labels"]
