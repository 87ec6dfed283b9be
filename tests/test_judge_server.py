"""JudgeService over a real grpc.aio server on loopback (port 0)."""

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric
from calibrl.judge_server.server import start
from calibrl.api.judge import JudgeItem
from calibrl.judge_server.authoring.validation import ValidationRecord, validation_path, write_record

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

VALIDATED = """\
id: rewriter
version: "1"
criteria:
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.6}
  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.4, params: {min_terms: 3}}
  - {name: no_leak, kind: programmatic, scorer: compliance_leak, weight: 1.0, penalty: true}
"""
UNVALIDATED = """\
id: draft
version: "1"
description: not validated yet
criteria:
  - {name: length, kind: programmatic, scorer: length, weight: 1.0}
"""
MODEL_ID = "programmatic[hashed-ngrams]"


def make_rubrics(folder):
    folder.mkdir(exist_ok=True)
    (folder / "rewriter.yaml").write_text(VALIDATED)
    (folder / "draft.yaml").write_text(UNVALIDATED)
    rubric = load_rubric(folder / "rewriter.yaml")
    write_record(validation_path(folder / "rewriter.yaml"), ValidationRecord(
        rubric_id=rubric.id, rubric_hash=rubric.hash, model_id=MODEL_ID, passed=True, kappa=0.8, min_kappa=0.6,
        pass_threshold=0.6, n_items=30, golden_sha256="0" * 64, reason="kappa 0.800 >= min_kappa 0.6"))
    return folder


def server_config(folder, **judge_changes):
    judge = JudgeConfig(embedder="hashed-ngrams", **judge_changes)
    config = JudgeServerConfig(rubrics=str(folder), judge=judge, max_wait_ms=20)
    config.serving.port = 0
    return config


def items(*outputs, query="VTSAX expense ratio"):
    return [wire.item_to_proto(JudgeItem.make(query, o)) for o in outputs]


@pytest.fixture
async def served(tmp_path):
    running = await start(server_config(make_rubrics(tmp_path / "rubrics")))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield running, judge_pb2_grpc.JudgeServiceStub(channel), channel
    await channel.close()
    await running.stop(0)


