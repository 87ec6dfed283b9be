"""Budgets, shedding and tenancy through real servers on loopback: what a client sees
(codes, messages, trailers), what the trainer's clients do with it (split, retry after the
pushback, fail loudly), tenant weights from the keys file, and readiness."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from calibrl.errors import ConfigError, ResourceExhausted
from calibrl.judge_server import server as judge_server
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric_dir
from calibrl.api.judge import JudgeItem
from calibrl.retrieval_server.limits import RetrievalLimits
from calibrl.retrieval_server.retriever import Retriever
from calibrl.api.retrieval import SearchMode
from calibrl.security import load_tenants, tenant_weights
from calibrl.serving import ServingConfig
from calibrl.testing import start_test_server
from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
from calibrl.v1 import judge_pb2 as jpb
from calibrl.v1 import judge_pb2_grpc
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from tests.reward_fixtures import retriever, rubric_dir, tiny_index  # noqa: F401 (fixtures)


def _with_limits(retriever, **limits):
    return Retriever(retriever.passages, retriever.dense, retriever.bm25, retriever.embedder, retriever.manifest,
                     limits=RetrievalLimits(**limits), default_mode=retriever.default_mode)


class _SlowRetriever(Retriever):
    """Real rankings, ``delay_s`` per query (a controllable backend)."""

    delay_s = 0.02

    def ranked(self, queries, top_k, mode):
        time.sleep(self.delay_s * len(queries))
        return super().ranked(queries, top_k, mode)


def _slow(retriever, delay_s=0.02):
    slow = _SlowRetriever(retriever.passages, retriever.dense, retriever.bm25, retriever.embedder,
                          retriever.manifest, limits=RetrievalLimits(), default_mode=retriever.default_mode)
    slow.delay_s = delay_s
    return slow


def _judge_config(rubric_dir, port=0, **serving):
    return JudgeServerConfig(rubrics=str(rubric_dir),
                             judge=JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0),
                             serving=ServingConfig(port=port, grace_seconds=1.0, **serving))


async def test_a_request_over_budget_is_split_by_the_client(tiny_index, retriever):
    # BM25 queries cost ~0.3 ms each in the model: a 2 ms budget fits a handful
    running = await start_test_server(tiny_index, retriever=_with_limits(retriever, max_request_cost_s=0.002))
    client = GrpcRetrievalClient(running.address)
    try:
        queries = [f"tower in Paris {i}" for i in range(40)]
        async with grpc.aio.insecure_channel(running.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.RetrievalServiceStub(channel).Search(
                    pb.SearchRequest(queries=queries, top_k=3, mode=pb.SEARCH_MODE_BM25), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("queries: estimated cost ")
        assert "limit max_request_cost_s=0.002 s" in refused.value.details()
        trailers = dict(refused.value.trailing_metadata())
        assert "grpc-retry-pushback-ms" not in trailers  # not worth retrying as it is
        fits = int(trailers["calibrl-max-items"])
        assert 1 <= fits < 40
        hits = await client.search(queries, top_k=3, mode=SearchMode.BM25)
        direct = retriever.search(queries, 3, SearchMode.BM25)
        assert [[h.doc_id for h in q] for q in hits] == [[h.doc_id for h in q] for q in direct]
        assert client.stats["split"] >= 1 and client.stats["retries"] == 0
        assert (await client.index_info()) and running.retriever.limits.max_request_cost_s == 0.002
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_a_shed_call_is_retried_after_the_pushback(tiny_index, retriever, tmp_path):
    # one tenant (one API key) on two clients: a heavy call, then a small one with a short deadline
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"tenants:\n  - {{name: team, key_sha256: {hashlib.sha256(b'team-key').hexdigest()}}}\n")
    running = await start_test_server(tiny_index, "batch_max_wait_ms=0", f"serving.api_keys_file={keys}",
                                      retriever=_slow(retriever, 0.02))
    key = [("x-api-key", "team-key")]
    heavy = GrpcRetrievalClient(running.address, metadata=key, timeout_s=60)
    client = GrpcRetrievalClient(running.address, metadata=key, timeout_s=0.4, max_attempts=20,
                                 backoff_initial_s=0.001, backoff_max_s=0.002)
    try:
        for i in range(4):  # let the server learn this backend's speed (20 ms a query)
            await heavy.search([f"learn {i} {j}" for j in range(4)], top_k=1, mode=SearchMode.BM25)
        blocker = asyncio.ensure_future(heavy.search([f"blocker {i}" for i in range(50)], top_k=1,
                                                     mode=SearchMode.BM25))
        await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(running.address) as channel:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as shed:  # ~1 s of the tenant's work ahead, 0.4 s deadline
                await pb_grpc.RetrievalServiceStub(channel).Search(
                    pb.SearchRequest(queries=["Mozart"], top_k=1, mode=pb.SEARCH_MODE_BM25), timeout=0.4,
                    metadata=key)
        assert time.monotonic() - started < 0.2  # refused at once, not after the deadline
        assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        pushback_s = int(dict(shed.value.trailing_metadata())["grpc-retry-pushback-ms"]) / 1000
        assert pushback_s >= 0.1
        # the trainer's client waits the pushback (not its 1-2 ms backoff) between attempts, then is served
        started = time.monotonic()
        hits = await client.search(["Mozart"], top_k=1, mode=SearchMode.BM25)
        assert hits[0][0].doc_id == "mozart"
        assert 1 <= client.stats["shed"] <= client.stats["retries"] < 20
        assert time.monotonic() - started >= 0.05 * client.stats["shed"]
        await blocker
        assert running.batcher.stats.tenants["team"].shed == 1 + client.stats["shed"]
    finally:
        await client.close()
        await heavy.close()
        await running.stop(grace=1.0)


async def test_a_reward_that_cannot_be_had_fails_loudly(rubric_dir):
    # every call is above this tenant's queue bound: shed each time, then the client gives up loudly
    running = await judge_server.start(_judge_config(rubric_dir, max_tenant_queue_cost_s=1e-7))
    client = GrpcJudgeClient(f"127.0.0.1:{running.port}", max_attempts=3, backoff_initial_s=0.001,
                             backoff_max_s=0.002)
    try:
        with pytest.raises(ResourceExhausted, match="RESOURCE_EXHAUSTED after 3 attempts: .*queue full"):
            await client.score("rewrite-test", [JudgeItem("Who composed The Magic Flute?", "Mozart opera")])
        assert client.stats["shed"] == 3 and client.stats["retries"] == 2
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_the_judge_reports_its_budget_and_refuses_above_it(rubric_dir):
    running = await judge_server.start(_judge_config(rubric_dir))
    client = GrpcJudgeClient(f"127.0.0.1:{running.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            rubric = await stub.GetRubric(jpb.GetRubricRequest(rubric_id="rewrite-test"), timeout=30)
            assert rubric.max_request_cost_s == 1.0
            # 8,000-character queries and outputs: ~22 ms each in the cost model, 64 of them ~1.4 s
            text = ("VTSAX expense ratio 2024 " * 400)[:8000]
            items = [JudgeItem(f"{i} {text}"[:8000], f"{i} {text}"[:8000]) for i in range(64)]
            from calibrl.api import judge_wire as wire

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(jpb.ScoreRequest(rubric_id="rewrite-test",
                                                  items=[wire.item_to_proto(i) for i in items]), timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "items: estimated cost" in refused.value.details()
        assert "limit max_request_cost_s=1 s" in refused.value.details()
        scores = await client.score("rewrite-test", items)  # split by the client, scored in order
        judge = Judge(load_rubric_dir(rubric_dir), JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams",
                                                               cache_size=0))
        assert [s.total for s in scores] == [s.total for s in judge.score("rewrite-test", items)]
        assert client.stats["split"] >= 1
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_without_keys_each_client_connection_is_its_own_tenant(tiny_index, retriever):
    running = await start_test_server(tiny_index, retriever=retriever)
    try:
        for _ in range(2):  # channels of one process share a connection unless told not to
            async with grpc.aio.insecure_channel(running.address,
                                                 options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                await pb_grpc.RetrievalServiceStub(channel).Search(
                    pb.SearchRequest(queries=["Mozart"], top_k=1, mode=pb.SEARCH_MODE_BM25), timeout=30)
        peers = [name for name in running.batcher.stats.tenants if name.startswith("peer:")]
        assert len(peers) == 2
    finally:
        await running.stop(grace=1.0)


def test_tenant_weights_come_from_the_keys_file(tmp_path):
    digest = hashlib.sha256(b"k1").hexdigest()
    other = hashlib.sha256(b"k2").hexdigest()
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants:\n  - {{name: big, key_sha256: {digest}, weight: 4}}\n"
                    f"  - {{name: small, key_sha256: {other}}}\n")
    assert tenant_weights(path) == {"big": 4.0, "small": 1.0}
    assert tenant_weights("") == {}
    path.write_text(f"tenants:\n  - {{name: big, key_sha256: {digest}, weight: 0}}\n")
    with pytest.raises(ConfigError, match=r"tenants\[0\].weight=0: must be a number in \(0, 1000\]"):
        load_tenants(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _GatedJudge(Judge):
    """A judge whose scoring waits at a gate (a model that takes long to load)."""

    gate: threading.Event

    def compute(self, rubric, items, *, record=True):
        self.gate.wait(30)
        return super().compute(rubric, items, record=record)


async def test_health_says_serving_only_after_a_probe_item_is_scored(rubric_dir):
    port = _free_port()
    config = _judge_config(rubric_dir, port=port)
    judge = _GatedJudge(load_rubric_dir(rubric_dir), config.judge)
    judge.gate = threading.Event()
    starting = asyncio.ensure_future(judge_server.start(config, judge=judge))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = None
            for _ in range(200):
                try:
                    status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)  # not bound yet
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # listening, not yet able to score
            assert not starting.done()
            judge.gate.set()
            running = await starting
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await running.stop(grace=1.0)
    finally:
        judge.gate.set()
        if not starting.done():
            starting.cancel()


async def test_the_published_service_config_makes_grpc_retry_shed_calls(tiny_index, retriever):
    from calibrl.serving import RETRY_SERVICE_CONFIG

    # every call is above the tenant's queue bound: shed at once, each time
    running = await start_test_server(tiny_index, "serving.max_tenant_queue_cost_s=0.0000001", retriever=retriever)
    try:
        options = [("grpc.service_config", RETRY_SERVICE_CONFIG), ("grpc.enable_retries", 1),
                   ("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(running.address, options=options) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as shed:
                await pb_grpc.RetrievalServiceStub(channel).Search(
                    pb.SearchRequest(queries=["Mozart"], top_k=1, mode=pb.SEARCH_MODE_BM25), timeout=30)
        assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        (tenant,) = [t for t in running.batcher.stats.tenants.values() if t.shed]
        assert tenant.shed == 5  # the service config's maxAttempts: gRPC retried the shed call itself
    finally:
        await running.stop(grace=1.0)


class _CountingInterceptor(grpc.aio.ServerInterceptor):
    """Counts the calls that reach the server, per method."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        self.calls[method] = self.calls.get(method, 0) + 1
        return await continuation(handler_call_details)


