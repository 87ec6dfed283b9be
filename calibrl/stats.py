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

Units that are not independent (several phrasings of one question) are resampled
together: ``clusters`` labels each unit's cluster, a bootstrap sample draws whole
clusters (within their stratum), and its mean is over the units drawn.

Percentile intervals (the 2.5th and 97.5th percentiles of the resampled means,
numpy's linear interpolation). Everything is seeded: the same inputs and seed
give the same interval on every machine (numpy's PCG64 generator draws the same
indices everywhere; the means are float64 sums of the inputs).

A paired difference resamples the same questions for both arms, so the spread
of questions that every arm finds easy or hard cancels out; its point estimate
is exactly the difference of the two arms' means over the same units.

Training seeds vary too: an arm trained again with another seed ends elsewhere.
Resampling questions within seeds (``strata``) leaves that variance out; the
hierarchical bootstrap (:func:`hierarchical_difference`) puts it in: each
resample draws seeds with replacement, then, for every seed drawn, that seed's
clusters of questions with replacement. With few seeds its interval is wide, as
it should be: it says how far another set of seeds could land.
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


def describe_difference(a: str, b: str, interval: Interval | dict[str, float], unit: str, scale: float = 100.0) -> str:
    """One sentence on a paired difference ``a - b`` whose wording follows its interval:
    "beats" / "is below" only when the interval excludes zero, else "indistinguishable"."""
    values = interval.as_dict() if isinstance(interval, Interval) else interval
    estimate, low, high = (scale * values[k] for k in ("estimate", "low", "high"))
    span = f"{estimate:+.1f} {unit}, 95% interval [{low:+.1f}, {high:+.1f}]"
    if values["low"] > 0:
        return f"{a} beats {b}: {span}."
    if values["high"] < 0:
        return f"{a} is below {b}: {span}."
    return f"{a} and {b} are indistinguishable: {span} includes zero."


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
                  clusters: Sequence[Any] | None = None, resamples: int = DEFAULT_RESAMPLES,
                  confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Interval:
    """The mean of ``values`` (one per unit) with its bootstrap percentile interval;
    ``strata`` (one label per unit, e.g. its seed) resamples within each label;
    ``clusters`` (one label per unit, e.g. the question behind a phrasing) resamples
    whole clusters."""
    data = _checked("values", values)
    members = _cluster_members(clusters, len(data))
    groups = _strata_of_clusters(strata, members, len(data))
    means = _bootstrap_means(data, members, groups, resamples, confidence, seed)
    return _interval(data, means, confidence)


def paired_difference(a: Sequence[float], b: Sequence[float], *, strata: Sequence[Any] | None = None,
                      clusters: Sequence[Any] | None = None, resamples: int = DEFAULT_RESAMPLES,
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Interval:
    """Mean of ``a - b`` over the same units (``a[i]`` and ``b[i]`` score the same
    question) with its paired bootstrap interval: each resample draws units (or whole
    ``clusters`` of units), and both arms' scores of a drawn unit go in together."""
    left, right = _checked("a", a), _checked("b", b)
    if len(left) != len(right):
        raise InvalidArgument("b", f"has {len(right)} scores but a has {len(left)}: a paired test needs the same units")
    differences = [x - y for x, y in zip(left, right)]
    return mean_interval(differences, strata=strata, clusters=clusters, resamples=resamples, confidence=confidence,
                         seed=seed)


def hierarchical_difference(a_per_seed: Sequence[Sequence[float]], b_per_seed: Sequence[Sequence[float]], *,
                            clusters_per_seed: Sequence[Sequence[Any]] | None = None,
                            resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                            seed: int = 0) -> Interval:
    """Mean of ``a - b`` over every (seed, unit), with a two-level bootstrap interval:
    seeds drawn with replacement, then each drawn seed's clusters (``clusters_per_seed[s]``
    labels seed ``s``'s units; every unit its own cluster without it) with replacement;
    a resample's mean is over the units drawn. ``a_per_seed[s][i]`` and ``b_per_seed[s][i]``
    score the same unit; seeds may hold different units."""
    import numpy as np

    if not a_per_seed:
        raise InvalidArgument("a_per_seed", "needs at least one seed")
    if len(a_per_seed) != len(b_per_seed):
        raise InvalidArgument("b_per_seed", f"has {len(b_per_seed)} seeds but a_per_seed has {len(a_per_seed)}")
    if clusters_per_seed is not None and len(clusters_per_seed) != len(a_per_seed):
        raise InvalidArgument("clusters_per_seed", f"has {len(clusters_per_seed)} seeds for {len(a_per_seed)}")
    _check_resampling(resamples, confidence)
    sums, sizes, data = [], [], []
    for s, (a, b) in enumerate(zip(a_per_seed, b_per_seed)):
        left, right = _checked(f"a_per_seed[{s}]", a), _checked(f"b_per_seed[{s}]", b)
        if len(left) != len(right):
            raise InvalidArgument(f"b_per_seed[{s}]", f"has {len(right)} scores but a_per_seed[{s}] has {len(left)}")
        differences = [x - y for x, y in zip(left, right)]
        members = _cluster_members(None if clusters_per_seed is None else clusters_per_seed[s], len(differences))
        sums.append(np.asarray([math.fsum(differences[i] for i in units) for units in members], dtype=np.float64))
        sizes.append(np.asarray([len(units) for units in members], dtype=np.float64))
        data += differences
    rng = np.random.default_rng(seed)
    count = len(sums)
    picks = rng.integers(0, count, size=(resamples, count))
    totals = np.zeros(resamples, dtype=np.float64)
    units_drawn = np.zeros(resamples, dtype=np.float64)
    for position in range(count):
        for s in range(count):
            rows = np.flatnonzero(picks[:, position] == s)
            if not len(rows):
                continue
            draws = rng.integers(0, len(sums[s]), size=(len(rows), len(sums[s])))
            totals[rows] += sums[s][draws].sum(axis=1)
            units_drawn[rows] += sizes[s][draws].sum(axis=1)
    return _interval(data, totals / units_drawn, confidence)


# --------------------------------------------------------------------------- internals


def _check_resampling(resamples: int, confidence: float) -> None:
    if resamples < 100:
        raise InvalidArgument("resamples", f"is {resamples}: use at least 100 for a 95% interval")
    if not 0 < confidence < 1:
        raise InvalidArgument("confidence", f"is {confidence}: must be in (0, 1)")


def _checked(name: str, values: Sequence[float]) -> list[float]:
    data = [float(v) for v in values]
    if not data:
        raise InvalidArgument(name, "is empty: a mean needs at least one unit")
    bad = next((i for i, v in enumerate(data) if not math.isfinite(v)), None)
    if bad is not None:
        raise InvalidArgument(name, f"item {bad} is {data[bad]}: every score must be a finite number")
    return data


def _cluster_members(clusters: Sequence[Any] | None, count: int) -> list[list[int]]:
    """The units of each cluster, in order of first appearance (every unit its own without labels)."""
    if clusters is None:
        return [[i] for i in range(count)]
    if len(clusters) != count:
        raise InvalidArgument("clusters", f"has {len(clusters)} labels for {count} units")
    members: dict[Any, list[int]] = {}
    for i, label in enumerate(clusters):
        members.setdefault(label, []).append(i)
    return list(members.values())


def _strata_of_clusters(strata: Sequence[Any] | None, members: list[list[int]], count: int) -> list[list[int]]:
    """Cluster indices per stratum; a cluster must lie in one stratum."""
    if strata is None:
        return [list(range(len(members)))]
    if len(strata) != count:
        raise InvalidArgument("strata", f"has {len(strata)} labels for {count} units")
    groups: dict[Any, list[int]] = {}
    for c, units in enumerate(members):
        labels = {strata[i] for i in units}
        if len(labels) != 1:
            raise InvalidArgument("clusters", f"cluster {c} spans strata {sorted(map(str, labels))}: a cluster must "
                                  "lie in one stratum")
        groups.setdefault(strata[units[0]], []).append(c)
    return list(groups.values())


def _bootstrap_means(data: list[float], members: list[list[int]], groups: list[list[int]], resamples: int,
                     confidence: float, seed: int) -> Any:
    """(resamples,) means of stratified cluster resamples of ``data``: each stratum
    draws as many clusters as it holds; a sample's mean is over the units drawn."""
    import numpy as np

    _check_resampling(resamples, confidence)
    values = np.asarray(data, dtype=np.float64)
    sums = np.asarray([math.fsum(values[units]) for units in members], dtype=np.float64)
    sizes = np.asarray([len(units) for units in members], dtype=np.float64)
    rng = np.random.default_rng(seed)
    totals = np.zeros(resamples, dtype=np.float64)
    counts = np.zeros(resamples, dtype=np.float64)
    for group in groups:
        index = np.asarray(group)
        draws = index[rng.integers(0, len(group), size=(resamples, len(group)))]
        totals += sums[draws].sum(axis=1)
        counts += sizes[draws].sum(axis=1)
    return totals / counts


def _interval(data: list[float], means: Any, confidence: float) -> Interval:
    import numpy as np

    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    estimate = math.fsum(data) / len(data)
    # A percentile of resampled means can differ from the estimate in the last bits
    # when every unit is equal; clamp so the interval always holds its estimate.
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate), len(data), confidence)


