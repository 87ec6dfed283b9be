"""rewards/judge_retrieval_disagreement: how often the rubric judge and retrieval disagree,
on hand-made reward breakdowns, its health band and warning, and on a real training run
(tiny random policy, real index, programmatic rubric judge in process)."""

from __future__ import annotations

import logging

import pytest

from calibrl.errors import ConfigError
from calibrl.api.judge import ItemScore
from calibrl.api.retrieval import RetrievalScore
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import HealthConfig, health_warnings, judge_retrieval_disagreement
from calibrl.trainer.loop import train
from calibrl.trainer.rewards import RewardBreakdown
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)

NAMES = ("rewards/judge_high_retrieval_miss", "rewards/judge_low_retrieval_hit", "rewards/judge_retrieval_disagreement")


def _rewrite(hit: bool | None, rubric: float | None) -> RewardBreakdown:
    """A rewrite's breakdown: ``hit`` None = no retrieval result, ``rubric`` None = no rubric score."""
    retrieval = None if hit is None else RetrievalScore(
        hits=(), hit=hit, all_gold=hit, recall=float(hit), mrr=float(hit), ndcg=float(hit),
        first_gold_rank=1 if hit else 0)
    score = None if rubric is None else ItemScore(criteria=(), total=rubric)
    components = {"retrieval": float(bool(hit))} | ({} if rubric is None else {"rubric": rubric})
    return RewardBreakdown(0.0, components, retrieval, score)


def test_both_directions_and_their_sum_on_hand_made_breakdowns():
    breakdowns = [
        _rewrite(False, 0.9),  # judge high, retrieval miss
        _rewrite(False, 0.5),  # judge high (>= threshold, inclusive), retrieval miss
        _rewrite(True, 0.2),  # retrieval hit, judge low
        _rewrite(True, 0.8),  # agree: both good
        _rewrite(False, 0.1),  # agree: both bad
        _rewrite(True, 0.49),  # retrieval hit, judge low (just under the threshold)
        _rewrite(True, 0.7),  # agree
        _rewrite(False, 0.0),  # agree
    ]
    metrics = judge_retrieval_disagreement(breakdowns, rubric_high=0.5)
    assert metrics["rewards/judge_high_retrieval_miss"] == 2 / 8
    assert metrics["rewards/judge_low_retrieval_hit"] == 2 / 8
    assert metrics["rewards/judge_retrieval_disagreement"] == 4 / 8
    assert metrics["rewards/judge_retrieval_pairs"] == 8.0
    # A stricter judge threshold moves the 0.5 and 0.7 rewrites to "low".
    strict = judge_retrieval_disagreement(breakdowns, rubric_high=0.75)
    assert strict["rewards/judge_high_retrieval_miss"] == 1 / 8
    assert strict["rewards/judge_low_retrieval_hit"] == 3 / 8


def test_only_rollouts_with_both_components_count():
    breakdowns = [
        _rewrite(False, 0.9),  # compared: disagreement
        _rewrite(True, 0.9),  # compared: agreement
        _rewrite(True, None),  # binary-only or rubric weight 0: no rubric, left out
        _rewrite(None, 0.9),  # search rollout judged on its answer: no retrieval result, left out
        _rewrite(None, None),
    ]
    metrics = judge_retrieval_disagreement(breakdowns, rubric_high=0.5)
    assert metrics["rewards/judge_retrieval_pairs"] == 2.0
    assert metrics["rewards/judge_retrieval_disagreement"] == 0.5
    # Nothing to compare: no metric at all (never a 0 that would read as "they agree").
    assert judge_retrieval_disagreement(breakdowns[2:], rubric_high=0.5) == {}
    assert judge_retrieval_disagreement([], rubric_high=0.5) == {}


def test_warning_band():
    bands = HealthConfig(max_judge_retrieval_disagreement=0.25)
    calm = {"rewards/judge_retrieval_disagreement": 0.25, "rewards/judge_high_retrieval_miss": 0.25}
    assert health_warnings(calm, bands) == []  # at the band: no warning
    loud = {"rewards/judge_retrieval_disagreement": 0.375, "rewards/judge_high_retrieval_miss": 0.25,
            "rewards/judge_low_retrieval_hit": 0.125}
    (warning,) = health_warnings(loud, bands)
    assert "rewards/judge_retrieval_disagreement=0.375 > 0.25" in warning
    assert "retrieval miss 0.250" in warning and "judge low 0.125" in warning
    assert health_warnings({}, bands) == []  # no pairs this step: nothing to warn about


@pytest.mark.parametrize("field, value", [("rubric_high", 1.5), ("rubric_high", -0.1),
                                          ("max_judge_retrieval_disagreement", 2.0)])
def test_health_fields_are_validated(trainer_world, tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"health.{field}={value}: must be in \[0, 1\]"):
        load_train_config(None, trainer_world.overrides(tmp_path, f"health.{field}={value}"))


def test_a_training_run_logs_the_disagreement_and_warns_above_the_band(trainer_world: TrainerWorld, tmp_path, caplog):
    retrieval, judge = trainer_world.clients()
    # A band of 0 warns on any disagreement; a threshold of 0 makes every rubric total "high", so the
    # share "judge high, retrieval miss" is exactly the share of rewrites that missed the gold passage.
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, "health.max_judge_retrieval_disagreement=0", "health.rubric_high=0", "reward.retrieval_signal=hit"))
    with caplog.at_level(logging.WARNING, logger="calibrl.trainer.step_log"):
        result = train(config, retrieval=retrieval, judge=judge)
    disagreement_warnings = [r for r in caplog.records if "judge_retrieval_disagreement" in r.getMessage()]
    for step, record in enumerate(result.history, start=1):
        assert all(name in record for name in NAMES)
        assert record["rewards/judge_retrieval_pairs"] == 16.0  # 4 prompts x 4 rollouts, all rewrites
        assert record["rewards/judge_low_retrieval_hit"] == 0.0  # nothing is "low" at threshold 0
        # retrieval_signal=hit: rewards/retrieval/mean is the hit rate, so the miss share is its complement.
        assert record["rewards/judge_high_retrieval_miss"] == pytest.approx(1.0 - record["rewards/retrieval/mean"],
                                                                          abs=1e-12)
        warned = record["rewards/judge_retrieval_disagreement"] > 0
        assert any(f"step {step}:" in r.getMessage() for r in disagreement_warnings) is warned
        assert record["health/warnings"] >= float(warned)
    assert any(r["rewards/judge_retrieval_disagreement"] > 0 for r in result.history)
    assert result.history[-1]["health/warnings_total"] == sum(r["health/warnings"] for r in result.history)
