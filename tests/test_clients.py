"""The trainer's service clients against the REAL retrieval and judge servers on loopback
(and the in-process clients against the same cores)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from calibrl.errors import ConfigError, InvalidArgument, NotFound, Unavailable
from calibrl.serving import ServingConfig
from calibrl.judge_server import server as judge_server
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric_dir
from calibrl.api.judge import JudgeItem
from calibrl.retrieval_server.limits import RetrievalLimits
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import start_test_server
from calibrl.api.retrieval import ScoreItem, SearchMode
from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
from calibrl.trainer.inprocess import InProcessJudgeClient, InProcessRetrievalClient
from tests.reward_fixtures import retriever, rubric_dir, tiny_index  # noqa: F401 (fixtures)

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

ITEMS = [
    ScoreItem("iron lattice tower in Paris", gold_doc_ids=("eiffel",)),
    ScoreItem("who composed The Magic Flute", gold_doc_ids=("mozart",), gold_answers=("Mozart",)),
    ScoreItem("antibiotic discovered by Alexander Fleming", gold_doc_ids=("penicillin",)),
    ScoreItem("highest mountain on Earth", gold_doc_ids=("everest",)),
    ScoreItem("pigment that makes leaves green", gold_doc_ids=("chlorophyll", "photosynthesis")),
    ScoreItem("memory safe systems language", gold_doc_ids=("rust",)),
    ScoreItem("river flowing into the Mediterranean", gold_doc_ids=("nile",)),
    ScoreItem("hormone made by the pancreas", gold_doc_ids=("insulin",)),
]

JUDGE_ITEMS = [
    JudgeItem("Who composed The Magic Flute?", "The Magic Flute composer Mozart opera"),
    JudgeItem("Who composed The Magic Flute?", "music"),
    JudgeItem("When was Penicillin discovered by Alexander Fleming?", "Alexander Fleming penicillin discovery year"),
]


class CountingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts attempts per RPC method and the status each ended with."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        call = await continuation(client_call_details, request)
        method = client_call_details.method.decode() if isinstance(client_call_details.method, bytes) \
            else client_call_details.method
        try:
            code = (await call.code()).name
        except asyncio.CancelledError:
            code = "CANCELLED"
        self.calls.append((method.rsplit("/", 1)[-1], code))
        return call

    def count(self, method, code=None):
        return sum(1 for m, c in self.calls if m == method and (code is None or c == code))


def _judge_config(rubric_dir, port=0):
    return JudgeServerConfig(
        rubrics=str(rubric_dir),
        judge=JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0),
        serving=ServingConfig(port=port, grace_seconds=1.0),
    )


@pytest.fixture(scope="module")
def judge(rubric_dir):
    config = _judge_config(rubric_dir)
    return Judge(load_rubric_dir(rubric_dir), config.judge)


def _with_limits(retriever, **limits):
    """The same loaded index under other request limits (the server reads limits from its retriever)."""
    return Retriever(retriever.passages, retriever.dense, retriever.bm25, retriever.embedder, retriever.manifest,
                     limits=RetrievalLimits(**limits), default_mode=retriever.default_mode)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_retrieval_client_matches_the_core_and_chunks_large_batches(tiny_index, retriever):
    limited = _with_limits(retriever, max_batch_size=3)
    running = await start_test_server(tiny_index, retriever=limited)
    counter = CountingInterceptor()
    client = GrpcRetrievalClient(running.address, interceptors=[counter])
    try:
        info = await client.index_info()
        assert info["doc_count"] == 12 and info["max_batch_size"] == 3 and info["default_mode"] == "hybrid"
        assert info["modes"] == ["dense", "bm25", "hybrid"]

        scores = await client.score(ITEMS, top_k=3, mode=SearchMode.DENSE, include_text=True)
        expected = retriever.score(ITEMS, 3, SearchMode.DENSE, include_text=True)
        assert [s.doc_ids for s in scores] == [e.doc_ids for e in expected]
        assert [(s.hit, s.recall, s.first_gold_rank) for s in scores] == \
            [(e.hit, e.recall, e.first_gold_rank) for e in expected]
        assert [h.text for h in scores[0].hits] == [h.text for h in expected[0].hits] and scores[0].hits[0].text
        # 8 items with the server's max_batch_size=3 -> 3 requests, results in order
        assert counter.count("ScoreRetrieval") == 3
        assert counter.count("GetIndexInfo") == 1

        hits = await client.search([item.query for item in ITEMS], top_k=2)
        assert [[h.doc_id for h in row] for row in hits] == \
            [[h.doc_id for h in row] for row in retriever.search([i.query for i in ITEMS], 2)]
        assert all(h.text == "" for row in hits for h in row)
        assert await client.search([], top_k=2) == [] and await client.score([], top_k=2) == []

        # in-process client: same results (chunked by the same limit), same info keys
        local = InProcessRetrievalClient(limited)
        local_scores = await local.score(ITEMS, top_k=3, mode=SearchMode.DENSE)
        assert [s.doc_ids for s in local_scores] == [s.doc_ids for s in scores]
        assert (await local.index_info()).keys() == info.keys()
        assert (await local.index_info())["max_batch_size"] == 3
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_bad_requests_fail_fast_with_the_field_and_are_not_retried(tiny_index, retriever):
    running = await start_test_server(tiny_index, retriever=_with_limits(retriever, max_query_chars=40))
    counter = CountingInterceptor()
    client = GrpcRetrievalClient(running.address, interceptors=[counter], max_attempts=5)
    try:
        with pytest.raises(InvalidArgument) as info:
            await client.score(ITEMS[:2], top_k=0)
        assert info.value.field == "top_k" and "1..100" in info.value.problem
        assert counter.count("ScoreRetrieval") == 1  # INVALID_ARGUMENT is never retried

        with pytest.raises(InvalidArgument, match=r"queries\[1\]: 41 characters, limit max_query_chars=40"):
            await client.search(["short", "x" * 41], top_k=1)
        assert counter.count("Search") == 0  # checked against GetIndexInfo before sending

        with pytest.raises(InvalidArgument, match=r"queries\[0\]"):
            await client.search(["   "], top_k=1)
        # the server keeps serving after bad input
        assert len(await client.search(["Paris tower"], top_k=1)) == 1
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_unavailable_is_retried_until_the_server_comes_up(tiny_index, retriever):
    port = _free_port()
    counter = CountingInterceptor()
    client = GrpcRetrievalClient(f"127.0.0.1:{port}", interceptors=[counter], max_attempts=8,
                                 backoff_initial_s=0.2, backoff_max_s=0.5, timeout_s=5.0)
    call = asyncio.ensure_future(client.score(ITEMS[:1], top_k=1))
    await asyncio.sleep(0.6)
    assert not call.done()
    running = await start_test_server(tiny_index, f"serving.port={port}", retriever=retriever)
    try:
        (score,) = await asyncio.wait_for(call, 20)
        assert score.doc_ids == ["eiffel"]
        assert counter.count("GetIndexInfo", "UNAVAILABLE") >= 1  # failed attempts before the server was up
        assert counter.count("GetIndexInfo", "OK") == 1
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_transient_failures_that_outlast_the_attempts_raise_unavailable():
    counter = CountingInterceptor()
    client = GrpcRetrievalClient(f"127.0.0.1:{_free_port()}", interceptors=[counter], max_attempts=3,
                                 backoff_initial_s=0.01, backoff_max_s=0.02, timeout_s=2.0)
    try:
        with pytest.raises(Unavailable, match="UNAVAILABLE after 3 attempts"):
            await client.search(["anything"], top_k=1)
        assert counter.count("GetIndexInfo", "UNAVAILABLE") == 3
    finally:
        await client.close()


async def test_deadline_exceeded_is_retried_then_reported(rubric_dir, judge):
    running = await judge_server.start(_judge_config(rubric_dir), judge=judge)
    counter = CountingInterceptor()
    # A deadline no call can meet: every attempt ends DEADLINE_EXCEEDED.
    client = GrpcJudgeClient(f"127.0.0.1:{running.port}", interceptors=[counter], timeout_s=1e-6,
                             max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.02)
    try:
        with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED after 2 attempts"):
            await client.score("rewrite-test", JUDGE_ITEMS)
        assert counter.count("Score", "DEADLINE_EXCEEDED") == 2
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_queue_full_is_retried_with_backoff(tiny_index, retriever):
    # A queue of 2 queries and a batch wait long enough that concurrent callers pile up.
    running = await start_test_server(tiny_index, "max_batch_size=2", "batch_max_queue_items=2",
                                      "batch_max_items=2", "batch_max_wait_ms=30",
                                      retriever=_with_limits(retriever, max_batch_size=2))
    counter = CountingInterceptor()
    client = GrpcRetrievalClient(running.address, interceptors=[counter], max_attempts=30,
                                 backoff_initial_s=0.02, backoff_max_s=0.2)
    try:
        queries = [[item.query, item.query + " facts"] for item in ITEMS] * 2
        results = await asyncio.gather(*(client.search(q, top_k=1) for q in queries))
        assert all(len(r) == 2 and len(r[0]) == 1 for r in results)
        rejected = counter.count("Search", "RESOURCE_EXHAUSTED")
        assert rejected >= 1 and running.batcher.stats.rejected == rejected
        assert counter.count("Search", "OK") == len(queries)
    finally:
        await client.close()
        await running.stop(grace=1.0)


async def test_round_robin_spreads_calls_over_replicas(tiny_index, retriever):
    replicas = [await start_test_server(tiny_index, retriever=retriever) for _ in range(2)]
    target = "ipv4:" + ",".join(r.address for r in replicas)
    client = GrpcRetrievalClient(target)
    try:
        for item in ITEMS:
            await client.search([item.query], top_k=1)
        served = [r.batcher.stats.items for r in replicas]
        assert sum(served) == len(ITEMS) and min(served) >= 2, served
    finally:
        await client.close()
        for r in replicas:
            await r.stop(grace=1.0)


async def test_judge_client_matches_the_core_chunks_and_maps_errors(rubric_dir, judge):
    running = await judge_server.start(_judge_config(rubric_dir), judge=judge)
    counter = CountingInterceptor()
    client = GrpcJudgeClient(f"127.0.0.1:{running.port}", interceptors=[counter], max_batch_size=2,
                             metadata=[("x-request-source", "test")])
    try:
        scores = await client.score("rewrite-test", JUDGE_ITEMS)
        expected = judge.score("rewrite-test", JUDGE_ITEMS)
        assert [s.total for s in scores] == pytest.approx([e.total for e in expected])
        assert [s.by_name() for s in scores] == [e.by_name() for e in expected]
        assert scores[0].total > scores[1].total  # the vague one-word rewrite scores lower
        assert {s.rubric_id for s in scores} == {"rewrite-test"} and scores[0].rubric_hash == expected[0].rubric_hash
        assert counter.count("Score") == 2  # 3 items in chunks of 2

        (summary,) = await client.list_rubrics()
        assert summary["id"] == "rewrite-test" and summary["num_criteria"] == 3 and summary["validated"] is False
        local = InProcessJudgeClient(judge)
        assert await local.list_rubrics() == [summary]
        assert [s.total for s in await local.score("rewrite-test", JUDGE_ITEMS)] == pytest.approx(
            [s.total for s in scores])

        with pytest.raises(NotFound, match="no-such-rubric"):
            await client.score("no-such-rubric", JUDGE_ITEMS[:1])
        with pytest.raises(InvalidArgument) as info:
            await client.score("rewrite-test", [JudgeItem("q", "  ")])
        assert info.value.field == "items[0].output"
        with pytest.raises(InvalidArgument) as info:  # in-process: the same error from the same core
            await local.score("rewrite-test", [JudgeItem("q", "  ")])
        assert info.value.field == "items[0].output"
        assert counter.count("Score", "NOT_FOUND") == 1 and counter.count("Score", "INVALID_ARGUMENT") == 1
    finally:
        await client.close()
        await running.stop(grace=1.0)


def test_client_knobs_are_checked():
    with pytest.raises(ConfigError, match="timeout_s=0: must be > 0"):
        GrpcRetrievalClient("127.0.0.1:1", timeout_s=0)
    with pytest.raises(ConfigError, match="max_concurrency=0"):
        GrpcJudgeClient("127.0.0.1:1", max_concurrency=0)
    with pytest.raises(ConfigError, match="target"):
        GrpcJudgeClient("  ")
