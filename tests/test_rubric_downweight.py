"""review.on_alarm=downweight: a drift alarm lowers the rubric's weight in the blended reward from
the next step on, and a new rubric version restores it. Real training on the tiny world against a
real judge server and a real retrieval server on loopback (gRPC clients)."""

from __future__ import annotations

import shutil

import pytest

from calibrl.errors import ConfigError
from calibrl.judge_server.rubric import parse_rubric
from calibrl.sme.queue import ReviewConfig
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.rewards import RewardBreakdown
from calibrl.trainer.rubric_versions import read_versions
from calibrl.trainer.rubric_weight import reblend
from tests.test_trainer_support import RUBRIC_ID, RUBRIC_YAML, TrainerWorld, trainer_world  # noqa: F401 (fixture)

V2_YAML = RUBRIC_YAML.replace('version: "1"', 'version: "2"').replace("weight: 0.2", "weight: 0.25")
FACTOR = 0.25


def test_the_factor_is_checked_with_its_limit():
    with pytest.raises(ConfigError, match=r"review.downweight_factor=1.0: must be in \[0, 1\)"):
        ReviewConfig(downweight_factor=1.0).validate()
    with pytest.raises(ConfigError, match=r"review.downweight_factor=-0.5: must be in \[0, 1\)"):
        ReviewConfig(downweight_factor=-0.5).validate()
    ReviewConfig(downweight_factor=0.0).validate()  # 0 drops the rubric from the reward


def test_downweight_needs_a_drift_check_and_a_rubric_weight(trainer_world, tmp_path):
    with pytest.raises(ConfigError, match=r"review.on_alarm=downweight with review.every_steps=0"):
        load_train_config(None, trainer_world.overrides(tmp_path, "review.on_alarm=downweight"))
    with pytest.raises(ConfigError, match=r"review.on_alarm=downweight with reward.w_rubric=0"):
        load_train_config(None, trainer_world.overrides(tmp_path, "review.on_alarm=downweight",
                                                        "review.every_steps=2", judge=False))


def test_reblend_scales_only_the_rubric_weight():
    rows = [RewardBreakdown(0.7 * 0.5 + 0.3 * 0.8, {"retrieval": 0.5, "rubric": 0.8}),
            RewardBreakdown(0.3 * 1.0, {"retrieval": 0.0, "rubric": 1.0})]
    lowered = reblend(rows, {"retrieval": 0.7, "rubric": 0.3}, 0.25)
    assert [b.total for b in lowered] == pytest.approx([0.35 + 0.075 * 0.8, 0.075], abs=1e-15)
    assert [b.components for b in lowered] == [b.components for b in rows]
    assert [b.total for b in reblend(rows, {"retrieval": 0.7, "rubric": 0.3}, 1.0)] == pytest.approx(
        [b.total for b in rows], abs=1e-15)


