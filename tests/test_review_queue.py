"""Experts back in the loop: a real training run queues recent rollouts for review every N
steps, `calibrl sme review` serves the queue, the graded items come back as feedback records
that `calibrl sme drift` reads and `calibrl rubric distill` + `validate` turn into the next
rubric version, which the judge's folder watcher loads."""

from __future__ import annotations

import json
import shutil

import pytest

from calibrl.cli import main as calibrl
from calibrl.errors import ConfigError, FailedPrecondition
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.authoring.feedback import read_feedback, write_feedback
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric
from calibrl.judge_server.rubric_store import RubricFolder
from calibrl.sme.app import ReviewSettings, create_app
from calibrl.sme.items import read_items
from calibrl.sme.queue import ReviewConfig
from calibrl.testing import synthetic_feedback
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.loop import train
from tests.test_trainer_support import RUBRIC_ID, TrainerWorld, trainer_world  # noqa: F401 (fixture)


def test_review_settings_are_checked():
    with pytest.raises(ConfigError, match=r"review.every_steps=-1: must be >= 0"):
        ReviewConfig(every_steps=-1).validate()
    with pytest.raises(ConfigError, match=r"review.uncertain_share \+ disagree_share"):
        ReviewConfig(uncertain_share=0.7, disagree_share=0.7).validate()


def test_the_review_loop_from_rollouts_to_the_next_rubric_version(trainer_world, tmp_path):
    out = tmp_path / "run"
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(
        out, "steps=4", "review.every_steps=2", "review.n=3", "review.embedder=hashed-ngrams"))
    assert train(config, retrieval=retrieval, judge=judge).steps_done == 4

    # every second step, three rollouts of the last two steps are queued, with what scored them
    queue = read_items(out / "review" / "queue.jsonl")
    steps = [item.id.split("-")[0] for item in queue]  # s<step that generated the rollout>
    assert len(queue) == 6 and set(steps[:3]) <= {"s1", "s2"} and set(steps[3:]) <= {"s3", "s4"}
    rubric_hash = load_rubric(trainer_world.rubric_dir / "rewriter.yaml").hash
    for item in queue:
        assert item.judge_total is not None and 0.0 <= item.judge_total <= 1.0
        assert f"rubric {RUBRIC_ID}@{rubric_hash[:12]}" in item.model
        assert item.reasons and item.output
    metrics = read_log(out / "metrics.jsonl")
    assert [m.get("review/queued") for m in metrics] == [None, 3.0, None, 3.0]
    assert metrics[3]["review/queue_size"] == 6.0

    # calibrl sme review serves the queue; each answer is a feedback record
    feedback = out / "review" / "feedback.jsonl"
    app = create_app(ReviewSettings(sample=out / "review" / "queue.jsonl", out=feedback))
    client = app.test_client()
    assert client.post("/reviewer", data={"name": "alice", "next": "/review"}).status_code == 302
    for n, item in enumerate(queue, start=1):
        form = {"grade": "2", "tags": ["missed_intent"]} if n % 2 else {"grade": "5"}
        assert client.post(f"/item/{n}", data=form).status_code == 302
    graded = read_feedback(feedback)
    assert [r.id for r in graded] == [f"{item.id}@alice" for item in queue]

    # the drift monitor reads them (too few for a verdict at the default min_items: exit 0 and says so)
    report_path = tmp_path / "drift.json"
    assert calibrl(["sme", "drift", "--rubric", str(trainer_world.rubric_dir / "rewriter.yaml"), "--feedback",
                    str(feedback), "--judge-option", "embedder=hashed-ngrams", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["n_items"] == 6 and report["status"] == "too_few" and report["rubric_hash"] == rubric_hash
    assert "fewer than --min-items=10" in report["reason"]  # the option's name as the user typed it

    # ... and flow back: old feedback plus the new grades distil the next version, validated, published
    served = tmp_path / "served"
    shutil.copytree(trainer_world.rubric_dir, served)
    write_feedback(tmp_path / "old.jsonl", synthetic_feedback(200, seed=0))
    combined = tmp_path / "all.jsonl"
    combined.write_text((tmp_path / "old.jsonl").read_text() + feedback.read_text())
    live = Judge.from_config(JudgeConfig(embedder="hashed-ngrams"), served)  # serves validated versions only
    watcher = RubricFolder(live, served)
    with pytest.raises(FailedPrecondition, match="not validated"):  # the tests' rubric has no record
        live.resolve(RUBRIC_ID)
    staged = tmp_path / "next.yaml"
    assert calibrl(["rubric", "distill", "--feedback", str(combined), "--out", str(staged), "--golden-out",
                    str(tmp_path / "golden.jsonl"), "--id", RUBRIC_ID, "--version", "2", "--criteria",
                    "programmatic"]) == 0
    assert calibrl(["rubric", "validate", "--rubric", str(staged), "--golden", str(tmp_path / "golden.jsonl"),
                    "--judge", "programmatic", "embedder=hashed-ngrams", "--out",
                    str(served / "rewriter.yaml.validation.json")]) == 0
    staged.replace(served / "rewriter.yaml")
    (change,) = watcher.reload()
    assert change.action == "loaded" and change.version == "2"
    assert live.resolve(RUBRIC_ID).hash == load_rubric(served / "rewriter.yaml").hash != rubric_hash


def test_the_drift_check_during_training_raises_the_alarm_and_stops_the_run(trainer_world, tmp_path):
    """Between steps 2 and 4 an expert grades the queued rollouts against the judge (fails what it
    passes, passes what it fails): at step 4 the drift check logs the disagreement, warns and, with
    review.on_alarm=stop, stops the run after that step with a checkpoint."""
    from calibrl.judge_server.authoring.feedback import FeedbackRecord

    out = tmp_path / "run"
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(
        out, "steps=6", "review.every_steps=2", "review.n=6", "review.embedder=hashed-ngrams",
        "review.drift_min_items=4", "review.on_alarm=stop", "review.drift_gate=upper_bound", "checkpoint_every=0"))

    def grade_against_the_judge(step, metrics):
        if step == 2:
            items = read_items(out / "review" / "queue.jsonl")
            write_feedback(out / "review" / "feedback.jsonl", [
                FeedbackRecord(item.query, item.output, grade=2 if item.judge_total >= 0.6 else 5,
                               id=f"{item.id}@alice") for item in items])

    result = train(config, retrieval=retrieval, judge=judge, on_step=grade_against_the_judge)
    assert result.steps_done == 4 and result.stopped == "sigterm" and result.last_checkpoint is not None
    metrics = read_log(out / "metrics.jsonl")
    assert "drift/items" not in metrics[1]  # nothing graded yet at step 2
    assert metrics[3]["drift/items"] == 6.0 and metrics[3]["drift/alarm"] == 1.0
    assert metrics[3]["drift/agreement"] == 0.0  # the expert disagreed on every item
    (record,) = [json.loads(line) for line in (out / "review" / "drift.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["status"] == "alarm" and record["reason"].startswith("DRIFT:")
    assert "on the upper_bound" in record["reason"]  # review.drift_gate reaches the check
