"""Cross-caller micro-batching behind a cost-bounded, weighted-fair queue.

Both services receive many small concurrent calls (one per rollout group or
per agent) while their work is cheapest in large batches (one embedding pass,
one FAISS search, one judge forward). :class:`MicroBatcher` collects the items
of concurrent callers that share a key, runs them as one batch in a worker
thread, and hands each caller its own slice of the results.

Every item carries an estimated cost (seconds of server time, from the service's
cost model; 1 when none is given), and every call a tenant (the API key's tenant,
else the client's peer). The rules that keep one tenant from deciding another's
latency:

- **Bounded units.** A batch holds at most ``max_batch_items`` items and, while
  tenants compete (two or more submitted work within the last second), beyond its
  first item at most ``max_batch_cost`` of estimated work (less on a host measured
  slower than the cost model): a large request is split into such units,
  interleaved with other tenants' work. A tenant alone gets units of up to
  ``SOLO_UNIT_COST`` (0.5 s of estimated work, with costs in seconds).
- **Weighted fair queueing.** Each tenant has a virtual finish time, the cost
  served to it divided by its weight. The next unit is filled item by item from
  the tenant that is furthest behind (then, within a tenant, from its call with the
  least work left: its small call is not stuck behind its own large one, and calls
  of equal size finish in arrival order instead of all together), so a tenant's
  backlog delays others by at most its share, whatever the sizes of its requests.
  A tenant that comes back from idle starts at the current virtual time: idle time
  banks no credit, and work taken for a caller that then cancels is charged to its
  tenant all the same.
- **A short lane.** One item cannot be split, and the largest accepted item runs
  for a good part of a second, so with ``short_item_cost`` set a second worker
  takes units of items estimated at or below it, in the same fair order, while the
  main worker is busy: a small call does not wait behind a long item in progress
  (and a tenant's cancelled work stops after the units in progress on both).
- **Shedding with pushback.** A call is refused at once with
  :class:`~calibrl.admission.Shed` (RESOURCE_EXHAUSTED + retry pushback) when its
  tenant's queue is full (items or cost), when its expected wait (generalised
  processor sharing of the backlog, scaled by the measured wall seconds per unit of
  estimated cost) times ``DEADLINE_SAFETY`` would pass its deadline, or when
  running it would push a call already admitted for its deadline past that margin
  (each admitted call carries its promised wait, grown by every later call that
  goes ahead of it): an admitted call is not made to miss its deadline by the
  calls admitted after it.
- **A slowdown is not waited out.** When the server slows after calls were admitted
  (a neighbour took the cores) by more than the margin their admission left, a
  queued call that could no longer finish by its deadline at the new pace, after the
  work ahead of it counted as admission counts it, is refused then (the same
  :class:`~calibrl.admission.Shed` with pushback, counted as ``revoked``) instead of
  waiting out its deadline in the queue. The pace is taken from two units (one
  stalled unit refuses nothing), and the queue is checked between units and while a
  unit runs past its expected time.
- **The workers yield to the serving threads.** With ``worker_nice`` the worker
  threads run that much nicer than the event loop (:func:`calibrl.threads.lower_thread_priority`):
  admitting, shedding and answering calls never waits for a core behind the
  scoring work it queues.
- **Abandoned work is dropped.** When a caller gives up (cancelled, disconnected,
  past its deadline) its items still queued are removed before the next unit;
  only the unit already running finishes for it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import queue as queue_module
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Mapping, Sequence, TypeVar

from calibrl import telemetry
from calibrl.admission import Shed
from calibrl.errors import DeadlineExceeded, Unavailable
from calibrl.security import current_tenant
from calibrl.threads import lower_thread_priority

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

# Admit a call only when the expected wait, times this, fits its deadline: the estimate
# is an average, and tenants arriving later take their share too.
DEADLINE_SAFETY = 1.5
# Tenants compete (units are bounded) while two or more have submitted work this recently.
CONTENTION_WINDOW_S = 1.0
# A tenant alone gets larger units (batches are cheapest large), still bounded so that work
# stops soon after its caller gives up.
SOLO_UNIT_COST = 0.5
# Queued calls are refused for a slowdown at the faster of two paces (one stalled unit is not a
# slowdown): the last unit's and the unit in progress's so far, or the last two units'.
REVOKE_MIN_PACES = 2
# A shed call's pushback is stretched by a random share of up to this (never shortened): up to
# twice the wait. At half (0.5) the retries of 200 overload callers still came back in waves
# every few seconds, and gRPC accepts new calls one at a time, so a call that arrived in a wave
# waited 100-300 ms behind it before the server could refuse it (benchmarks/HISTORY.md).
PUSHBACK_JITTER = 1.0
# Tenants remembered (statistics, virtual times): without keys every connection is a tenant.
MAX_TENANT_STATS = 1000
# A call cancelled this close to its deadline, or later, was cancelled by its deadline (gRPC
# cancels the handler when it passes; the deadline the server reads starts a little later).
DEADLINE_CANCEL_SLACK_S = 0.05


@dataclass(eq=False)
class _Pending(Generic[ItemT, ResultT]):
    """One caller's items: those not yet handed to a batch start at ``next_index``."""

    key: Hashable
    tenant: "_Tenant"
    items: Sequence[ItemT]
    costs: Sequence[float]
    future: asyncio.Future
    enqueued: float  # loop.time() at submit
    deadline: float | None = None  # loop.time() after which the caller no longer waits
    results: list = field(default_factory=list)
    next_index: int = 0
    finished: int = 0
    served_cost: float = 0.0
    started: float | None = None  # loop.time() when its first unit started

    @property
    def waiting(self) -> int:
        return len(self.items) - self.next_index

    left_cost: float = -1.0  # estimated cost of the items not yet handed to a batch (set at submit)
    timeout_s: float | None = None  # set when admitted for its deadline: later admissions keep it
    promised_s: float = 0.0  # expected seconds from enqueued to done, grown by every later call ahead of it
    admitted_pace: float = 0.0  # seconds per unit of cost its admission assumed

    @property
    def waiting_cost(self) -> float:
        if self.left_cost < 0:
            self.left_cost = float(sum(self.costs[self.next_index:]))
        return self.left_cost


