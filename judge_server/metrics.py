"""Agreement statistics between a judge and the experts (pure functions, no numpy).

Each returns None where the statistic is undefined (e.g. kappa when both raters
used a single class, Spearman when either side is constant) rather than a number
that would look meaningful.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence


def confusion(rater_a: Sequence[Hashable], rater_b: Sequence[Hashable], labels: Sequence[Hashable]) -> list[list[int]]:
    """``matrix[i][j]`` = items rater_a put in ``labels[i]`` and rater_b in ``labels[j]``."""
    if len(rater_a) != len(rater_b):
        raise ValueError(f"rater lengths differ: {len(rater_a)} vs {len(rater_b)}")
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for a, b in zip(rater_a, rater_b):
        matrix[index[a]][index[b]] += 1
    return matrix


def _weighted_kappa(matrix: list[list[int]], weight) -> float | None:
    k = len(matrix)
    n = sum(sum(row) for row in matrix)
    if n == 0:
        return None
    rows = [sum(matrix[i]) / n for i in range(k)]
    cols = [sum(matrix[i][j] for i in range(k)) / n for j in range(k)]
    observed = sum(weight(i, j) * matrix[i][j] / n for i in range(k) for j in range(k))
    expected = sum(weight(i, j) * rows[i] * cols[j] for i in range(k) for j in range(k))
    if expected == 0:
        return None
    return 1.0 - observed / expected


def cohen_kappa(rater_a: Sequence[Hashable], rater_b: Sequence[Hashable], labels: Sequence[Hashable]) -> float | None:
    """Cohen's kappa: (p_observed - p_chance) / (1 - p_chance)."""
    return _weighted_kappa(confusion(rater_a, rater_b, labels), lambda i, j: float(i != j))


def quadratic_weighted_kappa(rater_a: Sequence[int], rater_b: Sequence[int], low: int = 1, high: int = 5) -> float | None:
    """Kappa with disagreement weight ((i - j) / (k - 1))^2 over the ordinal scale low..high."""
    labels = list(range(low, high + 1))
    span = (high - low) ** 2
    return _weighted_kappa(confusion(rater_a, rater_b, labels), lambda i, j: (i - j) ** 2 / span)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2.0 + 1.0  # ties share their mean rank
        start = end + 1
    return ranks


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    n = len(x)
    if n != len(y) or n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rho: Pearson correlation of the (tie-averaged) ranks."""
    return pearson(_ranks(x), _ranks(y))


def precision_recall(predicted: Sequence[bool], actual: Sequence[bool]) -> dict[str, float | int | None]:
    tp = sum(1 for p, a in zip(predicted, actual) if p and a)
    fp = sum(1 for p, a in zip(predicted, actual) if p and not a)
    fn = sum(1 for p, a in zip(predicted, actual) if not p and a)
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    f1 = (2 * precision * recall / (precision + recall)
          if precision is not None and recall is not None and precision + recall > 0 else None)
    return {"precision": precision, "recall": recall, "f1": f1, "tp": tp, "fp": fp, "fn": fn,
            "support": tp + fn}