async def test_a_final_refusal_keeps_its_status_and_hints_and_the_published_retry_policy_never_resends_it(
        rubric_dir):
    from calibrl.serving import RETRY_SERVICE_CONFIG

    counting = _CountingInterceptor()
    # a 1 ms budget: 20 items of 100-character texts (~0.4 ms each in the cost model) are over it,
    # in a request small enough for gRPC's retry buffer (a large one is never retried anyway)
    running = await judge_server.start(_judge_config(rubric_dir, max_request_cost_s=0.001), interceptors=[counting])
    try:
        options = [("grpc.service_config", RETRY_SERVICE_CONFIG), ("grpc.enable_retries", 1),
                   ("grpc.use_local_subchannel_pool", 1)]
        text = ("VTSAX expense ratio 2024 " * 4)[:100]
        over_budget = jpb.ScoreRequest(rubric_id="rewrite-test",
                                       items=[jpb.JudgeItem(query=f"{i} {text}"[:100], output=text) for i in range(20)])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=options) as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(over_budget, timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Score(jpb.ScoreRequest(rubric_id="nope", items=[jpb.JudgeItem(query="q", output="o")]),
                                 timeout=60)
        # RESOURCE_EXHAUSTED is retryable in the policy, but this one carries no pushback: one attempt
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit max_request_cost_s=0.001 s" in refused.value.details()
        fits = int(dict(refused.value.trailing_metadata())["calibrl-max-items"])
        assert 0 < fits < 20
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details()
        assert counting.calls == {"/calibrl.v1.JudgeService/Score": 2}
    finally:
        await running.stop(grace=1.0)


INTENT_RUBRIC_YAML = """\
id: intent-test
version: "1"
description: A rubric whose intent criterion embeds the query and the output with MiniLM.
criteria:
  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.5}
  - {name: length, kind: programmatic, scorer: length, weight: 0.5}
"""


def _group_items(prompts: int = 4, generations: int = 8) -> list[JudgeItem]:
    """A trainer's Score: every generation of a group asks with its group's query."""
    return [JudgeItem(f"what is the expense ratio of fund {p} in 2024",
                      f"fund {p} expense ratio 2024 rewrite {g}") for p in range(prompts) for g in range(generations)]


def test_the_cost_model_charges_a_repeated_text_once_when_the_text_cache_is_on():
    from calibrl.judge_server import costs

    items = _group_items()
    each = costs.item_costs(items, minilm=True)
    once = costs.item_costs(items, minilm=True, distinct_texts=True)

    def minilm(text: str) -> float:
        return costs.MINILM_PER_TEXT_S + costs.MINILM_PER_CHAR_S * len(text)

    # 64 texts charged against 36 (4 distinct queries + 32 outputs); float sums, so 1e-12 s slack
    assert sum(each) - sum(once) == pytest.approx(sum(minilm(i.query) for i in items[1:8]) * 4, abs=1e-12)
    assert once[0] == pytest.approx(each[0], abs=1e-15) and once[1] < each[1]
    assert costs.item_costs(items, minilm=False, distinct_texts=True) == costs.item_costs(items, minilm=False)


async def test_a_trainer_sized_score_on_an_embedding_rubric_fits_the_default_budget(tmp_path):
    # 4 prompts x 8 generations on a MiniLM rubric: 64 texts would be ~1.2 s in the cost model, over the
    # default 1 s budget; the 36 distinct ones fit, so the call is served whole. With the text cache off
    # the repeats are embedded again and the client must split the call.
    (tmp_path / "intent-test.yaml").write_text(INTENT_RUBRIC_YAML)
    items = _group_items()
    totals = []
    for cache_size, split in ((16384, False), (0, True)):
        judge_config = JudgeConfig(allow_unvalidated=True, embedder="minilm", cache_size=0,
                                   embedder_cache_size=cache_size)
        running = await judge_server.start(JudgeServerConfig(rubrics=str(tmp_path), judge=judge_config,
                                                             serving=ServingConfig(port=0, grace_seconds=1.0)))
        client = GrpcJudgeClient(f"127.0.0.1:{running.port}")
        try:
            scores = await client.score("intent-test", items)
            assert len(scores) == 32 and (client.stats["split"] >= 1) is split
            totals.append([s.total for s in scores])
        finally:
            await client.close()
            await running.stop(grace=1.0)
    assert totals[0] == totals[1]  # whole or split, cached or not: the same scores, bit for bit
