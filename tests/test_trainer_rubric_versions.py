"""The trainer logs the rubric version of every step and a rubric_changed event when the
judge swaps versions mid-run; a run that pins the version is scored by it alone. Real
training on the tiny world (in-process judge), the swap made on the judge between steps."""

from __future__ import annotations

import json

import pytest

from calibrl.judge_server.rubric import parse_rubric
from calibrl.api.judge import CriterionScore, ItemScore
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.loop import train
from calibrl.trainer.rubric_versions import RubricVersionLog, read_versions
from tests.test_trainer_support import RUBRIC_ID, RUBRIC_YAML, TrainerWorld, trainer_world  # noqa: F401 (fixture)

V2_YAML = RUBRIC_YAML.replace('version: "1"', 'version: "2"').replace("weight: 0.5", "weight: 0.1")


def _score(rubric_hash, rubric_id="r"):
    return ItemScore((CriterionScore("c", 0.5, 1.0),), 0.5, rubric_id, rubric_hash, "m")


def test_the_log_records_the_first_version_and_each_change(tmp_path):
    versions = RubricVersionLog(tmp_path)
    assert versions.observe(1, [None]) == {}  # no rubric scored the step: no metric
    assert versions.observe(2, [_score("a" * 64), _score("a" * 64)]) == {"rubric/versions": 1.0,
                                                                         "rubric/changed": 0.0}
    assert versions.observe(3, [_score("a" * 64)])["rubric/changed"] == 0.0
    assert versions.observe(4, [_score("a" * 64), _score("b" * 64)]) == {"rubric/versions": 2.0,
                                                                         "rubric/changed": 1.0}
    records = read_versions(tmp_path)
    assert [(r["step"], r["event"], r["versions"], r["previous"]) for r in records] == [
        (2, "rubric_version", ["a" * 64], []), (4, "rubric_changed", ["a" * 64, "b" * 64], ["a" * 64])]
    resumed = RubricVersionLog(tmp_path, resume_step=3)  # records of later steps are dropped, the state kept
    assert [r["step"] for r in read_versions(tmp_path)] == [2]
    assert resumed.observe(4, [_score("a" * 64)])["rubric/changed"] == 0.0


def _swap_after_first_step(judge_client):
    judge = judge_client.judge

    def on_step(step, metrics):
        if step == 1:
            new = parse_rubric(V2_YAML)
            judge.versions.install(judge.rubric_status(new, None))  # allow_unvalidated: usable
    return on_step


@pytest.mark.parametrize("pinned", [False, True])
def test_a_swap_mid_run_is_logged_and_a_pinned_run_ignores_it(trainer_world, tmp_path, pinned):
    v1, v2 = parse_rubric(RUBRIC_YAML), parse_rubric(V2_YAML)
    rubric_id = f"{RUBRIC_ID}@{v1.hash[:12]}" if pinned else RUBRIC_ID
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(tmp_path, "steps=3", f"reward.rubric_id={rubric_id}"))
    result = train(config, retrieval=retrieval, judge=judge, on_step=_swap_after_first_step(judge))
    assert result.steps_done == 3
    records = read_versions(tmp_path)
    metrics = read_log(tmp_path / "metrics.jsonl")
    if pinned:
        assert [(r["step"], r["event"], r["versions"]) for r in records] == [(1, "rubric_version", [v1.hash])]
        assert [m["rubric/changed"] for m in metrics] == [0.0, 0.0, 0.0]
    else:
        assert [(r["step"], r["event"], r["versions"], r["previous"]) for r in records] == [
            (1, "rubric_version", [v1.hash], []), (2, "rubric_changed", [v2.hash], [v1.hash])]
        assert [m["rubric/changed"] for m in metrics] == [0.0, 1.0, 0.0]
    assert [m["rubric/versions"] for m in metrics] == [1.0, 1.0, 1.0]
    assert json.loads((tmp_path / "rubric_versions.jsonl").read_text().splitlines()[0])["rubric_id"] == RUBRIC_ID
