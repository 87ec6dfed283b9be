"""A background asyncio loop for the synchronous training loop.

The training loop is plain synchronous torch code; the service clients are async.
:class:`BackgroundLoop` runs one event loop in a daemon thread so the loop can
start reward calls (``submit``), keep generating, and collect them later: this is
how reward latency overlaps generation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Coroutine, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop in a daemon thread. Use as a context manager or call close()."""

    def __init__(self, name: str = "calibrl-aio") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        """Schedule ``coro`` on the background loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the background loop and wait for its result."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def _drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_drain(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "BackgroundLoop":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def gather_all(*aws: Awaitable[Any]) -> list[Any]:
    """asyncio.gather that cancels the siblings as soon as one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
