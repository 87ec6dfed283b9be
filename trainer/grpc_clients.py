"""Async gRPC clients of the two services (implement calibrl.trainer.clients' interfaces).

Every RPC gets a deadline (``timeout_s``) and is retried with exponential backoff
and jitter (tenacity) when the status is transient: UNAVAILABLE (a replica down
or draining), DEADLINE_EXCEEDED, and RESOURCE_EXHAUSTED that carries the standard
``grpc-retry-pushback-ms`` trailer (the server shed the call: its queue is full or
it could not start the work before the deadline); the wait before the next attempt
is at least the pushback. A RESOURCE_EXHAUSTED with ``calibrl-max-items`` (the
request is above the server's cost budget) splits the request into chunks of that
many items, which are sent again. Any other status becomes the matching
:mod:`calibrl.errors` exception at once, so a bad request fails fast with the
server's message (which names the field and the limit). A transient status that
outlives ``max_attempts`` also becomes a calibrl error (Unavailable or
ResourceExhausted): a reward that cannot be had fails the step, never becomes 0.
Retries and shed calls are counted in ``client.stats`` and as telemetry
(``calibrl.client.retries``, by service, method and code).

Batches larger than the server accepts are split into chunks (the retrieval
server's ``max_batch_size`` is read once from GetIndexInfo; the judge's is a
knob) and the chunks run concurrently, at most ``max_concurrency`` RPCs in
flight per client. Results come back in request order.

Targets are anything grpc accepts: ``127.0.0.1:50051``, ``dns:///svc:50051`` for
a set of stateless replicas behind a headless Service, or a fixed list
``ipv4:10.0.0.1:50051,10.0.0.2:50051``. Calls are balanced client-side with the
``round_robin`` policy over every address the target resolves to (``lb_policy``
knob), so each replica gets its share and a replica that goes away is skipped.

A client binds to the event loop of its first call; use it from that loop only
(``calibrl.trainer.aio.BackgroundLoop`` gives the synchronous trainer one).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Sequence, TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from calibrl import telemetry
from calibrl.errors import ConfigError, error_from_status, InvalidArgument, ResourceExhausted, Unavailable
from calibrl.api import judge_wire
from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api import retrieval_wire
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode
from calibrl.trainer.aio import gather_all
from calibrl.trainer.clients import IndexInfo, RubricInfo
from calibrl.v1 import judge_pb2, judge_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc

if TYPE_CHECKING:  # pragma: no cover
    import grpc
    import grpc.aio
    from google.protobuf.message import Message
    from tenacity import RetryCallState

    from calibrl.v1 import judge_pb2_grpc, retrieval_pb2_grpc

    Stub = retrieval_pb2_grpc.RetrievalServiceStub | judge_pb2_grpc.JudgeServiceStub

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

TRANSIENT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


PUSHBACK_KEY = "grpc-retry-pushback-ms"
MAX_ITEMS_KEY = "calibrl-max-items"


def _trailer(error: BaseException, key: str) -> int | None:
    """An integer trailing-metadata value of a failed call (None when absent or malformed)."""
    try:
        for name, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
            if name == key:
                return int(value)
    except (AttributeError, TypeError, ValueError):
        return None
    return None


def _is_transient(error: BaseException) -> bool:
    """UNAVAILABLE and DEADLINE_EXCEEDED; RESOURCE_EXHAUSTED only when the server pushed back
    (a shed call): without pushback it is a limit that the same request will hit again."""
    if not isinstance(error, grpc.aio.AioRpcError) or error.code().name not in TRANSIENT_CODES:
        return False
    return error.code().name != "RESOURCE_EXHAUSTED" or _trailer(error, PUSHBACK_KEY) is not None


class _WaitHonouringPushback:
    """tenacity wait: exponential backoff with jitter, and at least the server's pushback."""

    def __init__(self, backoff: "Callable[[RetryCallState], float]") -> None:
        self.backoff = backoff

    def __call__(self, state: "RetryCallState") -> float:
        wait = self.backoff(state)
        error = state.outcome.exception() if state.outcome is not None else None
        pushback_ms = _trailer(error, PUSHBACK_KEY) if error is not None else None
        return max(wait, pushback_ms / 1000.0) if pushback_ms is not None else wait


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


