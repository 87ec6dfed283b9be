"""One judge server, every rubric: a real grpc.aio server on loopback with a transformers
backend (a tiny random Llama built here) serves an LLM rubric validated for that model,
a programmatic rubric validated once with the programmatic judge, and the search
agent's step rubric listed in ``judge.unvalidated_rubrics``; an unlisted, unvalidated
rubric is still refused. Two callers at once; the Prometheus page gives per-rubric
calls, batch sizes and cache lookups (what the demo's report shows)."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import socket

import grpc
import pytest

from tests.conftest import torch_threads_one
from tests.test_judge_server import UNVALIDATED, VALIDATED

from calibrl import telemetry
from calibrl.demo.judge_report import RubricServerStats, parse_judge_stats, scrape_judge_stats
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric
from calibrl.judge_server.server import BatchMix, start
from calibrl.api.judge import JudgeItem
from calibrl.judge_server.authoring.validation import ValidationRecord, validation_path, write_record
from calibrl.telemetry import TelemetryConfig
from calibrl.testing import build_tiny_causal_lm
from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc

pytest.importorskip("torch")
pytest.importorskip("opentelemetry.exporter.prometheus", reason="the prometheus extra: pip install 'calibrl[prometheus]'")

STEP_RUBRIC = pathlib.Path(__file__).resolve().parent.parent / "configs" / "rubrics" / "search-steps.yaml"
LLM_RUBRIC = """\
id: rewriter-llm
version: "1"
criteria:
  - {name: keeps_entity, kind: llm, question: "Does the output keep the fund the query names?", weight: 1.0}
"""
PROGRAMMATIC_ID = "programmatic[hashed-ngrams]"

one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _record(rubric, model_id: str) -> ValidationRecord:
    return ValidationRecord(rubric_id=rubric.id, rubric_hash=rubric.hash, model_id=model_id, passed=True, kappa=0.8,
                            min_kappa=0.6, pass_threshold=0.6, n_items=30, golden_sha256="0" * 64,
                            reason="kappa 0.800 >= min_kappa 0.6")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny model and a rubric folder: the LLM rubric validated for the model, the
    programmatic one for the programmatic judge, the step rubric and a draft unvalidated."""
    root = tmp_path_factory.mktemp("shared-judge")
    model = build_tiny_causal_lm(root / "model", seed=0)
    rubrics = root / "rubrics"
    rubrics.mkdir()
    (rubrics / "rewriter.yaml").write_text(VALIDATED)
    (rubrics / "draft.yaml").write_text(UNVALIDATED)
    (rubrics / "rewriter-llm.yaml").write_text(LLM_RUBRIC)
    shutil.copy(STEP_RUBRIC, rubrics / "search-steps.yaml")
    llm_judge = Judge.from_config(JudgeConfig(backend=f"transformers:{model}", device="cpu",
                                              embedder="hashed-ngrams", allow_unvalidated=True), rubrics)
    for name, model_id in (("rewriter", PROGRAMMATIC_ID), ("rewriter-llm", llm_judge.model_id)):
        rubric = load_rubric(rubrics / f"{name}.yaml")
        write_record(validation_path(rubrics / f"{name}.yaml"), _record(rubric, model_id))
    return model, rubrics, llm_judge.model_id


def _config(model, rubrics, metrics_port: int) -> JudgeServerConfig:
    judge = JudgeConfig(backend=f"transformers:{model}", device="cpu", embedder="hashed-ngrams",
                        unvalidated_rubrics=["search-steps"], max_docs=0)
    config = JudgeServerConfig(rubrics=str(rubrics), judge=judge, max_wait_ms=50)
    config.serving.port = 0
    config.serving.telemetry = TelemetryConfig(enabled=True, prometheus_port=metrics_port)
    return config


def _items(*outputs: str, query: str = "VTSAX expense ratio"):
    return [wire.item_to_proto(JudgeItem.make(query, o, retrieved_texts=("VTSAX has an expense ratio of 0.04%.",)))
            for o in outputs]