async def test_score_list_and_get(served):
    running, stub, channel = served
    response = await stub.Score(pb.ScoreRequest(rubric_id="rewriter", items=items(
        "What is the expense ratio of the VTSAX fund?", "fund info", "VTSAX expense ratio for account 12345678")))
    good, vague, leak = response.scores
    assert response.rubric_id == "rewriter" and response.model_id == MODEL_ID
    assert response.rubric_hash == load_rubric(running.servicer.judge.statuses()[1].rubric.source_path).hash
    assert good.total == pytest.approx(1.0) and [c.name for c in good.criteria] == ["entities", "specificity", "no_leak"]
    assert vague.total < 0.3 and leak.total == 0.0 and leak.criteria[2].penalty
    listed = await stub.ListRubrics(pb.ListRubricsRequest())
    assert [(r.id, r.validated, r.num_criteria) for r in listed.rubrics] == [("draft", False, 1), ("rewriter", True, 3)]
    rubric = await stub.GetRubric(pb.GetRubricRequest(rubric_id="rewriter"))
    assert rubric.hash == response.rubric_hash and rubric.source_yaml == VALIDATED
    assert rubric.validation.passed and rubric.validation.model_id == MODEL_ID
    assert json.loads(rubric.criteria[1].params_json) == {"min_terms": 3}
    health = health_pb2_grpc.HealthStub(channel)
    status = await health.Check(health_pb2.HealthCheckRequest(service="calibrl.v1.JudgeService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING


async def test_errors_map_to_status_codes_and_server_keeps_serving(served):
    running, stub, _ = served
    draft_hash = next(s.rubric.hash for s in running.servicer.judge.statuses() if s.rubric.id == "draft")
    cases = [
        (pb.ScoreRequest(rubric_id="nope", items=items("x")), grpc.StatusCode.NOT_FOUND, "rubric 'nope' not found"),
        (pb.ScoreRequest(rubric_id="rewriter"), grpc.StatusCode.INVALID_ARGUMENT, "items: empty batch"),
        (pb.ScoreRequest(rubric_id="rewriter", items=items("ok", "")), grpc.StatusCode.INVALID_ARGUMENT,
         "items[1].output: empty"),
        (pb.ScoreRequest(rubric_id="rewriter", rubric_hash="f00", items=items("x")), grpc.StatusCode.INVALID_ARGUMENT,
         "rubric_hash: 'f00' does not match"),
        (pb.ScoreRequest(rubric_id="rewriter", items=items(*["x"] * 257)), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "limit max_batch_size=256"),
        (pb.ScoreRequest(rubric_id="rewriter", items=items("x" * 8001)), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "items[0].output: 8001 characters, limit max_text_chars=8000"),
        (pb.ScoreRequest(rubric_id="draft", items=items("x")), grpc.StatusCode.FAILED_PRECONDITION,
         f"rubric 'draft' (hash {draft_hash}) is not validated for judge model '{MODEL_ID}'"),
    ]
    for request, code, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Score(request)
        assert info.value.code() == code
        assert message in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetRubric(pb.GetRubricRequest(rubric_id="missing"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    ok = await stub.Score(pb.ScoreRequest(rubric_id="rewriter", items=items("VTSAX expense ratio details")))
    assert len(ok.scores) == 1


async def test_serving_compute_nice_reaches_the_workers(tmp_path):
    config = server_config(make_rubrics(tmp_path / "rubrics"))
    config.serving.compute_nice = 3
    running = await start(config)
    try:
        assert running.servicer.batcher.worker_nice == 3
    finally:
        await running.stop(0)


async def test_concurrent_callers_share_batches_and_cache(served):
    running, stub, _ = served
    outputs = [f"VTSAX expense ratio question number {i}" for i in range(8)]
    responses = await asyncio.gather(*[
        stub.Score(pb.ScoreRequest(rubric_id="rewriter", items=items(o))) for o in outputs])
    stats = running.servicer.batcher.stats
    assert stats.items == 8 and stats.batches < 8  # concurrent calls were scored together
    reference = Judge([load_rubric(running.servicer.judge.resolve("rewriter").source_path)],
                      JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True))
    for output, response in zip(outputs, responses):
        expected = reference.score("rewriter", [JudgeItem.make("VTSAX expense ratio", output)])[0]
        assert response.scores[0].total == pytest.approx(expected.total) and not response.scores[0].cached
    again = await stub.Score(pb.ScoreRequest(rubric_id="rewriter", items=items(outputs[3], outputs[5])))
    assert [s.cached for s in again.scores] == [True, True]
    assert again.scores[0] == pb.ItemScore(criteria=responses[3].scores[0].criteria, total=responses[3].scores[0].total,
                                           cached=True)
    assert running.servicer.batcher.stats.items == 8  # cache hits never reach the batcher


async def test_allow_unvalidated_and_queue_limit(tmp_path):
    folder = make_rubrics(tmp_path / "rubrics")
    config = server_config(folder, allow_unvalidated=True, max_batch_size=2, cache_size=0)
    config.max_queue_items, config.max_wait_ms = 2, 300
    running = await start(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            response = await stub.Score(pb.ScoreRequest(rubric_id="draft", items=items("a fine rewrite here")))
            assert response.scores[0].total == 1.0
            results = await asyncio.gather(*[
                stub.Score(pb.ScoreRequest(rubric_id="draft", items=items("one two three", "four five six")))
                for _ in range(2)], return_exceptions=True)
            errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "request queue full" in errors[0].details()
            assert (await stub.Score(pb.ScoreRequest(rubric_id="draft", items=items("still serving")))).scores
    finally:
        await running.stop(0)


async def test_tenants_see_only_their_rubrics(tmp_path):
    import hashlib

    folder = make_rubrics(tmp_path / "rubrics")
    (folder / "team-a.yaml").write_text(UNVALIDATED.replace("id: draft", "id: team-a-only") + "tenants: [team-a]\n")
    (folder / "shared.yaml").write_text(UNVALIDATED.replace("id: draft", "id: shared") + "tenants: ['*']\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n" + "".join(
        f"  - name: {name}\n    key_sha256: {hashlib.sha256(f'key-{name}'.encode()).hexdigest()}\n"
        for name in ("team-a", "team-b")))
    config = server_config(folder, allow_unvalidated=True)
    config.serving.api_keys_file = str(keys)
    running = await start(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)

            async def visible(tenant):
                metadata = (("authorization", f"Bearer key-{tenant}"),)
                return [r.id for r in (await stub.ListRubrics(pb.ListRubricsRequest(), metadata=metadata)).rubrics]

            assert await visible("team-a") == ["shared", "team-a-only"]
            assert await visible("team-b") == ["shared"]
            request = pb.ScoreRequest(rubric_id="team-a-only", items=items("a fine rewrite here"))
            scored = await stub.Score(request, metadata=(("authorization", "Bearer key-team-a"),))
            assert scored.scores[0].total == 1.0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Score(request, metadata=(("authorization", "Bearer key-team-b"),))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListRubrics(pb.ListRubricsRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await running.stop(0)
