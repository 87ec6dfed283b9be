"""Cancelled and expired calls stop costing work, and a heavy caller cannot starve a
small one: the MicroBatcher alone, then a real retrieval server on loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from calibrl.batching import MicroBatcher
from calibrl.errors import DeadlineExceeded, Unavailable
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import build_test_index, start_test_server


class _Recorder:
    """A batch function that records every batch and can be held at a gate."""

    def __init__(self, seconds_per_batch: float = 0.0) -> None:
        self.batches: list[list] = []
        self.seconds_per_batch = seconds_per_batch
        self.lock = threading.Lock()

    def __call__(self, key, items):
        time.sleep(self.seconds_per_batch)
        with self.lock:
            self.batches.append(list(items))
        return [f"done:{item}" for item in items]

    def processed(self, prefix: str) -> int:
        with self.lock:
            return sum(1 for batch in self.batches for item in batch if str(item).startswith(prefix))


async def test_a_large_request_is_split_and_a_small_caller_joins_the_next_batch():
    record = _Recorder(seconds_per_batch=0.05)
    batcher = MicroBatcher(record, max_batch_items=8, max_wait_ms=0)
    heavy = asyncio.ensure_future(batcher.submit("k", [f"heavy{i}" for i in range(64)]))
    await asyncio.sleep(0.01)  # the first heavy batch is running
    small = await batcher.submit("k", ["small"])
    assert small == ["done:small"]
    assert not heavy.done(), "the small call waited for the whole heavy request"
    where = next(i for i, batch in enumerate(record.batches) if "small" in batch)
    assert where <= 1  # the batch in progress, then its own
    assert all(len(batch) <= 8 for batch in record.batches)
    assert await heavy == [f"done:heavy{i}" for i in range(64)]  # in order, across 8+ batches
    await batcher.close()


async def test_keys_take_turns():
    record = _Recorder(seconds_per_batch=0.02)
    batcher = MicroBatcher(record, max_batch_items=4, max_wait_ms=0)
    heavy = asyncio.ensure_future(batcher.submit("dense", [f"d{i}" for i in range(40)]))
    await asyncio.sleep(0.005)
    assert await batcher.submit("bm25", ["b0"]) == ["done:b0"]
    assert not heavy.done()
    await heavy
    await batcher.close()


async def test_a_cancelled_caller_is_dropped_at_the_next_batch_boundary():
    record = _Recorder(seconds_per_batch=0.05)
    batcher = MicroBatcher(record, max_batch_items=8, max_wait_ms=0)
    heavy = asyncio.ensure_future(batcher.submit("k", [f"heavy{i}" for i in range(200)]))
    await asyncio.sleep(0.02)
    heavy.cancel()
    with pytest.raises(asyncio.CancelledError):
        await heavy
    assert batcher.queue_depth == 0  # its queued items left with it
    assert await batcher.submit("k", ["small"]) == ["done:small"]
    assert record.processed("heavy") <= 8  # at most the batch that was running
    assert batcher.stats.abandoned_items >= 192
    await batcher.close()


async def test_a_caller_past_its_deadline_gets_deadline_exceeded_and_its_work_is_dropped():
    record = _Recorder(seconds_per_batch=0.05)
    batcher = MicroBatcher(record, max_batch_items=4, max_wait_ms=0)
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        await batcher.submit("k", [f"late{i}" for i in range(100)], timeout_s=0.12)
    assert record.processed("late") < 100
    assert batcher.queue_depth == 0
    await batcher.close()


async def test_close_with_a_timeout_does_not_wait_for_a_long_batch():
    gate = threading.Event()

    def stuck(key, items):
        gate.wait(30)
        return items

    batcher = MicroBatcher(stuck, max_wait_ms=0)
    running = asyncio.ensure_future(batcher.submit("k", ["a"]))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(batcher.submit("k", ["b"]))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    await batcher.close(timeout_s=0.2)
    assert time.monotonic() - started < 5  # not the 30 s of the stuck batch
    for call in (running, queued):
        with pytest.raises(Unavailable, match="shutting down"):
            await call
    gate.set()


# --- a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("abuse-cancel") / "index")


class _CountingRetriever(Retriever):
    """Real rankings, 10 ms per query, and a count of the queries ranked."""

    ranked_queries: list

    def ranked(self, queries, top_k, mode):
        time.sleep(0.01 * len(queries))
        self.ranked_queries.extend(queries)
        return super().ranked(queries, top_k, mode)


async def test_cancelling_a_heavy_call_frees_the_server_for_a_small_one(tiny_index):
    retriever = _CountingRetriever.load(tiny_index, device="cpu")
    retriever.ranked_queries = []
    running = await start_test_server(tiny_index, "batch_max_items=16", "batch_max_wait_ms=0",
                                      retriever=retriever)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.RetrievalServiceStub(channel)
            heavy_queries = [f"heavy tower {i}" for i in range(256)]  # 16 batches of 16, ~2.6 s of work
            heavy = stub.Search(pb.SearchRequest(queries=heavy_queries, top_k=5, mode=pb.SEARCH_MODE_BM25),
                                timeout=60)
            while not any(q.startswith("heavy") for q in retriever.ranked_queries):
                await asyncio.sleep(0.01)
            heavy.cancel()
            reply = await stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=1, mode=pb.SEARCH_MODE_BM25),
                                      timeout=60)
            assert reply.results[0].hits[0].doc_id == "mozart"
            await asyncio.sleep(0.3)  # time for several more batches, had the heavy call kept its work
            heavy_ranked = sum(q.startswith("heavy") for q in retriever.ranked_queries)
            # two workers (the short lane takes these short queries too): the units each had in
            # progress or started before the cancel arrived, then nothing more
            assert heavy_ranked <= 6 * 16, f"{heavy_ranked} of 256 cancelled queries were still ranked"
            assert running.batcher.queue_depth == 0

            # past its deadline: the same, with DEADLINE_EXCEEDED for the caller. The server has
            # learnt that this backend is slow (10 ms a query), so it first sheds the call at once,
            # with pushback, while other work is queued ahead of it
            retriever.ranked_queries.clear()
            blocker = asyncio.ensure_future(stub.Search(pb.SearchRequest(
                queries=[f"blocker {i}" for i in range(64)], top_k=5, mode=pb.SEARCH_MODE_BM25), timeout=60))
            while not retriever.ranked_queries:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as shed:
                await stub.Search(pb.SearchRequest(queries=heavy_queries, top_k=5, mode=pb.SEARCH_MODE_BM25),
                                  timeout=0.3)
            assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "exceeds the call's deadline" in shed.value.details()
            assert int(dict(shed.value.trailing_metadata())["grpc-retry-pushback-ms"]) > 0
            await blocker
            assert not any(q.startswith("heavy") for q in retriever.ranked_queries)
            # alone on an idle server it is admitted, and dropped when its deadline passes
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub.Search(pb.SearchRequest(queries=heavy_queries, top_k=5, mode=pb.SEARCH_MODE_BM25),
                                  timeout=0.3)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.3)
            assert sum(q.startswith("heavy") for q in retriever.ranked_queries) < 256
    finally:
        await running.stop(grace=1.0)


async def test_a_small_caller_is_answered_while_a_heavy_caller_runs(tiny_index):
    retriever = _CountingRetriever.load(tiny_index, device="cpu")
    retriever.ranked_queries = []
    running = await start_test_server(tiny_index, "batch_max_items=16", "batch_max_wait_ms=0",
                                      retriever=retriever)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.RetrievalServiceStub(channel)
            items = [pb.ScoreItem(query=f"heavy tower {i}", gold_answers=["Paris"]) for i in range(256)]
            heavy = asyncio.ensure_future(stub.ScoreRetrieval(
                pb.ScoreRetrievalRequest(items=items, top_k=5, mode=pb.SEARCH_MODE_BM25), timeout=60))
            while not retriever.ranked_queries:
                await asyncio.sleep(0.01)
            for _ in range(3):  # each small call is answered before the heavy one finishes
                reply = await stub.Search(pb.SearchRequest(queries=["Everest"], top_k=1, mode=pb.SEARCH_MODE_BM25),
                                          timeout=60)
                assert reply.results[0].hits[0].doc_id == "everest"
                assert not heavy.done()
            assert len((await heavy).scores) == 256
    finally:
        await running.stop(grace=1.0)
