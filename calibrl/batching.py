"""Cross-caller micro-batching behind a bounded, fair queue.

Both services receive many small concurrent calls (one per rollout group or
per agent) while their work is cheapest in large batches (one embedding pass,
one FAISS search, one judge forward). :class:`MicroBatcher` collects the items
of concurrent callers that share a key, runs them as one batch in a worker
thread, and hands each caller its own slice of the results.

Three rules keep one caller from hurting the others:

- **Bounded queue.** A submit that would overflow it (counted in items) raises
  :class:`~calibrl.errors.ResourceExhausted` at once rather than queueing without
  limit (callers retry with backoff).
- **Fair batches.** A batch holds at most ``max_batch_items`` items. A large
  request is split: each batch gives every waiting caller of the key an equal
  share of its room (what a caller leaves unused goes to the others), and keys
  take turns, so a small call waits for at most the batch in progress and its
  own, however heavy the other callers are.
- **Abandoned work is dropped.** When a caller gives up (its task is cancelled:
  the client cancelled, disconnected or passed its deadline) or its ``timeout_s``
  passes, its items still queued are removed; the batch already running is
  the only work that finishes for it (the next batch boundary).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue as queue_module
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

from calibrl import telemetry
from calibrl.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from calibrl.security import current_tenant

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


@dataclass(eq=False)
class _Pending(Generic[ItemT, ResultT]):
    """One caller's items: those not yet handed to a batch start at ``next_index``."""

    items: Sequence[ItemT]
    future: asyncio.Future
    deadline: float | None = None  # loop.time() after which the caller no longer waits
    results: list = field(default_factory=list)
    next_index: int = 0
    finished: int = 0

    @property
    def waiting(self) -> int:
        return len(self.items) - self.next_index


@dataclass
class BatcherStats:
    """Counters a server may export as metrics."""

    batches: int = 0
    items: int = 0
    largest_batch: int = 0
    rejected: int = 0
    abandoned_items: int = 0  # items dropped from the queue because their caller gave up
    batch_sizes: list[int] = field(default_factory=list)

    def record(self, size: int) -> None:
        self.batches += 1
        self.items += size
        self.largest_batch = max(self.largest_batch, size)
        if len(self.batch_sizes) < 10_000:
            self.batch_sizes.append(size)


