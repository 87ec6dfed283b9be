import asyncio

import pytest

from calibrl.trainer.aio import BackgroundLoop, gather_all


def test_background_loop_overlaps_and_returns():
    async def slow(x):
        await asyncio.sleep(0.05)
        return x * 2

    with BackgroundLoop() as loop:
        futures = [loop.submit(slow(i)) for i in range(5)]
        assert [f.result(2) for f in futures] == [0, 2, 4, 6, 8]
        assert loop.run(slow(21)) == 42


def test_gather_all_cancels_siblings_on_failure():
    cancelled = []

    async def forever():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fail():
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")

    with BackgroundLoop() as loop:
        with pytest.raises(RuntimeError, match="boom"):
            loop.run(gather_all(forever(), fail()))
    assert cancelled == [True]
