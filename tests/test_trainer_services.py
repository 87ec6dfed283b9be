"""`calibrl train` against both REAL services on loopback: a retrieval server over
the tiny index and a judge server with the programmatic rubric, both grpc.aio on
port 0, reached through the gRPC clients the CLI builds from the config."""

from __future__ import annotations

import json

import pytest

from calibrl.cli import main as calibrl_main
from tests.test_trainer_support import (  # noqa: F401  (fixtures)
    RUBRIC_ID, one_torch_thread, train_against_real_services, trainer_world)
from calibrl.trainer.checkpoint import find_checkpoint, load_train_state
from calibrl.trainer.diagnostics import read_log


@pytest.mark.slow
def test_calibrl_train_against_real_retrieval_and_judge_servers(trainer_world, tmp_path, capsys):
    def evaluate(retrieval_port: int) -> int:  # the trained run, evaluated through the same retrieval server
        return calibrl_main([
            "eval", "--model", str(tmp_path), "--tasks", str(trainer_world.rewrite_tasks), "--limit", "4",
            "--retrieval", f"127.0.0.1:{retrieval_port}", "--max-new-tokens", "6", "--device", "cpu",
            "--raw-query-baseline", "--out", str(tmp_path / "eval.json"),
        ])

    code, eval_code = train_against_real_services(trainer_world, tmp_path, "steps=2", "tensorboard=true",
                                                  then=evaluate)
    assert code == 0 and eval_code == 0, capsys.readouterr().err
    records = read_log(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # Both services answered: the blend has a retrieval and a rubric part.
        assert 0.0 <= record["rewards/retrieval/mean"] <= 1.0
        assert 0.0 < record["rewards/rubric/mean"] <= 1.0
        # float32 means of a few rewards in [0, 1], blended in float64: a few ulp, abs 1e-6 is ~17 u.
        assert record["reward"] == pytest.approx(
            0.7 * record["rewards/retrieval/mean"] + 0.3 * record["rewards/rubric/mean"], abs=1e-6)
        assert record["timing/reward_wait"] >= 0.0
    state = load_train_state(find_checkpoint(tmp_path))
    assert state.step == 2 and state.reason == "final"
    assert RUBRIC_ID in (find_checkpoint(tmp_path) / "config.yaml").read_text()
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [r["name"] for r in results] == ["raw query", str(tmp_path)]
    assert results[0]["metrics"]["hit@k"] >= 0.75 and results[1]["num_tasks"] == 4
