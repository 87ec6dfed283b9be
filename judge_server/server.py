"""JudgeService over grpc.aio: a thin adapter over :class:`calibrl.judge_server.judge.Judge`.

Score checks the request, estimates its cost (``calibrl.judge_server.costs``) and
refuses one above ``max_request_cost_s``, answers cached items at once, and sends the
rest through a :class:`calibrl.batching.MicroBatcher` keyed by rubric hash, for the
call's tenant (API key, else peer): concurrent callers of the same rubric share one
scoring batch, large requests are split into bounded units, tenants get weighted fair
shares and calls that could not be served in time are shed with pushback
(:class:`BatchMix` counts what each batch joined). Health says SERVING only once every
model is loaded and a probe item of every served rubric has been scored. Errors become status codes in
``calibrl.serving.rpc_errors``; the server keeps serving.

``start(config)`` is what tests and other components use: it starts the server on
the current event loop and returns a ``RunningServer`` (``.port``, ``.stop()``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from calibrl import telemetry
from calibrl.admission import check_budget
from calibrl.batching import MicroBatcher
from calibrl.security import tenant_weights
from calibrl.threads import call_nicer
from calibrl.serving import BATCHER_CLOSE_S, RunningServer, rpc_errors, start_server, tenant_of_call, time_remaining
from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc
from calibrl.judge_server import costs as cost_model
from calibrl.judge_server import programmatic, rubric_store
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeServerConfig
from calibrl.judge_server.judge import Judge, RubricStatus
from calibrl.judge_server.rubric import Rubric
from calibrl.judge_server.version_store import VersionStore
from calibrl.api.judge import ItemScore, JudgeItem

if TYPE_CHECKING:  # pragma: no cover
    from grpc.aio import ServerInterceptor, ServicerContext

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JudgeService"].full_name

# Maps a call's context to its tenant (None = no API keys configured: every rubric visible).
TenantResolver = Callable[["ServicerContext"], "str | None"]


def _authenticated_tenant(context: "ServicerContext") -> str | None:
    """The tenant calibrl.security's AuthInterceptor authenticated for this call."""
    from calibrl.security import current_tenant

    return current_tenant()


def rubric_to_proto(status: RubricStatus, max_request_cost_s: float = 0.0) -> pb.Rubric:
    import json

    rubric = status.rubric
    message = pb.Rubric(
        id=rubric.id, version=rubric.version, hash=rubric.hash, description=rubric.description,
        source_yaml=rubric.source_yaml, max_request_cost_s=max_request_cost_s,
        criteria=[
            pb.Criterion(name=c.name, kind=c.kind, question=c.question, scorer=c.scorer,
                         params_json=json.dumps(c.canonical().get("params", {}), sort_keys=True),
                         weight=c.weight, severity=c.severity, penalty=c.penalty)
            for c in rubric.criteria
        ],
    )
    if status.validation is not None:
        v = status.validation
        message.validation.CopyFrom(pb.Validation(
            passed=v.passed, kappa=v.kappa if v.kappa is not None else 0.0, model_id=v.model_id,
            threshold=v.min_kappa, min_kappa=v.min_kappa, pass_threshold=v.pass_threshold,
            pass_threshold_source=v.pass_threshold_source, reason=v.reason))
    return message


