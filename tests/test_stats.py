"""calibrl.stats: bootstrap intervals on cases whose answer is known, against a
plain-loop reference, and their input checks."""

from __future__ import annotations

import math
import random

import pytest

from calibrl.errors import InvalidArgument
from calibrl.stats import average_over_seeds, hierarchical_difference, mean_interval, paired_difference

# The estimates are float64 means of at most a few hundred numbers in [0, 1]: their
# rounding error is below 1e-15, so 1e-12 allows for any summation order.
SUM_TOL = 1e-12


def _scores(count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.choice([0.0, 0.0, 0.5, 1.0]) * rng.random() for _ in range(count)]


def test_identical_arms_give_exactly_zero():
    a = _scores(120, 1)
    diff = paired_difference(a, list(a))
    assert (diff.estimate, diff.low, diff.high) == (0.0, 0.0, 0.0)
    assert not diff.excludes_zero


def test_a_constant_shift_gives_an_interval_at_the_shift():
    a = _scores(150, 2)
    diff = paired_difference([x + 0.1 for x in a], a)
    # Every paired difference is 0.1 up to one rounding of x + 0.1 (<= 1.2e-16).
    assert diff.estimate == pytest.approx(0.1, abs=SUM_TOL)
    assert diff.low == pytest.approx(0.1, abs=SUM_TOL) and diff.high == pytest.approx(0.1, abs=SUM_TOL)
    assert diff.excludes_zero


def test_independent_noise_gives_an_interval_around_zero_and_pairing_narrows_it():
    rng = random.Random(3)
    difficulty = [rng.random() for _ in range(200)]
    a = [d + rng.gauss(0, 0.05) for d in difficulty]
    b = [d + rng.gauss(0, 0.05) for d in difficulty]
    paired = paired_difference(a, b)
    assert paired.low < 0 < paired.high
    # Unpaired, the spread of question difficulty (sd 0.29) enters twice; paired it cancels.
    width_a, width_b = (mean_interval(x) for x in (a, b))
    assert paired.high - paired.low < 0.5 * ((width_a.high - width_a.low) + (width_b.high - width_b.low)) / 2


def test_the_paired_estimate_is_the_difference_of_the_means():
    a, b = _scores(90, 4), _scores(90, 5)
    diff = paired_difference(a, b)
    assert diff.estimate == pytest.approx(mean_interval(a).estimate - mean_interval(b).estimate, abs=SUM_TOL)


def test_the_interval_of_a_mean_holds_the_mean_and_has_the_normal_width():
    values = _scores(400, 6)
    interval = mean_interval(values)
    mean = sum(values) / len(values)
    assert interval.estimate == pytest.approx(mean, abs=SUM_TOL)
    assert interval.low < mean < interval.high
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    normal_half_width = 1.96 * sd / math.sqrt(len(values))
    # The percentile bootstrap of a mean of 400 bounded values is close to the normal
    # interval; 10,000 resamples leave a Monte Carlo error of a few percent of its width.
    assert (interval.high - interval.low) / 2 == pytest.approx(normal_half_width, rel=0.1)


def test_seeded_and_deterministic():
    values = _scores(60, 7)
    assert mean_interval(values, seed=11) == mean_interval(values, seed=11)
    assert mean_interval(values, seed=11) != mean_interval(values, seed=12)


