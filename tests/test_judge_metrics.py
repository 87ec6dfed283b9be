"""Agreement statistics against reference implementations (scikit-learn, SciPy) on random data."""

import random

import pytest

from calibrl.judge_server import metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

@pytest.mark.parametrize("seed", range(5))
def test_kappas_match_sklearn(seed):
    rng = random.Random(seed)
    expert = [rng.randint(1, 5) for _ in range(60)]
    judge = [min(5, max(1, g + rng.choice([-2, -1, 0, 0, 0, 1]))) for g in expert]
    assert metrics.quadratic_weighted_kappa(expert, judge) == pytest.approx(
        sklearn_metrics.cohen_kappa_score(expert, judge, weights="quadratic", labels=[1, 2, 3, 4, 5]))
    expert_pass = ["pass" if g >= 4 else "fail" for g in expert]
    judge_pass = ["pass" if g >= 4 else "fail" for g in judge]
    assert metrics.cohen_kappa(expert_pass, judge_pass, ["pass", "fail"]) == pytest.approx(
        sklearn_metrics.cohen_kappa_score(expert_pass, judge_pass))
    totals = [rng.random() for _ in expert]
    assert metrics.spearman(expert, totals) == pytest.approx(stats.spearmanr(expert, totals).statistic)
    assert metrics.spearman(expert, judge) == pytest.approx(stats.spearmanr(expert, judge).statistic)


def test_undefined_and_edge_cases():
    assert metrics.cohen_kappa(["pass"] * 4, ["pass"] * 4, ["pass", "fail"]) is None
    assert metrics.cohen_kappa(["pass", "fail"], ["pass", "fail"], ["pass", "fail"]) == pytest.approx(1.0)
    assert metrics.cohen_kappa(["pass", "fail"], ["fail", "pass"], ["pass", "fail"]) == pytest.approx(-1.0)
    assert metrics.spearman([1, 2, 3], [0.5, 0.5, 0.5]) is None
    assert metrics.confusion(["a", "b", "a"], ["a", "a", "b"], ["a", "b"]) == [[1, 1], [1, 0]]
    with pytest.raises(ValueError, match="rater lengths differ"):
        metrics.confusion(["a"], [], ["a"])


def test_precision_recall():
    result = metrics.precision_recall([True, True, False, False, True], [True, False, True, False, True])
    assert (result["tp"], result["fp"], result["fn"], result["support"]) == (2, 1, 1, 3)
    assert result["precision"] == pytest.approx(2 / 3) and result["recall"] == pytest.approx(2 / 3)
    none = metrics.precision_recall([False, False], [False, False])
    assert none["precision"] is None and none["recall"] is None