@dataclass(eq=False)
class _Tenant:
    name: str
    weight: float
    calls: list = field(default_factory=list)  # its _Pending, in arrival order
    finish: float = 0.0  # virtual finish time: cost served / weight
    queued_items: int = 0
    queued_cost: float = 0.0


@dataclass
class TenantStats:
    """What one tenant asked of the batcher (exported as metrics, read by tests)."""

    admitted_cost: float = 0.0
    served_cost: float = 0.0
    shed: int = 0
    cancelled_items: int = 0  # queued items dropped because the caller gave up or ran out of time
    missed: int = 0  # admitted calls that ran out of time on the server (expired queued, or done late)
    late: int = 0  # of the missed calls, those whose last unit was running when the deadline passed
    revoked: int = 0  # admitted calls refused before their deadline when the server slowed (shed, not missed)
    queue_seconds: list[float] = field(default_factory=list)  # submit -> first unit started, per call


@dataclass
class BatcherStats:
    """Counters a server may export as metrics."""

    batches: int = 0
    items: int = 0
    largest_batch: int = 0
    rejected: int = 0
    abandoned_items: int = 0  # items dropped from the queue because their caller gave up
    batch_sizes: list[int] = field(default_factory=list)
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    seconds_per_cost: float = 1.0  # measured batch seconds per unit of estimated cost (moving average)

    def record(self, size: int) -> None:
        self.batches += 1
        self.items += size
        self.largest_batch = max(self.largest_batch, size)
        if len(self.batch_sizes) < 10_000:
            self.batch_sizes.append(size)

    def tenant(self, name: str) -> TenantStats:
        stats = self.tenants.get(name)
        if stats is None:
            if len(self.tenants) >= MAX_TENANT_STATS:  # peers come and go: forget the oldest
                del self.tenants[next(iter(self.tenants))]
            stats = self.tenants[name] = TenantStats()
        return stats