def _reference_stratified_means(values, strata, resamples, seed):
    """The obvious loop: per resample, draw each stratum's members with replacement
    in the order numpy's generator gives them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    groups = {}
    for i, label in enumerate(strata):
        groups.setdefault(label, []).append(i)
    draws = {label: rng.integers(0, len(members), size=(resamples, len(members)))
             for label, members in groups.items()}
    means = []
    for r in range(resamples):
        total = 0.0
        for label, members in groups.items():
            total += sum(values[members[j]] for j in draws[label][r])
        means.append(total / len(values))
    return sorted(means)


def test_stratified_resampling_matches_a_plain_loop_and_keeps_each_strata_share():
    values = [1.0] * 30 + [0.0] * 10  # seed "a": all right; seed "b": all wrong
    strata = ["a"] * 30 + ["b"] * 10
    interval = mean_interval(values, strata=strata, resamples=500, seed=5)
    # Within-stratum resampling cannot change the mix of 30 ones and 10 zeros.
    assert (interval.low, interval.estimate, interval.high) == pytest.approx((0.75, 0.75, 0.75), abs=SUM_TOL)
    noisy = _scores(40, 8)
    got = mean_interval(noisy, strata=strata, resamples=500, seed=5)
    import numpy as np

    reference = np.percentile(_reference_stratified_means(noisy, strata, 500, 5), [2.5, 97.5])
    assert (got.low, got.high) == pytest.approx(tuple(reference), abs=SUM_TOL)


def test_average_over_seeds():
    assert average_over_seeds([[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]]) == pytest.approx([0.5, 1 / 3], abs=SUM_TOL)
    with pytest.raises(InvalidArgument, match="seed 1 has 1 questions, seed 0 has 2"):
        average_over_seeds([[1.0, 0.0], [1.0]])


@pytest.mark.parametrize("call, message", [
    (lambda: mean_interval([]), "values: is empty"),
    (lambda: mean_interval([0.1, math.nan]), "values: item 1 is nan"),
    (lambda: paired_difference([0.1, 0.2], [0.1]), "b: has 1 scores but a has 2"),
    (lambda: mean_interval([0.1, 0.2], strata=["a"]), "strata: has 1 labels for 2 units"),
    (lambda: mean_interval([0.1, 0.2], resamples=10), "resamples: is 10"),
    (lambda: mean_interval([0.1, 0.2], confidence=1.0), "confidence: is 1.0"),
])
def test_bad_input_names_the_field(call, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        call()


def test_clusters_resample_whole_clusters() -> None:
    """Units of one cluster move together: a cluster bootstrap of identical copies of
    each value is as wide as the plain bootstrap of one copy each, and clearly wider than
    a bootstrap that treats the copies as independent; a cluster split over two strata is refused."""
    values = [float(v) for v in range(-20, 20)]
    copies = [v for v in values for _ in range(6)]
    labels = [i // 6 for i in range(len(copies))]
    one_each = mean_interval(values, resamples=4000)
    clustered = mean_interval(copies, clusters=labels, resamples=4000)
    independent = mean_interval(copies, resamples=4000)
    assert clustered.estimate == one_each.estimate == independent.estimate
    assert clustered.units == len(copies)
    # 40 clusters of 6 equal values: the cluster means are the 40 values, so the widths
    # agree up to the bootstrap's own noise (4000 resamples: a few percent)
    assert clustered.high - clustered.low == pytest.approx(one_each.high - one_each.low, rel=0.1)
    assert clustered.high - clustered.low > 2 * (independent.high - independent.low)
    # singleton clusters are the plain bootstrap, bit for bit
    assert mean_interval(values, clusters=list(range(40)), resamples=500) == mean_interval(
        values, resamples=500)
    with pytest.raises(InvalidArgument, match="clusters"):
        mean_interval([1.0, 2.0], clusters=["a"])
    with pytest.raises(InvalidArgument, match="one stratum"):
        paired_difference([1.0, 2.0], [0.0, 0.0], clusters=["a", "a"], strata=[0, 1])


# --------------------------------------------------------------------------- hierarchical bootstrap


def test_hierarchical_estimate_is_the_pooled_mean_and_a_constant_shift_has_no_spread():
    a = [_scores(80, 10 + s) for s in range(3)]
    shifted = [[x + 0.2 for x in seed] for seed in a]
    diff = hierarchical_difference(shifted, a)
    assert diff.estimate == pytest.approx(0.2, abs=SUM_TOL)
    assert diff.low == pytest.approx(0.2, abs=SUM_TOL) and diff.high == pytest.approx(0.2, abs=SUM_TOL)
    assert diff.units == 240


def test_seed_to_seed_variance_widens_the_hierarchical_interval_beyond_the_stratified_one():
    # Five training seeds whose gains differ (0.00 .. 0.20) and little question noise:
    # resampling questions within seeds cannot see the seed spread, the hierarchical bootstrap does.
    rng = random.Random(11)
    base = [[rng.random() for _ in range(100)] for _ in range(5)]
    arm = [[x + gain + rng.gauss(0, 0.01) for x in seed] for seed, gain in zip(base, (0.0, 0.05, 0.1, 0.15, 0.2))]
    hier = hierarchical_difference(arm, base)
    flat_a = [x for seed in arm for x in seed]
    flat_b = [x for seed in base for x in seed]
    strata = [s for s in range(5) for _ in range(100)]
    stratified = paired_difference(flat_a, flat_b, strata=strata)
    assert hier.estimate == pytest.approx(stratified.estimate, abs=SUM_TOL)
    assert (hier.high - hier.low) > 4 * (stratified.high - stratified.low)
    # the seed means range over 0..0.2: the interval covers much of it
    assert hier.low < 0.07 and hier.high > 0.13


def test_hierarchical_matches_a_plain_loop_reference_in_distribution():
    # The reference: the same two-level draw written as loops; with different random streams
    # the two intervals agree to the bootstrap's own noise (2 points at 4,000 resamples here).
    rng = random.Random(12)
    a = [[rng.random() for _ in range(n)] for n in (40, 60, 50)]
    b = [[rng.random() * 0.8 for _ in range(n)] for n in (40, 60, 50)]
    clusters = [[i // 2 for i in range(len(seed))] for seed in a]
    fast = hierarchical_difference(a, b, clusters_per_seed=clusters, resamples=4000, seed=1)
    draw = random.Random(2)
    means = []
    for _ in range(4000):
        total = count = 0.0
        for _ in range(3):
            s = draw.randrange(3)
            labels = sorted(set(clusters[s]))
            for _ in labels:
                c = draw.choice(labels)
                for i, label in enumerate(clusters[s]):
                    if label == c:
                        total += a[s][i] - b[s][i]
                        count += 1
        means.append(total / count)
    means.sort()
    low, high = means[int(0.025 * 4000)], means[int(0.975 * 4000) - 1]
    assert fast.low == pytest.approx(low, abs=0.02) and fast.high == pytest.approx(high, abs=0.02)


def test_hierarchical_checks_its_inputs():
    with pytest.raises(InvalidArgument, match="b_per_seed"):
        hierarchical_difference([[0.1, 0.2]], [[0.1]])
    with pytest.raises(InvalidArgument, match="a_per_seed"):
        hierarchical_difference([], [])
    with pytest.raises(InvalidArgument, match="clusters_per_seed"):
        hierarchical_difference([[0.1]], [[0.2]], clusters_per_seed=[[0], [1]])