class _DaemonWorker(concurrent.futures.Executor):
    """One daemon thread that runs the batches in order.

    A ThreadPoolExecutor's threads are joined when the interpreter exits, so a batch
    still running at shutdown would hold the process open past its grace period; a
    daemon thread does not.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.put(None)
        if wait:
            self._thread.join()


class MicroBatcher(Generic[ItemT, ResultT]):
    """Batch items of concurrent callers per key; run ``process(key, items)`` in a thread.

    ``process`` receives up to ``max_batch_items`` queued items of one key and must
    return one result per item, in order. Calls with different keys (e.g. search
    mode, rubric hash) are never mixed in one batch.
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
        self._executor = executor or _DaemonWorker(name)
        # key -> callers in arrival order; dict order is the turn order of the keys
        self._queues: dict[Hashable, list[_Pending]] = {}
        self._queued_items = 0
        self._wakeup: asyncio.Event | None = None
        self._window_cut: asyncio.Event | None = None  # set by end_windows(): a window ends early
        self._windows_open = True
        self._worker: asyncio.Task | None = None
        self._closing = False
        self.stats = BatcherStats()

    @property
    def queue_depth(self) -> int:
        """Items waiting, all keys together."""
        return self._queued_items

    async def submit(self, key: Hashable, items: Sequence[ItemT], timeout_s: float | None = None) -> list[ResultT]:
        """Queue ``items`` under ``key`` and wait for their results.

        ``timeout_s`` (e.g. the call's remaining deadline): past it, items not yet
        in a batch are dropped and :class:`~calibrl.errors.DeadlineExceeded` is raised.
        """
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
            self._window_cut = asyncio.Event()
            if not self._windows_open:
                self._window_cut.set()
            self._worker = loop.create_task(self._run())
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        pending = _Pending(items=items, future=loop.create_future(), deadline=deadline,
                           results=[None] * len(items))
        self._queues.setdefault(key, []).append(pending)
        self._queued_items += len(items)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._forget(key, pending)  # the caller gave up: its queued items never run
            raise

    def _forget(self, key: Hashable, pending: _Pending) -> None:
        queue = self._queues.get(key)
        if queue is None or pending not in queue:
            return
        queue.remove(pending)
        if not queue:
            del self._queues[key]
        self._queued_items -= pending.waiting
        self.stats.abandoned_items += pending.waiting

    def _drop_abandoned(self, now: float) -> None:
        """Remove callers that are done (cancelled, failed) or past their deadline."""
        for key in list(self._queues):
            for pending in list(self._queues[key]):
                if not pending.future.done() and pending.deadline is not None and now >= pending.deadline:
                    pending.future.set_exception(DeadlineExceeded(
                        f"deadline passed with {pending.waiting} of {len(pending.items)} items not yet started"))
                if pending.future.done():
                    self._forget(key, pending)

    def _take_fair(self, queue: list[_Pending]) -> list[tuple[_Pending, int, int]]:
        """Up to ``max_batch_items`` items of one key: equal shares of the room for every
        waiting caller, the room a caller leaves unused shared again by the others."""
        grants = [0] * len(queue)
        room = self.max_batch_items
        while room > 0:
            wanting = [i for i, p in enumerate(queue) if p.waiting > grants[i]]
            if not wanting:
                break
            share = max(1, room // len(wanting))
            for i in wanting:
                n = min(share, queue[i].waiting - grants[i], room)
                grants[i] += n
                room -= n
                if room == 0:
                    break
        slices = []
        for pending, n in zip(queue, grants):
            if n:
                slices.append((pending, pending.next_index, pending.next_index + n))
                pending.next_index += n
        self._queued_items -= sum(grants)
        queue[:] = [p for p in queue if p.waiting]
        return slices

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            self._drop_abandoned(loop.time())
            if not self._queued_items:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.max_wait_s > 0 and self._queued_items < self.max_batch_items and self._windows_open:
                await self._batching_window()
                self._drop_abandoned(loop.time())
                if not self._queued_items:
                    continue
            key = next(iter(self._queues))  # the key that has waited longest for its turn
            queue = self._queues.pop(key)
            slices = self._take_fair(queue)
            if queue:
                self._queues[key] = queue  # back of the line: other keys go first
            flat = [item for pending, start, stop in slices for item in pending.items[start:stop]]
            try:
                results = await loop.run_in_executor(self._executor, self._process, key, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch returned {len(results)} results for {len(flat)} items")
            except BaseException as exc:  # noqa: BLE001 - delivered to every caller of the batch
                cancelled = isinstance(exc, asyncio.CancelledError)
                if cancelled:  # close() gave up on this batch
                    exc = Unavailable("server is shutting down; the batch was abandoned")
                for pending, _, _ in slices:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                if cancelled:
                    raise
                continue
            self.stats.record(len(flat))
            telemetry.record("batch_size", len(flat), batcher=self.name)
            offset = 0
            for pending, start, stop in slices:
                pending.results[start:stop] = results[offset : offset + stop - start]
                pending.finished += stop - start
                offset += stop - start
                if pending.finished == len(pending.items) and not pending.future.done():
                    pending.future.set_result(pending.results)

    async def _batching_window(self) -> None:
        """Wait ``max_wait_s`` for concurrent callers to join the batch, or less if
        :meth:`end_windows` is called meanwhile."""
        assert self._window_cut is not None
        try:
            await asyncio.wait_for(self._window_cut.wait(), self.max_wait_s)
        except asyncio.TimeoutError:
            pass

    def end_windows(self) -> None:
        """Run batches as soon as items are queued, without waiting for more callers.

        A server calls this when it stops taking new calls (and :meth:`close` does):
        no new caller can join a batch then, so holding the calls in flight for the
        rest of a batching window would only delay the drain. Items are still taken.
        """
        self._windows_open = False
        if self._window_cut is not None:
            self._window_cut.set()

    async def close(self, timeout_s: float | None = None) -> None:
        """Refuse new items and finish the queued ones of callers still waiting.

        With ``timeout_s``, give up after that long: the callers still waiting get
        :class:`~calibrl.errors.Unavailable`, and a batch still running is left to
        its daemon thread (it cannot hold the process open).
        """
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        self.end_windows()
        if self._worker is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._worker), timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s: work still running after %.1fs at shutdown; abandoned", self.name, timeout_s)
                self._worker.cancel()
                for key, queue in list(self._queues.items()):
                    for pending in list(queue):
                        if not pending.future.done():
                            pending.future.set_exception(Unavailable("server is shutting down"))
                        self._forget(key, pending)
                self._executor.shutdown(wait=False)
                return
        self._executor.shutdown(wait=True)
