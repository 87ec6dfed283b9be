"""Agreement between reviewers who graded the same items (pure functions).

For each pair of reviewers, over the items both answered: Cohen's kappa on
pass/fail (a record's verdict, else ``grade >= pass_grade``, as distillation reads
it) with its 95% bootstrap interval (items resampled, 10,000 resamples, seed 0;
:func:`calibrl.stats.kappa_interval`), quadratic-weighted kappa on the 1-5 grades where
both gave one, raw agreement, and the items they disagree on (different pass/fail, or
grades two or more apart).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from calibrl.sme.store import Answer
from calibrl.judge_server import metrics


@dataclass
class Disagreement:
    item_id: str
    first: str  # e.g. "fail, grade 2"
    second: str


@dataclass
class PairAgreement:
    first: str
    second: str
    n_common: int
    kappa: float | None  # Cohen's kappa on pass/fail; None where undefined
    agreement: float | None  # share of common items with the same pass/fail
    grade_kappa: float | None  # quadratic-weighted kappa on grades; None where undefined
    n_graded: int  # common items both gave a grade
    disagreements: list[Disagreement] = field(default_factory=list)
    kappa_low: float | None = None  # the 95% bootstrap interval of ``kappa``; None where undefined
    kappa_high: float | None = None


def _describe(answer: Answer, pass_grade: int) -> str:
    record = answer.record
    verdict = "pass" if record.expert_pass(pass_grade) else "fail"
    return verdict + (f", grade {record.grade}" if record.grade is not None else "")


def pairwise(answers: Sequence[Answer], pass_grade: int = 4) -> list[PairAgreement]:
    """One :class:`PairAgreement` per pair of reviewers (sorted by name) with an item in common."""
    by_reviewer: dict[str, dict[str, Answer]] = {}
    for answer in answers:
        by_reviewer.setdefault(answer.reviewer, {})[answer.item_id] = answer
    pairs = []
    for first, second in itertools.combinations(sorted(by_reviewer), 2):
        common = [i for i in by_reviewer[first] if i in by_reviewer[second]]
        if not common:
            continue
        a = [by_reviewer[first][i] for i in common]
        b = [by_reviewer[second][i] for i in common]
        pass_a = ["pass" if x.record.expert_pass(pass_grade) else "fail" for x in a]
        pass_b = ["pass" if x.record.expert_pass(pass_grade) else "fail" for x in b]
        graded = [(x.record.grade, y.record.grade) for x, y in zip(a, b)
                  if x.record.grade is not None and y.record.grade is not None]
        disagreements = [
            Disagreement(x.item_id, _describe(x, pass_grade), _describe(y, pass_grade))
            for x, y, p, q in zip(a, b, pass_a, pass_b)
            if p != q or (x.record.grade is not None and y.record.grade is not None
                          and abs(x.record.grade - y.record.grade) >= 2)
        ]
        kappa = metrics.cohen_kappa(pass_a, pass_b, ["pass", "fail"])
        low, high = _interval(pass_a, pass_b) if kappa is not None else (None, None)
        pairs.append(PairAgreement(
            first=first, second=second, n_common=len(common),
            kappa=kappa, kappa_low=low, kappa_high=high,
            agreement=sum(p == q for p, q in zip(pass_a, pass_b)) / len(common),
            grade_kappa=metrics.quadratic_weighted_kappa([g for g, _ in graded], [h for _, h in graded])
            if graded else None,
            n_graded=len(graded),
            disagreements=disagreements,
        ))
    return pairs


def _interval(pass_a: Sequence[str], pass_b: Sequence[str]) -> tuple[float | None, float | None]:
    import math

    from calibrl.stats import kappa_interval

    interval = kappa_interval([a == "pass" for a in pass_a], [b == "pass" for b in pass_b])
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return None, None
    return interval.low, interval.high
