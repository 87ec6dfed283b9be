"""Plain data types of the judge service, shared by the core, the gRPC adapter
(calibrl.api.judge_wire) and the trainer's clients."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class JudgeItem:
    """One agent output to judge (see JudgeItem in judge.proto)."""

    query: str
    output: str
    retrieved_texts: tuple[str, ...] = ()
    retrieved_doc_ids: tuple[str, ...] = ()
    context: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs, hashable

    @staticmethod
    def make(query: str, output: str, retrieved_texts=(), retrieved_doc_ids=(), context=None) -> "JudgeItem":
        return JudgeItem(
            query=query,
            output=output,
            retrieved_texts=tuple(retrieved_texts),
            retrieved_doc_ids=tuple(retrieved_doc_ids),
            context=tuple(sorted((context or {}).items())),
        )


@dataclass(frozen=True)
class CriterionScore:
    name: str
    score: float  # in [0, 1], 1 = criterion met / no violation
    weight: float
    penalty: bool = False


@dataclass(frozen=True)
class ItemScore:
    """Scores of one item under one rubric."""

    criteria: tuple[CriterionScore, ...]
    total: float
    rubric_id: str = ""
    rubric_hash: str = ""
    model_id: str = ""
    cached: bool = False

    def by_name(self) -> dict[str, float]:
        return {c.name: c.score for c in self.criteria}


def aggregate(criteria: tuple[CriterionScore, ...] | list[CriterionScore]) -> float:
    """The rubric total: weight-normalised mean of the non-penalty criteria minus
    the weighted violation of each penalty criterion, clipped to [0, 1]:

        clip(sum_c w_c s_c / sum_c w_c - sum_p w_p (1 - s_p), 0, 1)
    """
    positive = [c for c in criteria if not c.penalty]
    weight = sum(c.weight for c in positive)
    base = sum(c.weight * c.score for c in positive) / weight if weight > 0 else 1.0
    penalty = sum(c.weight * (1.0 - c.score) for c in criteria if c.penalty)
    return min(1.0, max(0.0, base - penalty))