class _DaemonWorker(concurrent.futures.Executor):
    """One daemon thread that runs the batches in order.

    A ThreadPoolExecutor's threads are joined when the interpreter exits, so a batch
    still running at shutdown would hold the process open past its grace period; a
    daemon thread does not.
    """

    def __init__(self, name: str, nice: int = 0) -> None:
        self._jobs: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._nice = nice
        self.nice_in_force: int | None = None  # the thread's niceness once it runs (None: not yet)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _loop(self) -> None:
        self.nice_in_force = lower_thread_priority(self._nice, self._thread.name)
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
    mode, rubric hash) are never mixed in one batch. ``weights`` maps tenant names
    to their weights (1 for a tenant not listed).
    """

    def __init__(
        self,
        process: Callable[[Hashable, list[ItemT]], list[ResultT]],
        *,
        max_batch_items: int = 256,
        max_queue_items: int = 4096,
        max_wait_ms: float = 2.0,
        max_batch_cost: float = math.inf,
        max_tenant_queue_items: int | None = None,
        max_tenant_queue_cost: float = math.inf,
        weights: Mapping[str, float] | None = None,
        executor: concurrent.futures.Executor | None = None,
        name: str = "batcher",
        short_item_cost: float = 0.0,
        worker_nice: int = 0,
    ) -> None:
        self.name = name
        self._gauge_registered = False
        self._process = process
        self.max_batch_items = max_batch_items
        self.max_queue_items = max_queue_items
        self.max_batch_cost = max_batch_cost
        self.max_tenant_queue_items = max_tenant_queue_items or max_queue_items
        self.max_tenant_queue_cost = max_tenant_queue_cost
        self.weights = dict(weights or {})
        self.max_wait_s = max_wait_ms / 1000.0
        self.worker_nice = worker_nice
        self._executor = executor or _DaemonWorker(name, worker_nice)
        # the short lane: a second worker that runs only items estimated at or below
        # short_item_cost, while the main one runs anything (0: no short lane)
        self.short_item_cost = short_item_cost
        self._short_executor = _DaemonWorker(f"{name}-short", worker_nice) if short_item_cost > 0 else None
        self._busy = {"main": False, "short": False}
        self._units: set[asyncio.Task] = set()  # units in progress (tasks awaiting a worker)
        self._speed_seconds, self._speed_cost = 0.0, 0.0  # moving sums behind stats.seconds_per_cost
        self._recent_paces: collections.deque[float] = collections.deque(maxlen=2)  # s per cost of the last units
        self._tenants: dict[str, _Tenant] = {}  # tenants with queued calls
        self._finish_of: dict[str, float] = {}  # virtual finish time of every tenant seen (bounded below)
        self._virtual_now = 0.0
        self._last_submit: dict[str, float] = {}  # tenant -> time.monotonic() of its last admitted call
        self._running_cost = 0.0  # estimated cost of the unit in progress
        self._running_since = 0.0  # time.perf_counter() when it started
        self._queued_items = 0
        self._wakeup: asyncio.Event | None = None
        self._window_cut: asyncio.Event | None = None  # set by end_windows(): a window ends early
        self._windows_open = True
        self._worker: asyncio.Task | None = None
        self._closing = False
        self.stats = BatcherStats()
        self._jitter = random.Random()

    @property
    def queue_depth(self) -> int:
        """Items waiting, all keys together."""
        return self._queued_items

    def expected_wait_s(self, tenant: str, cost: float) -> float:
        """Seconds until a new call of ``tenant`` costing ``cost`` would be done, as under
        generalised processor sharing of the current backlog: its tenant's queued calls with
        no more work left (a tenant's calls run least work left first) and the new call,
        plus each other tenant's backlog up to that tenant's share meanwhile, plus the unit
        in progress; scaled by the measured seconds per unit of cost. Calls that arrive
        later cannot stretch this beyond the call's deadline: they are admitted only while
        every admitted call keeps its margin (:meth:`_delays`)."""
        weight = self.weights.get(tenant, 1.0)
        own_state = self._tenants.get(tenant)
        own = cost + (sum(r for p in own_state.calls if (r := p.waiting_cost) <= cost)
                      if own_state is not None else 0.0)
        others = sum(min(t.queued_cost, own * t.weight / weight)
                     for name, t in self._tenants.items() if name != tenant)
        spc = self.stats.seconds_per_cost
        return (own + others) * spc + self._running_left_s(spc)

    def _running_left_s(self, spc: float) -> float:
        """Seconds the unit in progress still needs at ``spc`` seconds per unit of cost."""
        return max(0.0, self._running_cost * spc - (time.perf_counter() - self._running_since))

    def _delays(self, tenant: str, cost: float) -> tuple[list[tuple[_Pending, float]], _Pending | None]:
        """How much a new call of ``tenant`` costing ``cost`` would delay each call admitted
        for its deadline and still waiting (at most its cost; for another tenant's call at
        most that call's remaining work times the weight ratio, the new call's share
        meanwhile; for its own tenant's, only a call with more work left), in seconds;
        and the first call whose margin it would break (None: none)."""
        spc = self.stats.seconds_per_cost
        weight = self.weights.get(tenant, 1.0)
        delays = []
        for name, state in self._tenants.items():
            for pending in state.calls:
                if pending.timeout_s is None or not pending.waiting:
                    continue
                left = pending.waiting_cost
                if name == tenant:
                    delay = cost if cost < left else 0.0
                else:
                    delay = min(cost, left * weight / state.weight)
                if delay <= 0:
                    continue
                if (pending.promised_s + delay * spc) * DEADLINE_SAFETY > pending.timeout_s:
                    return delays, pending
                delays.append((pending, delay * spc))
        return delays, None

    async def submit(self, key: Hashable, items: Sequence[ItemT], timeout_s: float | None = None,
                     *, tenant: str | None = None, costs: Sequence[float] | None = None) -> list[ResultT]:
        """Queue ``items`` under ``key`` for ``tenant`` and wait for their results.

        ``tenant`` defaults to the call's authenticated tenant (calibrl.security); ``costs``
        are the items' estimated costs in seconds (1 each when not given: then no call is
        shed for its deadline, the batcher cannot tell seconds). ``timeout_s`` (the call's
        remaining deadline): a call that could not be served in time is refused at once
        (:class:`~calibrl.admission.Shed`); past it, items not yet in a batch are dropped
        and :class:`~calibrl.errors.DeadlineExceeded` is raised.
        """
        if self._closing:
            raise Unavailable("server is shutting down")
        if not items:
            return []
        self._register_gauge()
        name = tenant if tenant is not None else (current_tenant() or "")
        estimated = costs is not None
        costs = [1.0] * len(items) if costs is None else [max(1e-9, float(c)) for c in costs]
        if len(costs) != len(items):
            raise ValueError(f"{len(costs)} costs for {len(items)} items")
        cost = float(sum(costs))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        wait_s = self._admit(name, len(items), cost, timeout_s if estimated else None, estimated)
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._window_cut = asyncio.Event()
            if not self._windows_open:
                self._window_cut.set()
            self._worker = loop.create_task(self._run())
        self._last_submit.pop(name, None)
        self._last_submit[name] = time.monotonic()
        state = self._tenants.get(name)
        if state is None:  # back from idle: start at the current virtual time, no banked credit
            state = self._tenants[name] = _Tenant(name, self.weights.get(name, 1.0))
            state.finish = max(self._finish_of.get(name, 0.0), self._virtual_now)
        pending = _Pending(key=key, tenant=state, items=items, costs=costs, future=loop.create_future(),
                           enqueued=loop.time(), deadline=deadline, results=[None] * len(items),
                           timeout_s=timeout_s if estimated else None, promised_s=wait_s,
                           admitted_pace=self.stats.seconds_per_cost)
        state.calls.append(pending)
        state.queued_items += len(items)
        state.queued_cost += cost
        self._queued_items += len(items)
        self.stats.tenant(name).admitted_cost += cost
        telemetry.record("cost_admitted", cost, tenant=name, batcher=self.name)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            return await pending.future
        except asyncio.CancelledError:
            if pending.deadline is not None and loop.time() >= pending.deadline - DEADLINE_CANCEL_SLACK_S:
                self._missed(pending, "cancelled")  # gRPC cancels a call when its deadline passes
            self._forget(pending)  # the caller gave up: its queued items never run
            raise
        finally:
            self._annotate_span(pending)

    @staticmethod
    def _annotate_span(pending: _Pending) -> None:
        """The call's tenant, estimated cost and queue time on its server span (when tracing)."""
        if not telemetry.enabled():
            return
        from opentelemetry import trace

        span = trace.get_current_span()
        span.set_attribute("calibrl.tenant", pending.tenant.name or "none")
        span.set_attribute("calibrl.cost_s", float(sum(pending.costs)))
        if pending.started is not None:
            span.set_attribute("calibrl.queue_s", pending.started - pending.enqueued)

    def _register_gauge(self) -> None:
        if not self._gauge_registered and telemetry.enabled():
            telemetry.observe_gauge(
                "calibrl.queue.depth", lambda: float(self._queued_items), "Items waiting to be batched",
                batcher=self.name,
            )
            self._gauge_registered = True

    def _admit(self, tenant: str, count: int, cost: float, timeout_s: float | None, estimated: bool) -> float:
        """Shed a call at once when a queue is full, when it could not be served before its
        deadline (``timeout_s``), or when running it would make a call already admitted
        for its deadline miss it (only for calls whose costs were estimated, in seconds);
        else charge its delay to the calls it goes ahead of and return its expected wait."""
        state = self._tenants.get(tenant)
        queued_items = state.queued_items if state else 0
        queued_cost = state.queued_cost if state else 0.0
        reason = message = ""
        wait_s = self.expected_wait_s(tenant, cost)
        retry_after = wait_s - (timeout_s / DEADLINE_SAFETY if timeout_s is not None else cost)
        delays: list[tuple[_Pending, float]] = []
        if self._queued_items + count > self.max_queue_items:
            reason, message = "queue_full", (f"request queue full ({self._queued_items} items waiting, limit "
                                             f"{self.max_queue_items})")
        elif queued_items + count > self.max_tenant_queue_items or queued_cost + cost > self.max_tenant_queue_cost:
            reason, message = "tenant_queue_full", (
                f"tenant {tenant or 'anonymous'!r} queue full ({queued_items} items, {queued_cost:.2f} s of work "
                f"waiting; limits {self.max_tenant_queue_items} items, {self.max_tenant_queue_cost:g} s)")
        elif (timeout_s is not None and wait_s * DEADLINE_SAFETY > timeout_s
              and wait_s > cost * self.stats.seconds_per_cost):  # only queued work ahead sheds a call
            reason, message = "deadline", (f"expected wait {wait_s:.2f} s (x{DEADLINE_SAFETY} margin) exceeds the "
                                           f"call's deadline of {timeout_s:.2f} s")
        elif estimated:
            delays, kept = self._delays(tenant, cost)
            if kept is not None:
                reason, message = "deadline", (
                    f"running it now would make an admitted call miss its deadline ({kept.waiting_cost:.2f} s of "
                    f"its work left, {kept.timeout_s:.2f} s deadline)")
                # come back when that call is expected to be done
                retry_after = kept.enqueued + kept.promised_s - asyncio.get_running_loop().time()
        if not reason:
            for pending, delay in delays:
                pending.promised_s += delay
            return wait_s
        # come back when this tenant's backlog (at its share) would have drained enough; never
        # sooner than a quarter of the wait, so an estimate near the line is not retried in a loop
        raise self._refusal(tenant, cost, reason, message, max(0.25 * wait_s, retry_after))

    def _refusal(self, tenant: str, cost: float, reason: str, message: str, retry_after_s: float) -> Shed:
        """Count a refused call of ``tenant`` (statistics and metrics, by ``reason``) and
        return its :class:`Shed`, whose pushback is ``retry_after_s`` (at least 10 ms)
        stretched by a random share of up to ``PUSHBACK_JITTER``: callers refused together
        (told the same wait) that returned at once would queue behind each other in the
        transport before any is seen, and so would every other new call meanwhile."""
        self.stats.rejected += 1
        self.stats.tenant(tenant).shed += 1
        telemetry.record("refusals", 1, tenant=tenant or "none", reason=reason, batcher=self.name)
        telemetry.record("cost_refused", cost, tenant=tenant or "none", reason=reason, batcher=self.name)
        pushback = max(0.01, retry_after_s) * (1.0 + PUSHBACK_JITTER * self._jitter.random())
        return Shed(message, retry_after_s=pushback)

    def _forget(self, pending: _Pending, abandoned: bool = True) -> None:
        """Remove a call's queued items (``abandoned``: its caller gave up or it failed; else
        the server refused it, and they are not counted as cancelled)."""
        state = pending.tenant
        if pending not in state.calls:
            return
        state.calls.remove(pending)
        self._unqueue(pending, pending.waiting, pending.waiting_cost)
        if not abandoned:
            return
        self.stats.abandoned_items += pending.waiting
        self.stats.tenant(state.name).cancelled_items += pending.waiting
        telemetry.record("cancelled_items", pending.waiting, tenant=state.name or "none", batcher=self.name)

    def _unqueue(self, pending: _Pending, count: int, cost: float) -> None:
        state = pending.tenant
        state.queued_items -= count
        state.queued_cost = max(0.0, state.queued_cost - cost)
        self._queued_items -= count
        if not state.calls and self._tenants.get(state.name) is state:
            self._finish_of[state.name] = state.finish
            del self._tenants[state.name]
            if len(self._finish_of) > MAX_TENANT_STATS:  # peers come and go; only the recent matter
                self._finish_of = {n: f for n, f in self._finish_of.items() if f >= self._virtual_now}

    def _drop_abandoned(self, now: float) -> None:
        """Remove callers that are done (cancelled, failed) or past their deadline."""
        for state in list(self._tenants.values()):
            for pending in list(state.calls):
                if not pending.future.done() and pending.deadline is not None and now >= pending.deadline:
                    self._missed(pending, "queued")
                    pending.future.set_exception(DeadlineExceeded(
                        f"deadline passed with {pending.waiting} of {len(pending.items)} items not yet started"))
                if pending.future.done():
                    self._forget(pending)

    def _revoke_doomed(self, now: float) -> None:
        """Refuse now each queued call admitted for its deadline that could no longer
        finish by it at the current speed: after the unit in progress, the work ahead of it
        in its own tenant's order (least work left first) and the other tenants' backlogs up
        to their shares meanwhile (as admission counts them). Only a call whose admission
        assumed a pace faster by more than ``DEADLINE_SAFETY`` is refused: admission left
        that margin, so a pace that moves less (the cost model's error, a busy moment)
        refuses nothing. A refused call's cost no longer counts ahead of its tenant's calls
        after it. The pace (seconds per unit of cost) is the faster of two: the last unit's
        and the unit in progress's so far, or the last two units' when none is in progress.
        It follows a slowdown within a unit or two, and one stalled unit refuses nothing."""
        paces = list(self._recent_paces)
        if self._running_cost > 0 and paces:
            paces = [paces[-1], (time.perf_counter() - self._running_since) / self._running_cost]
        if len(paces) < REVOKE_MIN_PACES:
            return
        spc = min(paces)
        if not any(p.timeout_s is not None and spc > DEADLINE_SAFETY * p.admitted_pace
                   for state in self._tenants.values() for p in state.calls):
            return  # no call's margin is spent: the usual case, checked in one pass
        running_s = self._running_left_s(spc)
        backlogs = [(state.name, state.queued_cost, state.weight) for state in self._tenants.values()]
        for state in list(self._tenants.values()):
            waiting = sorted((p for p in state.calls if p.waiting and not p.future.done()),
                             key=lambda p: p.waiting_cost)  # sorted() is stable: then arrival order
            ahead = 0.0
            for pending in waiting:
                own = ahead + pending.waiting_cost
                if (pending.timeout_s is None or pending.deadline is None
                        or spc <= DEADLINE_SAFETY * pending.admitted_pace):  # within the margin it was given
                    ahead += pending.waiting_cost
                    continue
                others = sum(min(queued, own * weight / state.weight)
                             for name, queued, weight in backlogs if name != state.name)
                done_by = now + running_s + (own + others) * spc
                if done_by <= pending.deadline:
                    ahead += pending.waiting_cost
                    continue
                self._revoke(pending, running_s + (ahead + others) * spc, done_by - now)

    def _revoke(self, pending: _Pending, retry_after_s: float, expected_s: float) -> None:
        tenant = pending.tenant.name
        self.stats.tenant(tenant).revoked += 1
        left = pending.deadline - asyncio.get_running_loop().time() if pending.deadline is not None else 0.0
        pending.future.set_exception(self._refusal(
            tenant, float(sum(pending.costs)), "slowed",
            f"the server slowed down after admitting this call: it could not be done before its deadline "
            f"({expected_s:.2f} s at the earliest at the current speed, {left:.2f} s left)", retry_after_s))
        self._forget(pending, abandoned=False)

    def _next_call(self, key: Hashable | None, short: bool = False) -> _Pending | None:
        """The call that gets the next item: of the tenant furthest behind (least virtual
        finish time), its call with the least work left (then the earliest): a tenant's
        small call is not stuck behind its own large one, and calls of equal size finish
        in arrival order instead of all together; only calls of ``key`` when given, and only
        calls whose next item is short (at most ``short_item_cost``) when ``short``."""
        best: tuple[float, float, int] | None = None
        chosen = None
        for state in self._tenants.values():
            if best is not None and state.finish > best[0]:
                continue
            for order, pending in enumerate(state.calls):
                if not pending.waiting or (key is not None and pending.key != key):
                    continue
                if short and pending.costs[pending.next_index] > self.short_item_cost:
                    continue
                rank = (state.finish, pending.waiting_cost, order)
                if best is None or rank < best:
                    best, chosen = rank, pending
        return chosen

    def _competing(self) -> bool:
        """Whether two or more tenants have had work queued within the last ``CONTENTION_WINDOW_S``."""
        now = time.monotonic()
        recent = [name for name, seen in self._last_submit.items() if now - seen <= CONTENTION_WINDOW_S]
        if len(self._last_submit) > 1000:
            self._last_submit = {name: self._last_submit[name] for name in recent}
        return len(recent) + sum(1 for name in self._tenants if name not in recent) >= 2

    def _take_unit(self, short: bool = False) -> tuple[Hashable, list[tuple[_Pending, int, int]], float] | None:
        """One bounded unit of work: items of one key, at most ``max_batch_items`` and
        (beyond the first) ``max_batch_cost``, taken item by item in fair order; for the
        short lane only short items (None when there are none)."""
        first = self._next_call(None, short)
        if first is None:
            return None
        key = first.key
        # bounded while tenants compete, in measured seconds (on a host slower than the cost
        # model units hold less); a tenant alone keeps the large batches that are cheapest
        limit = max(self.max_batch_cost, SOLO_UNIT_COST)
        if self._competing():
            limit = self.max_batch_cost / max(1.0, self.stats.seconds_per_cost)
        self._virtual_now = max(self._virtual_now, first.tenant.finish)
        taken: dict[int, list] = {}  # id(pending) -> [pending, start, stop]
        count, cost = 0, 0.0
        pending: _Pending | None = first
        while pending is not None and count < self.max_batch_items:
            item_cost = pending.costs[pending.next_index]
            if count and cost + item_cost > limit:
                break
            entry = taken.setdefault(id(pending), [pending, pending.next_index, pending.next_index])
            entry[2] += 1
            pending.next_index += 1
            pending.left_cost = max(0.0, pending.waiting_cost - item_cost)
            pending.served_cost += item_cost
            pending.tenant.finish += item_cost / pending.tenant.weight
            count += 1
            cost += item_cost
            self._unqueue_item(pending, item_cost)
            pending = self._next_call(key, short)
        return key, [(p, start, stop) for p, start, stop in taken.values()], cost

    def _unqueue_item(self, pending: _Pending, cost: float) -> None:
        state = pending.tenant
        if not pending.waiting:
            state.calls.remove(pending)
        self.stats.tenant(state.name).served_cost += cost
        self._unqueue(pending, 1, cost)

    async def _run(self) -> None:
        """Hand units to the workers: the main one takes the next unit in fair order; while
        it is busy, the short lane (when configured) takes the next unit of short items,
        so a small call never waits behind a long item already running."""
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            self._drop_abandoned(loop.time())
            self._revoke_doomed(loop.time())
            lane = ("main" if not self._busy["main"] else
                    "short" if self._short_executor is not None and not self._busy["short"] else None)
            if not self._queued_items or lane is None:
                if self._closing and not self._queued_items and not self._units:
                    return
                self._wakeup.clear()
                await self._wait_for_wakeup()
                continue
            cycle_started = time.perf_counter()
            if (self.max_wait_s > 0 and self._queued_items < self.max_batch_items and self._windows_open
                    and sum(t.queued_cost for t in self._tenants.values()) < self.max_batch_cost):
                await self._batching_window()  # nobody else is waiting for a unit's worth: let callers join
                self._drop_abandoned(loop.time())
                if not self._queued_items:
                    continue
            unit = self._take_unit(short=lane == "short")
            if unit is None:  # nothing short queued: wait for the main worker or a new call
                if not self._busy["main"]:
                    # the main unit ended during the batching window: its wake-up is already
                    # spent, so clearing it now would leave the queue waiting for a call that
                    # may never come
                    continue
                self._wakeup.clear()
                await self._wait_for_wakeup()
                continue
            key, slices, cost = unit
            self._record_queue_times(slices, loop.time())
            self._busy[lane] = True
            if lane == "main":
                self._running_cost = cost
                self._running_since = time.perf_counter()
            task = loop.create_task(self._run_unit(lane, key, slices, cost, cycle_started))
            self._units.add(task)
            task.add_done_callback(self._units.discard)

    async def _wait_for_wakeup(self) -> None:
        """Wait for a new call or a unit's end; while calls wait behind a unit in progress,
        also wake each time the unit has run as long again as it was expected to, so
        that a slowdown is seen (:meth:`_revoke_doomed`) before the unit ends."""
        assert self._wakeup is not None
        if not (self._queued_items and self._running_cost > 0):
            await self._wakeup.wait()
            return
        try:
            await asyncio.wait_for(self._wakeup.wait(), max(0.005, self._running_cost * self.stats.seconds_per_cost))
        except asyncio.TimeoutError:
            pass

    async def _run_unit(self, lane: str, key: Hashable, slices: list[tuple[_Pending, int, int]], cost: float,
                        cycle_started: float) -> None:
        """Run one unit on ``lane``'s worker and deliver its results (or its error)."""
        loop = asyncio.get_running_loop()
        flat = [item for pending, start, stop in slices for item in pending.items[start:stop]]
        executor = self._executor if lane == "main" else self._short_executor
        try:
            try:
                results = await loop.run_in_executor(executor, self._process, key, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch returned {len(results)} results for {len(flat)} items")
            except BaseException as exc:  # noqa: BLE001 - delivered to every caller of the batch
                cancelled = isinstance(exc, asyncio.CancelledError)
                if cancelled:  # close() gave up on this batch
                    exc = Unavailable("server is shutting down; the batch was abandoned")
                for pending, _, _ in slices:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                    self._forget(pending)  # the rest of a failed call never runs
                if cancelled:
                    raise
                return
            self.stats.record(len(flat))
            telemetry.record("batch_size", len(flat), batcher=self.name)
            self._deliver(slices, results)
            if lane == "main":  # wall time per unit of cost, hand-over and delivery included
                self._learn_speed(cost, time.perf_counter() - cycle_started)
        finally:
            self._units.discard(asyncio.current_task())  # before the wake-up: close() waits for none left
            self._busy[lane] = False
            if lane == "main":
                self._running_cost = 0.0
            if self._wakeup is not None:
                self._wakeup.set()

    def _record_queue_times(self, slices: list[tuple[_Pending, int, int]], now: float) -> None:
        for pending, start, _ in slices:
            if start == 0:  # the call's first unit: its time in the queue ends here
                pending.started = now
                waited = now - pending.enqueued
                samples = self.stats.tenant(pending.tenant.name).queue_seconds
                if len(samples) >= 1000:  # the recent ones
                    del samples[:500]
                samples.append(waited)
                telemetry.record("queue_time", waited, tenant=pending.tenant.name or "none", batcher=self.name)

    def _learn_speed(self, cost: float, seconds: float) -> None:
        """Moving average of measured seconds per unit of estimated cost (the host may be
        slower or busier than the one the cost model was measured on)."""
        if cost > 0 and math.isfinite(cost):
            # moving sums of seconds and of cost, so a unit weighs by its cost (a tiny unit's
            # fixed overheads do not swing the rate)
            if not self._speed_cost:  # the first measurement replaces the prior of 1
                self._speed_seconds, self._speed_cost = seconds, cost
            self._recent_paces.append(seconds / cost)
            self._speed_seconds = 0.8 * self._speed_seconds + 0.2 * seconds
            self._speed_cost = 0.8 * self._speed_cost + 0.2 * cost
            self.stats.seconds_per_cost = min(100.0, max(1e-4, self._speed_seconds / self._speed_cost))

    def _deliver(self, slices: list[tuple[_Pending, int, int]], results: list) -> None:
        offset = 0
        now = asyncio.get_running_loop().time()
        for pending, start, stop in slices:
            pending.results[start:stop] = results[offset : offset + stop - start]
            pending.finished += stop - start
            offset += stop - start
            if pending.finished == len(pending.items) and not pending.future.done():
                if pending.deadline is not None and now > pending.deadline:
                    self._missed(pending, "late")
                pending.future.set_result(pending.results)

    def _missed(self, pending: _Pending, where: str) -> None:
        """Count an admitted call that ran out of time here (``queued``: expired before its
        last unit started; ``late``: its last unit ended after its deadline; ``cancelled``:
        the caller's deadline cancelled it while it waited or ran)."""
        stats = self.stats.tenant(pending.tenant.name)
        stats.missed += 1
        stats.late += where == "late"
        now = asyncio.get_running_loop().time()
        log.info("%s: an admitted call of tenant %r missed its deadline (%s): %d items, %.2f s of work, waited "
                 "%.2f s, promised %.2f s, deadline %.2f s, %.4f s per unit of cost now", self.name,
                 pending.tenant.name or "anonymous", where, len(pending.items), float(sum(pending.costs)),
                 now - pending.enqueued, pending.promised_s, pending.timeout_s or 0.0, self.stats.seconds_per_cost)
        telemetry.record("deadline_missed", 1, tenant=pending.tenant.name or "none", where=where, batcher=self.name)

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
                for task in list(self._units):
                    task.cancel()
                for state in list(self._tenants.values()):
                    for pending in list(state.calls):
                        if not pending.future.done():
                            pending.future.set_exception(Unavailable("server is shutting down"))
                        self._forget(pending)
                for executor in self._executors():
                    executor.shutdown(wait=False)
                return
        for executor in self._executors():
            executor.shutdown(wait=True)

    def _executors(self) -> list[concurrent.futures.Executor]:
        return [self._executor] + ([self._short_executor] if self._short_executor is not None else [])
