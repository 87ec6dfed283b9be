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
