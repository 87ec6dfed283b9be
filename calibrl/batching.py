"""Cross-caller micro-batching behind a bounded queue.

Both services receive many small concurrent calls (one per rollout group or
per agent) while their work is cheapest in large batches (one embedding pass,
one FAISS search, one judge forward). :class:`MicroBatcher` collects the items
of concurrent callers that share a key, runs them as one batch in a worker
thread, and hands each caller its own slice of the results.

The queue is bounded in items: a submit that would overflow it raises
:class:`~calibrl.errors.ResourceExhausted` at once rather than queueing without
limit (callers retry with backoff).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

from calibrl import telemetry
from calibrl.errors import ResourceExhausted, Unavailable
from calibrl.security import current_tenant

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


@dataclass
class _Pending(Generic[ItemT, ResultT]):
    items: Sequence[ItemT]
    future: asyncio.Future


@dataclass
class BatcherStats:
    """Counters a server may export as metrics."""

    batches: int = 0
    items: int = 0
    largest_batch: int = 0
    rejected: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def record(self, size: int) -> None:
        self.batches += 1
        self.items += size
        self.largest_batch = max(self.largest_batch, size)
        if len(self.batch_sizes) < 10_000:
            self.batch_sizes.append(size)


class MicroBatcher(Generic[ItemT, ResultT]):
    """Batch items of concurrent callers per key; run ``process(key, items)`` in a thread.

    ``process`` receives every queued item for one key (up to ``max_batch_items``)
    and must return one result per item, in order. Calls with different keys
    (e.g. search mode) are never mixed in one batch.
    """

    def __init__(
        self,
        process: Callable[[Hashable, list[ItemT]], list[ResultT]],
        *,
        max_batch_items: int = 256,
        max_queue_items: int = 4096,
        max_wait_ms: float = 2.0,
        executor: concurrent.futures.Executor | None = None,
        name: str = "batcher",
    ) -> None:
        self.name = name
        self._gauge_registered = False
        self._process = process
        self.max_batch_items = max_batch_items
        self.max_queue_items = max_queue_items
        self.max_wait_s = max_wait_ms / 1000.0
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._queues: dict[Hashable, list[_Pending]] = {}
        self._queued_items = 0
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closing = False
        self.stats = BatcherStats()

    @property
    def queue_depth(self) -> int:
        """Items waiting, all keys together."""
        return self._queued_items

    async def submit(self, key: Hashable, items: Sequence[ItemT]) -> list[ResultT]:
        """Queue ``items`` under ``key`` and wait for their results."""
        if self._closing:
            raise Unavailable("server is shutting down")
        if not items:
            return []
        if not self._gauge_registered and telemetry.enabled():
            telemetry.observe_gauge(
                "calibrl.queue.depth", lambda: float(self._queued_items), "Items waiting to be batched",
                batcher=self.name,
            )
            self._gauge_registered = True
        if self._queued_items + len(items) > self.max_queue_items:
            self.stats.rejected += 1
            telemetry.record("refusals", 1, tenant=current_tenant() or "none", reason="queue_full", batcher=self.name)
            raise ResourceExhausted(
                f"request queue full ({self._queued_items} items waiting, limit "
                f"{self.max_queue_items}); retry with backoff"
            )
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._run())
        pending = _Pending(items=items, future=loop.create_future())
        self._queues.setdefault(key, []).append(pending)
        self._queued_items += len(items)
        assert self._wakeup is not None
        self._wakeup.set()
        return await pending.future

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._queued_items:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.max_wait_s > 0 and self._queued_items < self.max_batch_items:
                await asyncio.sleep(self.max_wait_s)  # let concurrent callers join the batch
            key = max(self._queues, key=lambda k: sum(len(p.items) for p in self._queues[k]))
            batch: list[_Pending] = []
            size = 0
            abandoned = 0
            queue = self._queues[key]
            while queue and (not batch or size + len(queue[0].items) <= self.max_batch_items):
                pending = queue.pop(0)
                if pending.future.cancelled():  # its caller gave up (deadline, disconnect): skip the work
                    abandoned += len(pending.items)
                    continue
                batch.append(pending)
                size += len(pending.items)
            if not queue:
                del self._queues[key]
            self._queued_items -= size + abandoned
            if not batch:
                continue
            flat = [item for pending in batch for item in pending.items]
            try:
                results = await loop.run_in_executor(self._executor, self._process, key, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch returned {len(results)} results for {len(flat)} items")
            except BaseException as exc:  # noqa: BLE001 - delivered to every caller of the batch
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self.stats.record(size)
            telemetry.record("batch_size", size, batcher=self.name)
            offset = 0
            for pending in batch:
                n = len(pending.items)
                if not pending.future.done():
                    pending.future.set_result(results[offset : offset + n])
                offset += n

    async def close(self) -> None:
        """Refuse new items, finish the queued ones, stop the worker."""
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)