class BatchMix:
    """Which Score calls wait on the batcher, to tell what each computed batch mixed: how
    many calls it joined, and whether a call of another rubric was waiting meanwhile (two
    agents on one server). The worker thread reads what the event loop writes: a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call_of: dict[int, int] = {}  # id(item) -> its call's number, for items on the batcher
        self._waiting: dict[str, int] = {}  # rubric id -> its calls on the batcher
        self._calls = 0

    def enter(self, rubric_id: str, items: Sequence[JudgeItem]) -> None:
        with self._lock:
            self._calls += 1
            self._call_of.update((id(item), self._calls) for item in items)
            self._waiting[rubric_id] = self._waiting.get(rubric_id, 0) + 1

    def leave(self, rubric_id: str, items: Sequence[JudgeItem]) -> None:
        with self._lock:
            for item in items:
                self._call_of.pop(id(item), None)
            self._waiting[rubric_id] -= 1

    def record(self, rubric_id: str, batch: Sequence[JudgeItem]) -> tuple[int, bool]:
        """Count one computed batch of ``rubric_id`` (``judge_batch_mix``); returns the number
        of calls it joined and whether a call of another rubric was waiting."""
        with self._lock:
            calls = len({self._call_of.get(id(item)) for item in batch})
            others = any(n > 0 for r, n in self._waiting.items() if r != rubric_id)
        telemetry.record("judge_batch_mix", 1, rubric=rubric_id, calls="several" if calls > 1 else "one",
                         other_rubric="waiting" if others else "none")
        return calls, others


def rubric_uses_minilm(judge: Judge, rubric: Rubric) -> bool:
    """Whether scoring ``rubric`` runs the MiniLM embedder (a programmatic criterion needs one)."""
    return judge.config.embedder == "minilm" and any(
        c.kind == "programmatic" and programmatic.SCORERS[c.scorer].needs_embedder for c in rubric.criteria)


def estimate_costs(judge: Judge, rubric: Rubric, items: Sequence[JudgeItem]) -> list[float]:
    """Estimated seconds per item (calibrl.judge_server.costs)."""
    return cost_model.item_costs(items, minilm=rubric_uses_minilm(judge, rubric),
                                 llm_criteria=len(rubric.llm_criteria),
                                 llm_cost_per_item_s=judge.config.llm_cost_per_item_s,
                                 distinct_texts=judge.config.embedder_cache_size > 0)


class JudgeServicer(judge_pb2_grpc.JudgeServiceServicer):
    def __init__(self, judge: Judge, batcher: MicroBatcher, tenant_of: TenantResolver = _authenticated_tenant,
                 max_request_cost_s: float = 0.0) -> None:
        self.judge = judge
        self.rubric_folder: rubric_store.RubricFolder | None = None  # ReloadRubrics rereads it
        self.rubric_admin_tenants: Sequence[str] = ()
        self.batcher = batcher
        self.tenant_of = tenant_of
        self.max_request_cost_s = max_request_cost_s
        self.mix = BatchMix()

    async def score_items(self, rubric: Rubric, items: Sequence[JudgeItem], timeout_s: float | None = None,
                          tenant: str | None = None) -> list[ItemScore]:
        results, missing = self.judge.lookup(rubric, items)
        if missing:
            unique = list(dict.fromkeys(items[i] for i in missing))
            costs = estimate_costs(self.judge, rubric, unique)
            self.mix.enter(rubric.id, unique)
            try:
                computed = dict(zip(unique, await self.batcher.submit(rubric.hash, unique, timeout_s=timeout_s,
                                                                      tenant=tenant, costs=costs)))
            finally:
                self.mix.leave(rubric.id, unique)
            for i in missing:
                results[i] = computed[items[i]]
        return results  # type: ignore[return-value]

    @rpc_errors
    async def Score(self, request: pb.ScoreRequest, context: "ServicerContext") -> pb.ScoreResponse:
        rubric = self.judge.resolve(request.rubric_id, self.tenant_of(context), request.rubric_hash)
        items = [wire.item_from_proto(m) for m in request.items]
        self.judge.check_items(items)
        check_budget("items", estimate_costs(self.judge, rubric, items), self.max_request_cost_s,
                     "max_request_cost_s")
        telemetry.record("judge_calls", 1, rubric=rubric.id)
        scores = await self.score_items(rubric, items, timeout_s=time_remaining(context),
                                        tenant=tenant_of_call(context))
        return pb.ScoreResponse(scores=[wire.item_score_to_proto(s) for s in scores], rubric_id=rubric.id,
                                rubric_hash=rubric.hash, model_id=self.judge.scorer_id(rubric),
                                rubric_version=rubric.version)

    @rpc_errors
    async def ListRubrics(self, request: pb.ListRubricsRequest, context: "ServicerContext") -> pb.ListRubricsResponse:
        tenant = self.tenant_of(context)
        return pb.ListRubricsResponse(rubrics=[
            pb.RubricSummary(id=s.rubric.id, version=s.rubric.version, hash=s.rubric.hash,
                             description=s.rubric.description, num_criteria=len(s.rubric.criteria),
                             validated=s.validated,
                             versions=rubric_store.versions_to_proto(self.judge, s.rubric.id, tenant))
            for s in self.judge.statuses(tenant)
        ])

    @rpc_errors
    async def GetRubric(self, request: pb.GetRubricRequest, context: "ServicerContext") -> pb.Rubric:
        tenant = self.tenant_of(context)
        status = self.judge.status(request.rubric_id, tenant)
        message = rubric_to_proto(status, self.max_request_cost_s)
        message.versions.extend(rubric_store.versions_to_proto(self.judge, status.rubric.id, tenant))
        return message

    @rpc_errors
    async def ReloadRubrics(self, request: pb.ReloadRubricsRequest,
                            context: "ServicerContext") -> pb.ReloadRubricsResponse:
        return await rubric_store.reload_call(self.rubric_folder, self.tenant_of(context), self.rubric_admin_tenants)


def log_rubric_statuses(judge: Judge) -> None:
    """Say at start-up, per rubric, whether it will be served and why."""
    for status in judge.statuses():
        if status.usable and status.validated:
            log.info("rubric %s (hash %s): served, %s", status.rubric.id, status.rubric.hash[:12], status.reason)
        elif status.usable:
            log.warning("rubric %s (hash %s): %s", status.rubric.id, status.rubric.hash[:12], status.reason)
        else:
            log.warning("rubric %s: REFUSED (FAILED_PRECONDITION on Score): %s", status.rubric.id, status.reason)


PROBE_ITEM = JudgeItem.make("VTSAX expense ratio 2024", "VTSAX expense ratio for 2024")


def warm_up(judge: Judge) -> None:
    """Load every model the served rubrics need and score a probe item with each, so the
    first caller does not pay for loading (health says SERVING only after this)."""
    from calibrl.errors import CalibrlError

    for status in judge.statuses():
        if status.usable:
            try:
                judge.compute(status.rubric, [PROBE_ITEM], record=False)
            except CalibrlError as exc:  # the rubric's own calls will say the same; a model crash is raised
                log.error("rubric %s: the probe item could not be scored: %s", status.rubric.id, exc)


async def start(config: JudgeServerConfig, judge: Judge | None = None,
                tenant_of: TenantResolver = _authenticated_tenant,
                interceptors: Sequence["ServerInterceptor"] = ()) -> RunningServer:
    """Start the judge server on the current event loop (port 0 picks a free port)."""
    nice = config.serving.compute_nice  # models load at the workers' niceness (calibrl.threads.call_nicer)
    if judge is None:
        judge = call_nicer(nice, Judge.from_config, config.judge, config.rubrics)
    log.info("judge model id %s; %d rubric(s) from %s", judge.model_id, len(judge.statuses()), config.rubrics)
    log_rubric_statuses(judge)

    def process(rubric_hash: str, items: list[JudgeItem]) -> list[ItemScore]:
        rubric = judge.rubric_by_hash(rubric_hash)
        servicer.mix.record(rubric.id, items)
        return judge.compute(rubric, items)

    batcher: MicroBatcher = MicroBatcher(process, max_batch_items=config.max_batch_items,
                                         max_queue_items=config.max_queue_items, max_wait_ms=config.max_wait_ms,
                                         max_batch_cost=config.serving.max_unit_cost_s,
                                         max_tenant_queue_cost=config.serving.max_tenant_queue_cost_s,
                                         short_item_cost=config.serving.short_item_cost_s,
                                         worker_nice=config.serving.compute_nice,
                                         weights=tenant_weights(config.serving.api_keys_file), name="judge")
    servicer = JudgeServicer(judge, batcher, tenant_of, config.serving.max_request_cost_s)
    # rubric versions without a restart (calibrl.judge_server.rubric_store)
    judge.versions.retention_s = config.rubric_retention_s
    if config.rubric_state_dir == "none":
        log.info("rubric versions are kept in memory only (rubric_state_dir=none): a restart forgets the retained ones")
    else:  # versions survive a restart (calibrl.judge_server.version_store)
        store = VersionStore(config.rubrics, config.rubric_state_dir)
        store.restore(judge)
        judge.versions.on_change = store.save
        store.save(judge.versions)
    servicer.rubric_folder = rubric_store.RubricFolder(
        judge, config.rubrics, probe=lambda j, rubric: j.compute(rubric, [PROBE_ITEM], record=False))
    servicer.rubric_admin_tenants = tuple(config.rubric_admin_tenants)
    poller = rubric_store.RubricPoller(servicer.rubric_folder, config.rubric_poll_s)

    async def close_judge() -> None:
        judge.close()

    running = await start_server(
        config.serving,
        lambda server: judge_pb2_grpc.add_JudgeServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        on_no_new_calls=[batcher.end_windows],
        on_stop=[poller.stop, lambda: batcher.close(timeout_s=BATCHER_CLOSE_S), close_judge],
        interceptors=interceptors,
        warm_up=lambda: asyncio.to_thread(call_nicer, nice, warm_up, judge),
    )
    poller.start()
    running.servicer = servicer  # type: ignore[attr-defined]
    return running
