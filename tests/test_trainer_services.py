"""`calibrl train` against both REAL services on loopback: a retrieval server over
the tiny index and a judge server with the programmatic rubric, both grpc.aio on
port 0, reached through the gRPC clients the CLI builds from the config."""

from __future__ import annotations

import json

import pytest

from calibrl.cli import main as calibrl_main
from tests.test_trainer_support import RUBRIC_ID, one_torch_thread, trainer_world  # noqa: F401  (fixtures)
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.checkpoint import find_checkpoint, load_train_state
from calibrl.trainer.diagnostics import read_log


@pytest.mark.slow
def test_calibrl_train_against_real_retrieval_and_judge_servers(trainer_world, tmp_path, capsys):
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.judge_server.server import start as start_judge
    from calibrl.testing import start_test_server

    judge_config = load_config(JudgeServerConfig, None, [
        f"rubrics={trainer_world.rubric_dir}", "serving.port=0", "serving.host=127.0.0.1", "serving.grace_seconds=1",
        "judge.allow_unvalidated=true", "judge.embedder=hashed-ngrams",
    ])
    with BackgroundLoop(name="test-servers") as servers:
        retrieval = servers.run(start_test_server(trainer_world.index_dir, retriever=trainer_world.retriever))
        judge = servers.run(start_judge(judge_config))
        try:
            code = calibrl_main([
                "train", *trainer_world.overrides(tmp_path, "steps=2", "tensorboard=true"),
                f"services.retrieval=127.0.0.1:{retrieval.port}", f"services.judge=127.0.0.1:{judge.port}",
                "services.timeout_s=60",
            ])
            # The trained run, evaluated through the same retrieval server.
            eval_code = calibrl_main([
                "eval", "--model", str(tmp_path), "--tasks", str(trainer_world.rewrite_tasks), "--limit", "4",
                "--retrieval", f"127.0.0.1:{retrieval.port}", "--max-new-tokens", "6", "--device", "cpu",
                "--raw-query-baseline", "--out", str(tmp_path / "eval.json"),
            ])
        finally:
            servers.run(retrieval.stop(grace=1.0))
            servers.run(judge.stop(grace=1.0))
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
