import asyncio
import threading

import pytest

from calibrl.batching import MicroBatcher
from calibrl.errors import ResourceExhausted, Unavailable


async def test_concurrent_callers_share_a_batch_and_get_their_own_slice():
    seen_batches = []

    def process(key, items):
        seen_batches.append((key, list(items)))
        return [f"{key}:{x * 10}" for x in items]

    batcher = MicroBatcher(process, max_batch_items=64, max_wait_ms=20)
    results = await asyncio.gather(*[batcher.submit("dense", [i, i + 100]) for i in range(8)])
    for i, result in enumerate(results):
        assert result == [f"dense:{i * 10}", f"dense:{(i + 100) * 10}"]
    assert len(seen_batches) < 8, "concurrent calls were not batched"
    await batcher.close()


async def test_keys_are_never_mixed():
    def process(key, items):
        assert all(item.startswith(key) for item in items)
        return items

    batcher = MicroBatcher(process, max_wait_ms=10)
    out = await asyncio.gather(batcher.submit("a", ["a1"]), batcher.submit("b", ["b1"]), batcher.submit("a", ["a2"]))
    assert out == [["a1"], ["b1"], ["a2"]]
    await batcher.close()


async def test_full_queue_is_rejected_and_errors_reach_every_caller():
    gate = threading.Event()

    def process(key, items):
        gate.wait(5)
        if "boom" in items:
            raise ValueError("bad batch")
        return items

    batcher = MicroBatcher(process, max_batch_items=2, max_queue_items=3, max_wait_ms=0)
    first = asyncio.ensure_future(batcher.submit("k", ["x", "y"]))
    await asyncio.sleep(0.05)  # worker now blocked on the first batch
    second = asyncio.ensure_future(batcher.submit("k", ["boom"]))
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted, match="queue full"):
        await batcher.submit("k", ["a", "b", "c"])
    gate.set()
    assert await first == ["x", "y"]
    with pytest.raises(ValueError, match="bad batch"):
        await second
    await batcher.close()
    with pytest.raises(Unavailable):
        await batcher.submit("k", ["z"])


async def test_close_ends_the_batching_window_and_drains_the_queue():
    # A 60 s window holds every caller's items; close() must not wait it out: a
    # closing batcher takes no new caller, so the queued items run at once.
    batches = []

    def process(key, items):
        batches.append(list(items))
        return [item * 2 for item in items]

    batcher = MicroBatcher(process, max_batch_items=64, max_wait_ms=60_000)
    calls = [asyncio.ensure_future(batcher.submit("k", [i, i + 10])) for i in range(4)]
    while batcher.queue_depth < 8:
        await asyncio.sleep(0.01)
    assert not any(call.done() for call in calls)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(batcher.close(), 30)
    assert loop.time() - started < 30  # far below the 60 s window; wait_for raises otherwise
    assert [await call for call in calls] == [[2 * i, 2 * (i + 10)] for i in range(4)]
    assert batches == [[0, 10, 1, 11, 2, 12, 3, 13]]  # one batch: the window gathered them all
    with pytest.raises(Unavailable):
        await batcher.submit("k", [1])