class _GrpcClient:
    """Channel, deadlines, retries and bounded concurrency shared by both clients."""

    _service = ""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 5,
        max_concurrency: int = 32,
        metadata: Iterable[tuple[str, str]] = (),
        channel_credentials: "grpc.ChannelCredentials | None" = None,
        max_batch_size: int | None = None,
        interceptors: "Sequence[grpc.aio.ClientInterceptor]" = (),
        max_message_mb: int = 32,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        lb_policy: str = "round_robin",
    ) -> None:
        name = type(self).__name__
        if not isinstance(target, str) or not target.strip():
            raise ConfigError(f"{name}.target={target!r}: give host:port or dns:///name:port")
        checks = [
            ("timeout_s", timeout_s, timeout_s > 0, "> 0"),
            ("max_attempts", max_attempts, max_attempts >= 1, ">= 1"),
            ("max_concurrency", max_concurrency, max_concurrency >= 1, ">= 1"),
            ("max_batch_size", max_batch_size, max_batch_size is None or max_batch_size >= 1, ">= 1 or None"),
            ("max_message_mb", max_message_mb, max_message_mb >= 1, ">= 1"),
            ("backoff_initial_s", backoff_initial_s, backoff_initial_s >= 0, ">= 0"),
            ("backoff_max_s", backoff_max_s, backoff_max_s >= backoff_initial_s, ">= backoff_initial_s"),
        ]
        for field, value, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{name}.{field}={value!r}: must be {rule}")
        self.target = target.strip()
        self.timeout_s = float(timeout_s)
        self.max_attempts = int(max_attempts)
        self.max_concurrency = int(max_concurrency)
        self.max_batch_size = max_batch_size
        self.metadata = tuple((str(k).lower(), str(v)) for k, v in metadata)
        self._credentials = channel_credentials
        self._interceptors = list(interceptors)
        self._max_message_bytes = int(max_message_mb) * 1024 * 1024
        self._backoff = (float(backoff_initial_s), float(backoff_max_s))
        self.lb_policy = lb_policy
        # retries: attempts after a transient failure; shed: RESOURCE_EXHAUSTED with pushback;
        # split: requests above the server's cost budget, split and sent again
        self.stats = {"retries": 0, "shed": 0, "split": 0}
        self._channel: "grpc.aio.Channel | None" = None
        self._stub: "Stub | None" = None
        self._semaphore: asyncio.Semaphore | None = None

    # --- channel ---------------------------------------------------------------------------------------------------

    def _channel_options(self) -> list[tuple[str, int | str]]:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", self._max_message_bytes),
        ]
        if self.lb_policy:
            # Spread calls over every replica the target resolves to (a headless Service's pods).
            options.append(("grpc.lb_policy_name", self.lb_policy))
        return options

    def _make_stub(self, channel: "grpc.aio.Channel") -> "Stub":
        raise NotImplementedError

    def _ensure_channel(self) -> "Stub":
        if self._stub is None:
            options = self._channel_options()
            interceptors = self._interceptors or None
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(
                    self.target, self._credentials, options=options, interceptors=interceptors
                )
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=options, interceptors=interceptors)
            self._stub = self._make_stub(self._channel)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._stub

    async def close(self) -> None:
        """Close the channel (calls in flight are cancelled). The client can be used again afterwards."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> "_GrpcClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- one call --------------------------------------------------------------------------------------------------

    async def _call(self, method: str, request: "Message") -> Any:
        """The response message of ``method`` (its type depends on the method): one unary RPC with a deadline per attempt, retries on transient codes, bounded concurrency."""
        stub = self._ensure_channel()
        assert self._semaphore is not None
        rpc = getattr(stub, method)
        initial, maximum = self._backoff
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=_WaitHonouringPushback(wait_exponential_jitter(initial=initial, max=maximum, jitter=initial)),
            retry=retry_if_exception(_is_transient),
            before_sleep=lambda state: self._count_retry(method, state),
            reraise=True,
        )
        span_name = f"calibrl.client/{self._service}/{method}"
        async with self._semaphore:
            with telemetry.tracer().start_as_current_span(span_name):
                try:
                    async for attempt in retrying:
                        with attempt:
                            return await rpc(
                                request, timeout=self.timeout_s, metadata=telemetry.inject_metadata(self.metadata)
                            )
                except grpc.aio.AioRpcError as exc:
                    details = exc.details() or ""
                    if _is_transient(exc):
                        self._count_shed(method, exc)
                        details = (f"{self.target} {self._service}/{method}: {exc.code().name} after "
                                   f"{self.max_attempts} attempts: {details}")
                    error = error_from_status(exc.code(), details)
                    error.fits_items = _trailer(exc, MAX_ITEMS_KEY)  # type: ignore[attr-defined]
                    raise error from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    def _count_shed(self, method: str, error: BaseException) -> None:
        if _trailer(error, PUSHBACK_KEY) is not None:
            self.stats["shed"] += 1
            telemetry.record("client_retries", 1, service=self._service, method=method, code="SHED")

    def _count_retry(self, method: str, state: "RetryCallState") -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        code = error.code().name if error is not None else "?"
        self.stats["retries"] += 1
        self._count_shed(method, error)
        telemetry.record("client_retries", 1, service=self._service, method=method, code=code)
        log.info("%s %s: attempt %d failed with %s; retrying", self.target, method, state.attempt_number, code)

    async def _chunked(
        self, items: Sequence[T], size: int, run: Callable[[Sequence[T]], Awaitable[list[R]]]
    ) -> list[R]:
        """Split ``items`` into chunks of ``size``, run them concurrently, concatenate in order."""
        if not items:
            return []
        parts = _chunks(items, size)
        if len(parts) == 1:
            return await self._within_budget(parts[0], run)
        results = await gather_all(*(self._within_budget(part, run) for part in parts))
        return [result for part in results for result in part]

    async def _within_budget(self, part: Sequence[T], run: Callable[[Sequence[T]], Awaitable[list[R]]]) -> list[R]:
        """``run(part)``; when the server refuses it as above its cost budget, the part again in
        chunks of the items that fit (the server's ``calibrl-max-items``)."""
        try:
            return await run(part)
        except ResourceExhausted as exc:
            fits = getattr(exc, "fits_items", None)
            if not fits or fits >= len(part):
                raise
            self.stats["split"] += 1
            results = await gather_all(*(self._within_budget(chunk, run) for chunk in _chunks(part, fits)))
            return [result for chunk in results for result in chunk]


class GrpcRetrievalClient(_GrpcClient):
    """RetrievalClient over gRPC (calibrl.v1.RetrievalService)."""

    _service = "RetrievalService"

    def __init__(self, target: str, **knobs: Any) -> None:
        super().__init__(target, **knobs)
        self._info: IndexInfo | None = None
        self._info_lock: asyncio.Lock | None = None

    def _make_stub(self, channel: "grpc.aio.Channel") -> "retrieval_pb2_grpc.RetrievalServiceStub":
        return retrieval_pb2_grpc.RetrievalServiceStub(channel)

    async def index_info(self) -> IndexInfo:
        """The served index and the server's limits (GetIndexInfo), as a plain dict."""
        message = await self._call("GetIndexInfo", retrieval_pb2.GetIndexInfoRequest())
        modes = {retrieval_pb2.SEARCH_MODE_DENSE: "dense", retrieval_pb2.SEARCH_MODE_BM25: "bm25",
                 retrieval_pb2.SEARCH_MODE_HYBRID: "hybrid"}
        info: IndexInfo = {
            "doc_count": int(message.doc_count),
            "embedder": message.embedder,
            "dimension": int(message.dimension),
            "dense_index_type": message.dense_index_type,
            "corpus_sha256": message.corpus_sha256,
            "library_versions": dict(message.library_versions),
            "modes": [modes[m] for m in message.modes if m in modes],
            "default_mode": modes.get(message.default_mode),
            "max_top_k": int(message.max_top_k),
            "max_batch_size": int(message.max_batch_size),
            "max_query_chars": int(message.max_query_chars),
        }
        self._info = info
        return info

    async def _limits(self) -> IndexInfo:
        if self._info is None:
            if self._info_lock is None:
                self._info_lock = asyncio.Lock()
            async with self._info_lock:
                if self._info is None:
                    await self.index_info()
        assert self._info is not None
        return self._info

    async def _prepare(self, queries: Sequence[str], field_pattern: str) -> int:
        """Check query lengths against the server's limit (a too-long query is not worth a retried
        RESOURCE_EXHAUSTED) and return the chunk size."""
        info = await self._limits()
        max_chars = info["max_query_chars"]
        if max_chars:
            for position, query in enumerate(queries):
                if len(query) > max_chars:
                    raise InvalidArgument(
                        field_pattern.format(position), f"{len(query)} characters, limit max_query_chars={max_chars} "
                        f"of the server at {self.target}; shorten the query"
                    )
        server_limit = info["max_batch_size"] or None
        limits = [n for n in (server_limit, self.max_batch_size) if n]
        return min(limits) if limits else 256

    async def search(
        self, queries: Sequence[str], top_k: int, mode: SearchMode | None = None, include_text: bool = False
    ) -> list[list[Hit]]:
        """Ranked hits per query, in order."""
        async def run(part: Sequence[str]) -> list[list[Hit]]:
            request = retrieval_pb2.SearchRequest(queries=list(part), top_k=top_k,
                                                  mode=retrieval_wire.mode_to_proto(mode), include_text=include_text)
            response = await self._call("Search", request)
            _check_count(len(response.results), len(part), "Search results")
            return [[retrieval_wire.hit_from_proto(h) for h in hits.hits] for hits in response.results]

        if not queries:
            return []
        return await self._chunked(list(queries), await self._prepare(queries, "queries[{}]"), run)

    async def score(
        self, items: Sequence[ScoreItem], top_k: int, mode: SearchMode | None = None, include_text: bool = False
    ) -> list[RetrievalScore]:
        """Reward signals per item, in order."""
        async def run(part: Sequence[ScoreItem]) -> list[RetrievalScore]:
            request = retrieval_pb2.ScoreRetrievalRequest(
                items=[retrieval_wire.score_item_to_proto(item) for item in part], top_k=top_k,
                mode=retrieval_wire.mode_to_proto(mode), include_text=include_text,
            )
            response = await self._call("ScoreRetrieval", request)
            _check_count(len(response.scores), len(part), "ScoreRetrieval scores")
            return [retrieval_wire.retrieval_score_from_proto(s) for s in response.scores]

        if not items:
            return []
        size = await self._prepare([item.query for item in items], "items[{}].query")
        return await self._chunked(list(items), size, run)


class GrpcJudgeClient(_GrpcClient):
    """JudgeClient over gRPC (calibrl.v1.JudgeService). ``max_batch_size`` (default 64) is the chunk size."""

    _service = "JudgeService"

    def __init__(self, target: str, **knobs: Any) -> None:
        knobs.setdefault("max_batch_size", 64)
        super().__init__(target, **knobs)

    def _make_stub(self, channel: "grpc.aio.Channel") -> "judge_pb2_grpc.JudgeServiceStub":
        return judge_pb2_grpc.JudgeServiceStub(channel)

    async def score(self, rubric_id: str, items: Sequence[JudgeItem], rubric_hash: str = "") -> list[ItemScore]:
        """Rubric scores per item, in order. ``rubric_hash`` pins the rubric's content (optional)."""
        async def run(part: Sequence[JudgeItem]) -> list[ItemScore]:
            request = judge_pb2.ScoreRequest(rubric_id=rubric_id, rubric_hash=rubric_hash,
                                      items=[judge_wire.item_to_proto(item) for item in part])
            response = await self._call("Score", request)
            _check_count(len(response.scores), len(part), "judge scores")
            return [
                judge_wire.item_score_from_proto(s, response.rubric_id, response.rubric_hash, response.model_id)
                for s in response.scores
            ]

        if not items:
            return []
        assert self.max_batch_size is not None
        return await self._chunked(list(items), self.max_batch_size, run)

    async def rubric_source(self, rubric_ref: str) -> str:
        """The rubric file (YAML) of ``rubric_ref`` (``id`` or ``id@version``) as the judge loaded it."""
        return (await self._call("GetRubric", judge_pb2.GetRubricRequest(rubric_id=rubric_ref))).source_yaml

    async def list_rubrics(self) -> list[RubricInfo]:
        """The rubrics this caller may use: id, version, hash, description, num_criteria, validated."""
        response = await self._call("ListRubrics", judge_pb2.ListRubricsRequest())
        return [
            {"id": r.id, "version": r.version, "hash": r.hash, "description": r.description,
             "num_criteria": int(r.num_criteria), "validated": bool(r.validated)}
            for r in response.rubrics
        ]


def _check_count(got: int, expected: int, what: str) -> None:
    if got != expected:
        # A reply that does not match the request cannot be trusted; surface it like a broken service.
        raise Unavailable(f"{what}: the server answered {got} results for {expected} requests")


__all__ = ["GrpcJudgeClient", "GrpcRetrievalClient", "TRANSIENT_CODES"]