async def test_one_server_scores_llm_programmatic_and_step_rubrics(folders):
    model, rubrics, llm_model_id = folders
    metrics_port = _free_port()
    running = await start(_config(model, rubrics, metrics_port))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            listed = {r.id: r.validated for r in (await stub.ListRubrics(pb.ListRubricsRequest())).rubrics}
            assert listed == {"rewriter": True, "rewriter-llm": True, "search-steps": False, "draft": False}

            outputs = ("What is the expense ratio of the VTSAX fund?", "fund info", "VTSAX fees")
            # two agents at once: the rewriter on both of its rubrics, the search agent on its step rubric
            llm, programmatic, steps = await asyncio.gather(
                stub.Score(pb.ScoreRequest(rubric_id="rewriter-llm", items=_items(*outputs))),
                stub.Score(pb.ScoreRequest(rubric_id="rewriter", items=_items(*outputs))),
                stub.Score(pb.ScoreRequest(rubric_id="search-steps", items=_items("VTSAX expense ratio",
                                                                                  query="Which fund ..."))))
            again = await stub.Score(pb.ScoreRequest(rubric_id="rewriter-llm", items=_items(*outputs[:2])))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(pb.ScoreRequest(rubric_id="draft", items=_items("fund info")))
        stats = scrape_judge_stats(metrics_port)
    finally:
        await running.stop(0)
        telemetry.shutdown()

    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "judge.unvalidated_rubrics=draft" in refused.value.details()
    # each rubric is scored by what it needs, and the response says so
    assert llm.model_id == llm_model_id and llm_model_id.startswith("transformers:")
    assert programmatic.model_id == PROGRAMMATIC_ID and steps.model_id == PROGRAMMATIC_ID
    # the programmatic rubric's scores do not depend on the served backend: a programmatic-only
    # judge gives the same totals (same code on the same inputs: equal to the last bit)
    alone = Judge.from_config(JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True), rubrics)
    expected = alone.score("rewriter", [wire.item_from_proto(m) for m in _items(*outputs)])
    assert [s.total for s in programmatic.scores] == [s.total for s in expected]
    assert all(0.0 <= s.total <= 1.0 for s in llm.scores) and len({s.total for s in llm.scores}) > 1
    assert [s.total for s in again.scores] == [s.total for s in llm.scores[:2]] and all(s.cached for s in again.scores)

    # per rubric: calls, batches and cache lookups (the draft was refused before any work)
    assert {k: (v.calls, v.batch_items, v.cache_hits, v.cache_misses) for k, v in stats.items()} == {
        "rewriter-llm": (2, 3, 2, 3), "rewriter": (1, 3, 0, 3), "search-steps": (1, 1, 0, 1)}
    assert stats["rewriter-llm"].batches == 1 and stats["rewriter-llm"].mean_batch_size == 3.0


def test_programmatic_rubric_validated_once_serves_beside_any_backend(folders):
    """The programmatic rubric's record (programmatic id) is found by an LLM judge; a record
    bound to the LLM's id would not be (the rubric's scorer is the programmatic judge)."""
    model, rubrics, _ = folders
    judge = Judge.from_config(JudgeConfig(backend=f"transformers:{model}", device="cpu", embedder="hashed-ngrams"),
                              rubrics)
    assert judge.status("rewriter").validated and judge.status("rewriter-llm").validated
    assert not judge.status("search-steps").usable and not judge.status("draft").usable
    rubric = judge.status("rewriter").rubric
    assert judge.scorer_id(rubric) == PROGRAMMATIC_ID != judge.model_id


def test_parse_judge_stats_sums_per_rubric():
    text = """\
# TYPE calibrl_judge_calls_total counter
calibrl_judge_calls_total{rubric="a"} 3.0
calibrl_judge_calls_total{rubric="b"} 1.0
# TYPE calibrl_judge_batch_size histogram
calibrl_judge_batch_size_bucket{le="+Inf",rubric="a"} 2.0
calibrl_judge_batch_size_count{rubric="a"} 2.0
calibrl_judge_batch_size_sum{rubric="a"} 24.0
# TYPE calibrl_cache_lookups_total counter
calibrl_cache_lookups_total{result="hit",rubric="a"} 5.0
calibrl_cache_lookups_total{result="miss",rubric="a"} 24.0
calibrl_cache_lookups_total{result="miss"} 7.0
# TYPE calibrl_judge_batch_mix_total counter
calibrl_judge_batch_mix_total{calls="one",other_rubric="none",rubric="a"} 1.0
calibrl_judge_batch_mix_total{calls="several",other_rubric="waiting",rubric="a"} 1.0
"""
    stats = parse_judge_stats(text)
    assert set(stats) == {"a", "b"}
    assert (stats["a"].calls, stats["a"].batches, stats["a"].mean_batch_size, stats["a"].cache_hits,
            stats["a"].cache_misses, stats["a"].shared_batches, stats["a"].beside_batches) == (3, 2, 12.0, 5, 24, 1, 1)
    assert stats["b"].calls == 1 and stats["b"].batches == 0 and stats["b"].to_json()["mean_batch_size"] is None
    # the figures between two scrapes
    later = parse_judge_stats(text.replace('rubric="a"} 3.0', 'rubric="a"} 7.0'))
    assert later["a"].minus(stats["a"]).to_json() == {**RubricServerStats().to_json(), "calls": 4}


def test_batch_mix_counts_the_calls_a_batch_joined_and_other_rubrics_waiting():
    """A batch's items are told apart by call, not by content: two calls with equal items
    are two calls."""
    mix = BatchMix()
    first, second = [JudgeItem.make("q", "same output")], [JudgeItem.make("q", "same output")]
    steps = [JudgeItem.make("question", "step query")]
    mix.enter("rewriter", first)
    mix.enter("rewriter", second)
    assert mix.record("rewriter", [*first, *second]) == (2, False)
    mix.enter("search-steps", steps)
    assert mix.record("rewriter", first) == (1, True)  # the search agent's call waited meanwhile
    assert mix.record("search-steps", steps) == (1, True)
    mix.leave("rewriter", first)
    mix.leave("rewriter", second)
    assert mix.record("search-steps", steps) == (1, False)


def test_max_docs_zero_is_accepted_and_negative_refused():
    from calibrl.config import load_config
    from calibrl.errors import ConfigError

    assert load_config(JudgeConfig, None, ["max_docs=0"]).max_docs == 0
    with pytest.raises(ConfigError, match=r"judge.max_docs=-1: must be >= 0"):
        load_config(JudgeConfig, None, ["max_docs=-1"])