# --------------------------------------------------------------------------- agreement


def kappa_interval(first: Sequence[bool], second: Sequence[bool], *, clusters: Sequence[Any] | None = None,
                   resamples: int = DEFAULT_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                   seed: int = 0) -> Interval:
    """Cohen's kappa of two raters' pass/fail (``first[i]``, ``second[i]``: their verdicts on
    item i) with its bootstrap percentile interval: each resample draws items (or whole
    ``clusters`` of items, e.g. the reviews of one task) with replacement, both raters'
    verdicts of a drawn item together, and recomputes kappa.

    Kappa is undefined when both raters use one class (chance agreement 1): the estimate
    is then NaN, and resamples where it is undefined are left out of the percentiles
    (when more than half are, the interval is NaN too: the items cannot tell)."""
    import numpy as np

    if len(first) != len(second):
        raise InvalidArgument("second", f"has {len(second)} verdicts but first has {len(first)}")
    if not first:
        raise InvalidArgument("first", "is empty: kappa needs at least one item")
    _check_resampling(resamples, confidence)
    members = _cluster_members(clusters, len(first))
    # Per cluster: items where both pass, first only, second only (both fail = size - the rest).
    cells = np.asarray([[sum(bool(first[i]) and bool(second[i]) for i in units),
                         sum(bool(first[i]) and not bool(second[i]) for i in units),
                         sum(not bool(first[i]) and bool(second[i]) for i in units),
                         len(units)] for units in members], dtype=np.float64)
    estimate = float(_kappa_of_cells(cells.sum(axis=0, keepdims=True))[0])
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(members), size=(resamples, len(members)))
    kappas = _kappa_of_cells(cells[draws].sum(axis=1))
    defined = kappas[np.isfinite(kappas)]
    if not math.isfinite(estimate) or len(defined) * 2 < resamples:
        return Interval(estimate, math.nan, math.nan, len(first), confidence)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(defined, [tail, 100 - tail])
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate), len(first), confidence)


def _kappa_of_cells(cells: Any) -> Any:
    """Cohen's kappa of rows (both pass, first only, second only, n) of pass/fail counts."""
    import numpy as np

    both, only_first, only_second, n = cells[:, 0], cells[:, 1], cells[:, 2], cells[:, 3]
    with np.errstate(divide="ignore", invalid="ignore"):
        observed = (n - only_first - only_second) / n
        first_pass, second_pass = (both + only_first) / n, (both + only_second) / n
        chance = first_pass * second_pass + (1 - first_pass) * (1 - second_pass)
        kappa = (observed - chance) / (1 - chance)
    return np.where(chance < 1 - 1e-12, kappa, np.nan)


__all__ = ["DEFAULT_CONFIDENCE", "DEFAULT_RESAMPLES", "Interval", "average_over_seeds", "describe_difference",
           "hierarchical_difference", "kappa_interval", "mean_interval", "paired_difference"]
