"""The documented workflow through the CLI: distill -> validate (gate, record) -> serve."""

import os
import signal
import subprocess
import sys

import grpc
import pytest

from tests.conftest import torch_threads_one

from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc
from calibrl.judge_server import cli
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.authoring.feedback import read_feedback, write_feedback
from calibrl.judge_server.rubric import load_rubric
from calibrl.judge_server.server import start
from calibrl.testing import SYNTHETIC_GLOSSARY, build_tiny_causal_lm, synthetic_feedback
from calibrl.api.judge import JudgeItem
from calibrl.judge_server.authoring.validation import read_records


one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_cli")
    write_feedback(root / "feedback.jsonl", synthetic_feedback(200, seed=0))
    (root / "glossary.txt").write_text("\n".join(SYNTHETIC_GLOSSARY) + "\n")
    (root / "rubrics").mkdir()
    return root


@pytest.fixture(scope="module")
def distilled(workspace):
    """distill + validate of the programmatic rubric, run once: (exit codes, their stdout)."""
    import contextlib
    import io

    rubric_path, golden = workspace / "rubrics" / "funds.yaml", workspace / "golden.jsonl"
    runs = [
        (cli.distill, ["--feedback", str(workspace / "feedback.jsonl"), "--out", str(rubric_path), "--golden-out",
                       str(golden), "--id", "funds", "--criteria", "programmatic",
                       "--glossary", str(workspace / "glossary.txt")]),
        (cli.validate, ["--rubric", str(rubric_path), "--golden", str(golden), "--judge", "programmatic"]),
    ]
    results = []
    for command, argv in runs:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = command(argv)
        results.append((code, stdout.getvalue()))
    return rubric_path, golden, results


def test_distill_validate_programmatic(workspace, distilled, capsys):
    rubric_path, golden, [(distill_code, distill_out), (validate_code, validate_out)] = distilled
    assert distill_code == 0
    assert "wrong_time_period" in distill_out and "left out" in distill_out  # needs an LLM criterion
    rubric = load_rubric(rubric_path)
    assert rubric.glossary == tuple(sorted(SYNTHETIC_GLOSSARY, key=lambda t: (t.lower(), t)))

    assert validate_code == 0 and "gate PASSED" in validate_out
    [record] = read_records(str(rubric_path) + ".validation.json")
    assert record.passed and record.kappa >= 0.6 and record.rubric_hash == rubric.hash
    assert record.model_id == "programmatic[minilm-l6-v2]" and record.n_items == len(read_feedback(golden))
    assert record.metrics["grades"]["spearman"] > 0.5
    # the entity criterion finds most golden items the experts tagged missing_entity (11 of 16, with no
    # false flag, since the golden split is by (query, output) text)
    assert record.metrics["criteria"]["entities"]["recall"] > 0.6
    assert len(record.metrics["pass_fail"]["confusion"]["matrix"]) == 2

    # A stricter gate fails with exit code 1 (report only, the passing record is kept).
    assert cli.validate(["--rubric", str(rubric_path), "--golden", str(golden), "--judge", "programmatic",
                         "--min-kappa", "0.999", "--no-record"]) == 1
    assert "gate FAILED" in capsys.readouterr().out and read_records(str(rubric_path) + ".validation.json")[0].passed
    # Bad input: exit 2 with the reason.
    assert cli.validate(["--rubric", str(rubric_path), "--golden", str(workspace / "none.jsonl"),
                         "--judge", "programmatic"]) == 2
    assert "does not exist" in capsys.readouterr().err


async def test_validated_rubric_is_served(workspace, distilled):
    config = JudgeServerConfig(rubrics=str(workspace / "rubrics"))
    config.serving.port = 0
    running = await start(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            listed = await stub.ListRubrics(pb.ListRubricsRequest())
            assert [(r.id, r.validated) for r in listed.rubrics] == [("funds", True)]
            item = JudgeItem.make("vtsax expense ratio", "What is the expense ratio of the VTSAX fund?")
            response = await stub.Score(pb.ScoreRequest(rubric_id="funds", items=[wire.item_to_proto(item)]))
            assert response.scores[0].total > 0.8 and response.model_id == "programmatic[minilm-l6-v2]"
    finally:
        await running.stop(0)


async def test_llm_rubric_with_tiny_judge_fails_gate_and_is_refused(workspace, tmp_path, capsys):
    model = build_tiny_causal_lm(tmp_path / "tiny-judge", seed=11)
    rubrics = tmp_path / "rubrics"
    rubrics.mkdir()
    rubric_path = rubrics / "funds-llm.yaml"
    golden = tmp_path / "golden.jsonl"
    assert cli.distill(["--feedback", str(workspace / "feedback.jsonl"), "--out", str(rubric_path),
                        "--golden-out", str(golden), "--criteria", "llm", "--id", "funds-llm"]) == 0
    spec = f"transformers:{model}"
    code = cli.validate(["--rubric", str(rubric_path), "--golden", str(golden), "--judge", spec,
                         "embedder=hashed-ngrams", "device=cpu"])
    [record] = read_records(str(rubric_path) + ".validation.json")
    assert record.model_id.startswith("transformers:tiny-judge@")
    assert code == (0 if record.passed else 1)
    assert not record.passed  # a random model does not agree with experts
    capsys.readouterr()

    config = JudgeServerConfig(rubrics=str(rubrics), judge=JudgeConfig(backend=spec, embedder="hashed-ngrams",
                                                                      device="cpu"))
    config.serving.port = 0
    running = await start(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            item = wire.item_to_proto(JudgeItem.make("vtsax fees", "VTSAX fees"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Score(pb.ScoreRequest(rubric_id="funds-llm", items=[item]))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "its validation for this model failed" in info.value.details()
            assert record.model_id in info.value.details() and record.rubric_hash in info.value.details()
    finally:
        await running.stop(0)


@pytest.mark.slow
def test_serve_command_starts_serves_and_stops_on_sigterm(workspace, distilled):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "judge", "--rubrics", str(workspace / "rubrics"),
         "--backend", "programmatic", "--port", "0", "judge.embedder=hashed-ngrams", "--allow-unvalidated"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith("judge server listening on 127.0.0.1:"), process.stderr.read()
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            listed = stub.ListRubrics(pb.ListRubricsRequest(), timeout=30)
            # hashed-ngrams is another judge model: the programmatic record does not cover it.
            assert [(r.id, r.validated) for r in listed.rubrics] == [("funds", False)]
            item = wire.item_to_proto(JudgeItem.make("vtsax fees", "VTSAX fees"))
            assert stub.Score(pb.ScoreRequest(rubric_id="funds", items=[item]), timeout=30).scores
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        log = process.stderr.read()
        assert "--allow-unvalidated" in log and "UNVALIDATED" in log and "shutting down" in log
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()
        process.stderr.close()


def test_bad_config_is_reported(workspace, distilled, capsys):
    assert cli.serve(["--rubrics", str(workspace / "rubrics"), "judge.cache_sise=1"]) == 2
    assert "judge.cache_sise: unknown key; did you mean 'cache_size'?" in capsys.readouterr().err
    assert cli.serve(["--backend", "gpt4"]) == 2
    assert "backend must be one of" in capsys.readouterr().err