def test_an_alarm_lowers_the_rubric_weight_until_a_new_version_is_served(trainer_world, tmp_path):
    """Step 2 queues rollouts and an expert grades them against the judge; the drift check of step 4
    raises the alarm; step 5 is blended with w_rubric x 0.25; after step 5 the judge serves a new
    version, which scores step 6 at the full weight again."""
    from calibrl.config import load_config
    from calibrl.judge_server.authoring.feedback import FeedbackRecord, write_feedback
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.judge_server.server import start as start_judge
    from calibrl.sme.items import read_items
    from calibrl.testing import start_test_server
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
    from calibrl.trainer.loop import train

    served = tmp_path / "served"
    shutil.copytree(trainer_world.rubric_dir, served)
    out = tmp_path / "run"
    judge_config = load_config(JudgeServerConfig, None, [
        f"rubrics={served}", "serving.port=0", "serving.host=127.0.0.1", "serving.grace_seconds=1",
        "judge.allow_unvalidated=true", "judge.embedder=hashed-ngrams", "judge.cache_size=0", "rubric_poll_s=0"])
    config = load_train_config(None, trainer_world.overrides(
        out, "steps=6", "review.every_steps=2", "review.n=6", "review.embedder=hashed-ngrams",
        "review.drift_min_items=4", "review.on_alarm=downweight", f"review.downweight_factor={FACTOR}",
        "checkpoint_every=0", "reward.w_retrieval=0.7", "reward.w_rubric=0.3"))

    with BackgroundLoop(name="test-servers") as loop:
        retrieval_server = loop.run(start_test_server(trainer_world.index_dir, retriever=trainer_world.retriever))
        judge_server = loop.run(start_judge(judge_config))
        retrieval = GrpcRetrievalClient(f"127.0.0.1:{retrieval_server.port}", timeout_s=60)
        judge = GrpcJudgeClient(f"127.0.0.1:{judge_server.port}", timeout_s=60)

        def on_step(step, metrics):
            if step == 2:  # the expert fails what the judge passes and passes what it fails
                items = read_items(out / "review" / "queue.jsonl")
                write_feedback(out / "review" / "feedback.jsonl", [
                    FeedbackRecord(item.query, item.output, grade=2 if item.judge_total >= 0.6 else 5,
                                   id=f"{item.id}@alice") for item in items])
            if step == 5:  # the next version is published and loaded
                (served / "rewriter.yaml").write_text(V2_YAML)
                changes = judge_server.servicer.rubric_folder.reload()
                assert [c.action for c in changes] == ["loaded"]

        try:
            result = train(config, retrieval=retrieval, judge=judge, on_step=on_step, background=loop)
        finally:
            loop.run(retrieval.close())
            loop.run(judge.close())
            loop.run(retrieval_server.stop(grace=1.0))
            loop.run(judge_server.stop(grace=1.0))
    assert result.steps_done == 6 and result.stopped == "completed"

    metrics = read_log(out / "metrics.jsonl")
    assert metrics[3]["drift/alarm"] == 1.0  # the drift check of step 4
    scales = [1.0, 1.0, 1.0, 1.0, FACTOR, 1.0]
    assert [m["rubric/weight_scale"] for m in metrics] == scales
    assert [m["rubric/weight"] for m in metrics] == pytest.approx([0.3 * s for s in scales], abs=1e-12)
    for m, scale in zip(metrics, scales):  # the blended reward is the mean of 0.7 r_ret + 0.3 scale r_rub
        expected = 0.7 * m["rewards/retrieval/mean"] + 0.3 * scale * m["rewards/rubric/mean"]
        assert m["reward"] == pytest.approx(expected, abs=1e-5)
    # step 5 measurably lost rubric weight: its reward is not the full blend
    full = 0.7 * metrics[4]["rewards/retrieval/mean"] + 0.3 * metrics[4]["rewards/rubric/mean"]
    assert full - metrics[4]["reward"] == pytest.approx(0.3 * 0.75 * metrics[4]["rewards/rubric/mean"], abs=1e-5)
    assert metrics[4]["rewards/rubric/mean"] > 0.05

    v1, v2 = parse_rubric(RUBRIC_YAML).hash, parse_rubric(V2_YAML).hash
    events = [(r["step"], r["event"], r["versions"]) for r in read_versions(out) if r["step"] <= 6]
    # the restore is decided in step 6's rewards phase, before the step's versions are logged
    assert events[:4] == [(1, "rubric_version", [v1]), (4, "rubric_downweighted", [v1]),
                          (6, "rubric_weight_restored", [v2]), (6, "rubric_changed", [v2])]
    downweighted = next(r for r in read_versions(out) if r["event"] == "rubric_downweighted")
    assert downweighted["factor"] == FACTOR and downweighted["from_step"] == 5
    assert downweighted["weight"] == pytest.approx(0.3 * FACTOR)


def _grade_against_the_judge(out):
    from calibrl.judge_server.authoring.feedback import FeedbackRecord, write_feedback
    from calibrl.sme.items import read_items

    items = read_items(out / "review" / "queue.jsonl")
    write_feedback(out / "review" / "feedback.jsonl", [
        FeedbackRecord(item.query, item.output, grade=2 if item.judge_total >= 0.6 else 5, id=f"{item.id}@alice")
        for item in items])


def test_a_resumed_run_keeps_the_lowered_weight(trainer_world, tmp_path):
    """The alarm of step 4 lowers the weight; the run is preempted after step 4 and resumed: steps
    5 and 6 (no new rubric version) are still blended with the lowered weight."""
    from calibrl.trainer.checkpoint import load_train_state
    from calibrl.trainer.loop import train

    out = tmp_path / "run"
    config = load_train_config(None, trainer_world.overrides(
        out, "steps=6", "review.every_steps=2", "review.n=6", "review.embedder=hashed-ngrams",
        "review.drift_min_items=4", "review.on_alarm=downweight", f"review.downweight_factor={FACTOR}",
        "checkpoint_every=0", "reward.w_retrieval=0.7", "reward.w_rubric=0.3"))
    retrieval, judge = trainer_world.clients()

    def on_step(step, metrics):
        if step == 2:
            _grade_against_the_judge(out)

    first = train(config, retrieval=retrieval, judge=judge, on_step=on_step, stop_after=4)
    assert first.steps_done == 4 and first.stopped == "stop_after"
    state = load_train_state(first.last_checkpoint)
    assert state.rubric_weight_scale == FACTOR and state.downweighted_versions == [parse_rubric(RUBRIC_YAML).hash]
    second = train(config, retrieval=retrieval, judge=judge, resume=out)
    assert second.steps_done == 6
    metrics = read_log(out / "metrics.jsonl")
    assert [m["rubric/weight_scale"] for m in metrics] == [1.0, 1.0, 1.0, 1.0, FACTOR, FACTOR]
    for m in metrics[4:]:
        assert m["reward"] == pytest.approx(0.7 * m["rewards/retrieval/mean"] + 0.3 * FACTOR *
                                            m["rewards/rubric/mean"], abs=1e-5)
    events = [(r["step"], r["event"]) for r in read_versions(out)]
    assert events == [(1, "rubric_version"), (4, "rubric_downweighted")]  # a second alarm does not repeat it
