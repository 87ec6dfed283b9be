"""Means with bootstrap intervals, and the paired bootstrap of two arms.

The unit of resampling is the question: an arm's held-out score is a mean over
questions, and what varies from one held-out set to the next is which questions
it holds. Two ways of combining seeds are supported:

* the seeds share their questions (one held-out set, several training seeds):
  average each question's score over seeds first (:func:`average_over_seeds`),
  then resample questions;
* each seed has its own questions (``calibrl demo --seed N`` generates a new
  domain per seed): resample questions *within* each seed (``strata`` = the seed
  of each unit), so every bootstrap sample keeps each seed's share of questions.

Percentile intervals (the 2.5th and 97.5th percentiles of the resampled means,
numpy's linear interpolation). Everything is seeded: the same inputs and seed
give the same interval on every machine (numpy's PCG64 generator draws the same
indices everywhere; the means are float64 sums of the inputs).

A paired difference resamples the same questions for both arms, so the spread
of questions that every arm finds easy or hard cancels out; its point estimate
is exactly the difference of the two arms' means over the same units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from calibrl.errors import InvalidArgument

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap percentile interval."""

    estimate: float  # the mean over the units (for a paired difference: mean of a - b)
    low: float
    high: float
    units: int  # how many units (questions, or seed x question pairs) were resampled
    confidence: float = DEFAULT_CONFIDENCE

    @property
    def excludes_zero(self) -> bool:
        """Whether the whole interval lies on one side of 0."""
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "units": self.units,
                "confidence": self.confidence}


def average_over_seeds(per_seed: Sequence[Sequence[float]]) -> list[float]:
    """Each question's score averaged over seeds: ``per_seed[s][q]`` -> ``out[q]``.
    Every seed must score the same questions, in the same order."""
    if not per_seed:
        raise InvalidArgument("per_seed", "needs at least one seed")
    count = len(per_seed[0])
    for s, scores in enumerate(per_seed):
        if len(scores) != count:
            raise InvalidArgument("per_seed", f"seed {s} has {len(scores)} questions, seed 0 has {count}")
    return [math.fsum(scores[q] for scores in per_seed) / len(per_seed) for q in range(count)]


def mean_interval(values: Sequence[float], *, strata: Sequence[Any] | None = None,
                  resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                  seed: int = 0) -> Interval:
    """The mean of ``values`` (one per unit) with its bootstrap percentile interval;
    ``strata`` (one label per unit, e.g. its seed) resamples within each label."""
    data = _checked("values", values)
    groups = _strata_indices(strata, len(data))
    means = _bootstrap_means(data, groups, resamples, confidence, seed)
    return _interval(data, means, confidence)


def paired_difference(a: Sequence[float], b: Sequence[float], *, strata: Sequence[Any] | None = None,
                      resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                      seed: int = 0) -> Interval:
    """Mean of ``a - b`` over the same units (``a[i]`` and ``b[i]`` score the same
    question) with its paired bootstrap interval: each resample draws units, and
    both arms' scores of a drawn unit go in together."""
    left, right = _checked("a", a), _checked("b", b)
    if len(left) != len(right):
        raise InvalidArgument("b", f"has {len(right)} scores but a has {len(left)}: a paired test needs the same units")
    differences = [x - y for x, y in zip(left, right)]
    return mean_interval(differences, strata=strata, resamples=resamples, confidence=confidence, seed=seed)


# --------------------------------------------------------------------------- internals


def _checked(name: str, values: Sequence[float]) -> list[float]:
    data = [float(v) for v in values]
    if not data:
        raise InvalidArgument(name, "is empty: a mean needs at least one unit")
    bad = next((i for i, v in enumerate(data) if not math.isfinite(v)), None)
    if bad is not None:
        raise InvalidArgument(name, f"item {bad} is {data[bad]}: every score must be a finite number")
    return data


def _strata_indices(strata: Sequence[Any] | None, count: int) -> list[list[int]]:
    if strata is None:
        return [list(range(count))]
    if len(strata) != count:
        raise InvalidArgument("strata", f"has {len(strata)} labels for {count} units")
    groups: dict[Any, list[int]] = {}
    for i, label in enumerate(strata):
        groups.setdefault(label, []).append(i)
    return list(groups.values())


def _bootstrap_means(data: list[float], groups: list[list[int]], resamples: int, confidence: float,
                     seed: int) -> Any:
    """(resamples,) means of stratified resamples of ``data``."""
    import numpy as np

    if resamples < 100:
        raise InvalidArgument("resamples", f"is {resamples}: use at least 100 for a 95% interval")
    if not 0 < confidence < 1:
        raise InvalidArgument("confidence", f"is {confidence}: must be in (0, 1)")
    values = np.asarray(data, dtype=np.float64)
    rng = np.random.default_rng(seed)
    totals = np.zeros(resamples, dtype=np.float64)
    for group in groups:
        members = values[np.asarray(group)]
        draws = rng.integers(0, len(group), size=(resamples, len(group)))
        totals += members[draws].sum(axis=1)
    return totals / len(data)


def _interval(data: list[float], means: Any, confidence: float) -> Interval:
    import numpy as np

    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    estimate = math.fsum(data) / len(data)
    # A percentile of resampled means can differ from the estimate in the last bits
    # when every unit is equal; clamp so the interval always holds its estimate.
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate), len(data), confidence)


__all__ = ["DEFAULT_CONFIDENCE", "DEFAULT_RESAMPLES", "Interval", "average_over_seeds", "mean_interval",
           "paired_difference"]
