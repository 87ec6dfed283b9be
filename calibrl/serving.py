"""The shared `grpc.aio` server shell of both services.

Each service contributes a registration function (adds its servicer to the
server) and its fully-qualified service names; this module adds standard health
checking (grpc.health.v1) and server reflection (v1 and v1alpha), and owns the
shutdown order: on SIGTERM or SIGINT every service is set NOT_SERVING first and
the server keeps serving for ``drain_seconds`` (so load balancers notice and stop
routing), then ``server.stop(grace)`` lets calls in flight finish and cancels the
rest, then the service's own ``on_stop`` hooks run (e.g. closing a batcher).

What a request may cost the server before it is refused: the transport refuses a
message above ``max_request_mb`` (RESOURCE_EXHAUSTED) before it becomes a Python
object, and with API keys configured an unauthenticated call is refused before
its body is read (see calibrl.security).

Servicer methods wrap their body in :func:`rpc_errors`, the one place where
library exceptions become status codes.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

from calibrl.config import option
from calibrl.errors import CalibrlError, ConfigError, grpc_status_for
from calibrl.telemetry import TelemetryConfig

log = logging.getLogger(__name__)


@dataclass
class ServingConfig:
    """Network settings shared by the retrieval and judge servers."""

    host: str = option("127.0.0.1", "Address to bind; 0.0.0.0 to accept remote callers.")
    port: int = option(50051, "TCP port; 0 picks a free one (tests).")
    grace_seconds: float = option(10.0, "On SIGTERM, after the drain, how long calls in flight may take to finish.")
    drain_seconds: float = option(
        5.0, "On SIGTERM, how long the server keeps serving while health says NOT_SERVING (load balancers "
             "stop routing); a second signal cuts it short.")
    max_request_mb: float = option(
        4.0, "Largest request message, in MiB: the transport refuses a bigger one (RESOURCE_EXHAUSTED) "
             "before it is parsed.")
    max_message_mb: int = option(32, "Largest response message, in MiB.")
    max_request_cost_s: float = option(
        1.0, "Budget of one request: its estimated server time (each service's measured cost model), above "
             "which it is refused at once with RESOURCE_EXHAUSTED naming the cost and the limit; 0: no budget.")
    max_unit_cost_s: float = option(
        0.05, "Most estimated work in one batch beyond its first item: a large request is split into such "
              "units, interleaved fairly with other tenants' work (the judge's default is 0.1).")
    short_item_cost_s: float = option(
        0.05, "Items estimated at or below this many seconds may run on a second worker while the first runs "
              "a longer unit, so a small call never waits behind one long item in progress; 0: one worker.")
    compute_nice: int = option(
        5, "Niceness the batch worker threads add to the server's (0..19): the event loop and gRPC threads that "
           "admit, shed and answer calls run ahead of the scoring they queue, so a refusal is answered sooner "
           "while the workers fill every core. Where busy processes share the server's cores the workers yield "
           "to those too: the server serves fewer calls then, and a call admitted before they started that can "
           "no longer meet its deadline is refused with pushback. 0: the workers run at the server's priority "
           "(for a server whose cores are shared with other work that should not come first).")
    nice: int | None = option(
        None, "Niceness the whole server sets at start, before its models load (-20..19; none: as started). Below "
              "the niceness it was started with needs CAP_SYS_NICE (root) or an RLIMIT_NICE that allows it "
              "(ulimit -e; in a container --ulimit nice=25 allows -5), else the server refuses to start. A negative "
              "value puts the event loop and gRPC threads, and the workers compute_nice steps after them, ahead of "
              "other processes on shared cores: refusals are answered and admitted calls served sooner, at the "
              "neighbours' expense.")
    max_tenant_queue_cost_s: float = option(
        30.0, "Estimated work one tenant may have queued; beyond it the tenant's calls are shed at once "
              "(RESOURCE_EXHAUSTED with grpc-retry-pushback-ms).")
    tls_cert_file: str = option("", "PEM server certificate; with tls_key_file, serve TLS instead of plaintext.")
    tls_key_file: str = option("", "PEM private key of tls_cert_file.")
    tls_client_ca_file: str = option("", "PEM CA bundle; when set, clients must present a certificate it signed (mTLS).")
    api_keys_file: str = option("", "YAML file of tenants (key SHA-256, limits, weight); when set every call needs a key.")
    telemetry: TelemetryConfig = option(factory=TelemetryConfig, doc="OpenTelemetry spans and metrics.")

    def validate(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("serving.tls_cert_file and serving.tls_key_file go together: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("serving.tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serving.port={self.port}: must be in 0..65535")
        if self.grace_seconds < 0:
            raise ConfigError(f"serving.grace_seconds={self.grace_seconds}: must be >= 0")
        if self.drain_seconds < 0:
            raise ConfigError(f"serving.drain_seconds={self.drain_seconds}: must be >= 0 (0: no drain delay)")
        if not 0 < self.max_request_mb <= 2047:
            raise ConfigError(f"serving.max_request_mb={self.max_request_mb}: must be in (0, 2047] "
                              "(gRPC's limit is a signed 32-bit byte count)")
        if self.max_request_cost_s < 0:
            raise ConfigError(f"serving.max_request_cost_s={self.max_request_cost_s}: must be >= 0 (0: no budget)")
        if self.short_item_cost_s < 0:
            raise ConfigError(f"serving.short_item_cost_s={self.short_item_cost_s}: must be >= 0 (0: one worker)")
        if self.nice is not None and not -20 <= self.nice <= 19:
            raise ConfigError(f"serving.nice={self.nice}: must be in -20..19 (Linux niceness)")
        if not 0 <= self.compute_nice <= 19:
            raise ConfigError(f"serving.compute_nice={self.compute_nice}: must be in 0..19 (Linux niceness steps)")
        for name in ("max_unit_cost_s", "max_tenant_queue_cost_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"serving.{name}={getattr(self, name)}: must be > 0")
        if self.max_message_mb <= 0:
            raise ConfigError(f"serving.max_message_mb={self.max_message_mb}: must be > 0")


async def end_call(context: Any, code: Any, details: str, trailing_metadata: tuple = ()) -> None:
    """Give a refused call its final status; the handler returns None right after.

    A refusal with retry pushback (``grpc-retry-pushback-ms``: a shed call) ends with
    ``context.abort``, which answers with trailers only: the one response a client's gRPC
    retry policy (:data:`RETRY_SERVICE_CONFIG`) may retry. Every other refusal is final
    and ends without raising (status, details and trailers set; grpc.aio then sends an
    empty message before them, so a retry policy never resends the call). grpc.aio's abort
    path leaves native memory behind that neither ``gc`` nor ``malloc_trim`` gets back,
    more the larger the request: the judge's RSS grew steadily in
    ``benchmarks/bench_tenants.py --only soak``, whose over-budget requests are large;
    ended this way, the same calls leave nothing.
    """
    from calibrl.admission import PUSHBACK_KEY

    if any(key == PUSHBACK_KEY for key, _ in trailing_metadata):
        await context.abort(code, details, trailing_metadata=trailing_metadata)  # raises AbortError
    context.set_code(code)
    context.set_details(details)
    if trailing_metadata:
        context.set_trailing_metadata(trailing_metadata)


def rpc_errors(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Decorate an async servicer method: CalibrlError -> its status code; anything
    else -> INTERNAL with the traceback logged. The server keeps serving either way."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except CalibrlError as exc:
            # hints a client can act on: retry pushback (shed calls), items that fit a budget
            trailer = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
            await end_call(context, grpc_status_for(exc), str(exc), trailer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary of the service
            import grpc

            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("internal error in %s", method.__qualname__)
            await end_call(context, grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        return None

    return wrapper


async def _return_freed_memory(interval_s: float = 1.0) -> None:
    """Give freed heap memory back to the OS once a second (glibc ``malloc_trim``).

    The transport buffers a whole request before it can refuse it as oversize; the
    buffers are freed, but glibc keeps them in its arenas, so a flood of concurrent
    oversize requests would leave the process's RSS raised for good. Trimming costs
    well under a millisecond when there is nothing to give back. A no-op off glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    while True:
        await asyncio.sleep(interval_s)
        trim(0)


LOOP_PROBE_S = 0.01  # the loop-lag timer's period (calibrl.server.loop.lag)


async def _watch_loop_lag(period_s: float = LOOP_PROBE_S) -> None:
    """Record, every ``period_s``, how late the event loop ran a timer due then
    (``calibrl.server.loop.lag``): the wait of a ready call for the loop. Runs only with telemetry on."""
    from calibrl import telemetry

    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        telemetry.record("loop_lag", max(0.0, loop.time() - due))


def _cancelling(task: "asyncio.Future[Any]") -> Callable[[], Awaitable[None]]:
    async def cancel() -> None:
        task.cancel()

    return cancel


# A gRPC service config for clients other than calibrl's own (which retry with tenacity): gRPC
# retries shed calls itself and waits the server's grpc-retry-pushback-ms (gRFC A6). Pass it as
# the channel option ("grpc.service_config", RETRY_SERVICE_CONFIG).
RETRY_SERVICE_CONFIG = (
    '{"methodConfig": [{"name": [{"service": "calibrl.v1.JudgeService"}, {"service": "calibrl.v1.RetrievalService"}],'
    ' "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "5s", "backoffMultiplier": 2,'
    ' "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}}]}'
)


def tenant_of_call(context: Any) -> str:
    """Whom a call's work is queued for: the API key's tenant (calibrl.security), else the
    client's peer address (each client connection is its own tenant when there are no keys)."""
    from calibrl.security import current_tenant

    tenant = current_tenant()
    if tenant:
        return tenant
    try:
        peer = context.peer()
    except Exception:  # noqa: BLE001 - a context without a peer (tests)
        peer = ""
    return f"peer:{peer}" if peer else ""


def time_remaining(context: Any) -> float | None:
    """Seconds left before the call's deadline; None when the caller set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(0.0, remaining)


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _interceptor_base() -> type:
    import grpc

    return grpc.aio.ServerInterceptor


class DecodeGuardInterceptor(_interceptor_base()):  # type: ignore[misc]
    """Answer a request body that does not parse as the method's message with
    INVALID_ARGUMENT (grpc.aio alone would answer UNKNOWN)."""

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        import grpc

        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        decode, inner = handler.request_deserializer, handler.unary_unary

        def guarded_decode(data: bytes) -> Any:
            try:
                return decode(data)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad input
                return _Undecodable(exc)

        async def guarded(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await end_call(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"request: not a valid {handler_call_details.method} message "
                               f"({type(request.error).__name__})")
                return None
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=guarded_decode, response_serializer=handler.response_serializer
        )


@dataclass
class RunningServer:
    """A started server: its bound port and the means to stop it in order."""

    server: Any
    port: int
    health: Any
    service_names: list[str]
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # called when the server stops taking new calls, before the grace period for those in flight
    on_no_new_calls: list[Callable[[], None]] = field(default_factory=list)
    drain_seconds: float = 0.0  # what serve_until_signal uses (serving.drain_seconds)
    grace_seconds: float = 10.0
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop(self, grace: float | None = None, drain: float = 0.0,
                   drain_cut: asyncio.Event | None = None) -> None:
        """NOT_SERVING first; keep serving ``drain`` seconds (or until ``drain_cut`` is set);
        then refuse new calls (``on_no_new_calls`` hooks), let calls in flight finish for
        ``grace`` seconds and cancel the rest; then the ``on_stop`` hooks."""
        if self._stopped.is_set():
            return
        from grpc_health.v1 import health_pb2

        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)  # aio servicer: a coroutine
        if drain > 0:
            log.info("NOT_SERVING; still serving for the %.1fs drain delay", drain)
            try:
                await asyncio.wait_for((drain_cut or asyncio.Event()).wait(), drain)
                log.info("second signal: drain delay cut short")
            except asyncio.TimeoutError:
                pass
        for hook in self.on_no_new_calls:  # a call arriving from here on is refused by stop()
            hook()
        await self.server.stop(grace)
        for hook in self.on_stop:
            await hook()
        self._stopped.set()

    async def wait(self) -> None:
        """Block until :meth:`stop` has finished."""
        await self._stopped.wait()


async def start_server(
    config: ServingConfig,
    register: Callable[[Any], None],
    service_names: Iterable[str],
    on_stop: Iterable[Callable[[], Awaitable[None]]] = (),
    interceptors: Iterable[Any] = (),
    on_no_new_calls: Iterable[Callable[[], None]] = (),
    warm_up: Callable[[], Awaitable[None]] | None = None,
) -> RunningServer:
    """Build, bind and start a grpc.aio server with health and reflection, TLS and API
    keys when configured, and tracing when telemetry is on (see calibrl.telemetry.configure).

    Ready means ready: health answers NOT_SERVING from the moment the port is bound until
    ``warm_up`` (load every model, score a probe item) has finished, and SERVING after."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from calibrl import reflection, security, telemetry
    from calibrl.threads import responsive_gil

    responsive_gil()  # the event loop and the short lane get the GIL back soon from a busy worker
    if config.telemetry.enabled and not telemetry.enabled():
        telemetry.configure(config.telemetry, default_service_name=next(iter(service_names), "calibrl"))
    max_request_bytes = int(config.max_request_mb * 1024 * 1024)
    max_response_bytes = config.max_message_mb * 1024 * 1024
    chain = list(interceptors)
    if config.api_keys_file:
        chain.insert(0, security.AuthInterceptor(security.load_tenants(config.api_keys_file)))
    if telemetry.enabled():
        chain.insert(0, telemetry.TracingInterceptor())
    # Outermost, so no other interceptor ever sees an undecodable request.
    chain.insert(0, DecodeGuardInterceptor())
    server = grpc.aio.server(
        interceptors=chain,
        options=[
            # the transport refuses a larger request before it is parsed: no Python object, no copy
            ("grpc.max_receive_message_length", max_request_bytes),
            ("grpc.max_send_message_length", max_response_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    register(server)
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(server, [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
    address = f"{config.host}:{config.port}"
    if config.tls_cert_file:
        credentials = security.server_credentials(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file or None
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)  # until warmed up
    await server.start()
    trimmer = asyncio.ensure_future(_return_freed_memory())
    on_stop = [*on_stop, _cancelling(trimmer)]
    if warm_up is not None:
        try:
            await warm_up()
        except BaseException:
            await server.stop(0)
            trimmer.cancel()
            raise
    if telemetry.enabled():  # from the first call it serves
        on_stop = [*on_stop, _cancelling(asyncio.ensure_future(_watch_loop_lag()))]
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)  # aio servicer: a coroutine
    log.info("serving %s on %s:%d", ", ".join(names), config.host, port)
    return RunningServer(server, port, health_servicer, names, list(on_stop), list(on_no_new_calls),
                         drain_seconds=config.drain_seconds, grace_seconds=config.grace_seconds)


def freeze_loaded_objects() -> None:
    """For a server process, once it has started: everything loaded so far (modules, models,
    indexes) lives as long as the process, so it is moved out of the garbage collector's reach
    (``gc.freeze``) and a full collection scans only what calls allocate. Scanning it all held
    the interpreter for up to ~100 ms at a time under load, and every call waited, a shed one
    too. Not for a process that starts servers among other work (a test run): objects frozen
    there are never collected if they end up in a reference cycle."""
    gc.collect()
    gc.freeze()


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets, handled on the running loop from now on.
    A server process installs it before it starts listening, so a signal sent the
    moment the port is announced is still a drained shutdown, not a kill."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    return stop_requested


# After stop(grace) has cancelled the calls left, how long the batch in progress may take
# before the process exits without it (its thread is a daemon). No caller waits for it any
# more, so this is short: on a 2-core host running three times its cores in other work, the
# exit took up to 0.8 s after the grace with 0.5 here, against the promised 1 s.
BATCHER_CLOSE_S = 0.1


# A server process promises to exit within drain + grace + 1 s of SIGTERM. Its shutdown
# steps after the grace (hooks, the loop's teardown, the exit itself) are short on an idle
# host but took up to 0.8 s on a 2-core host running three times its cores in other work;
# past drain + grace + this margin a watchdog thread ends the process instead.
EXIT_WATCHDOG_MARGIN_S = 0.6


def start_exit_watchdog(after_s: float, code: int = 0) -> threading.Timer:
    """A daemon timer that ends the process with ``code`` after ``after_s`` seconds
    unless it has exited by then: logs flushed, atexit handlers skipped (they may be
    what is slow). Only for a server process's own shutdown, never a library caller's."""
    def fire() -> None:
        log.warning("shutdown still running %.1fs after the signal: exiting now", after_s)
        _flush_and_exit(code)

    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer


async def serve_until_signal(running: RunningServer, grace: float | None = None,
                             stop_requested: asyncio.Event | None = None, drain: float | None = None,
                             exit_watchdog: bool = False) -> None:
    """Run until SIGTERM or SIGINT (``stop_requested`` from :func:`stop_on_signals`,
    installed here when not given), then stop in order: NOT_SERVING, keep serving for
    the drain delay (a second signal cuts it short), stop with the grace period, hooks.
    ``grace`` and ``drain`` default to the server's serving config. ``exit_watchdog``
    (server processes only): end the process if it is still running drain + grace +
    :data:`EXIT_WATCHDOG_MARGIN_S` seconds after the signal."""
    grace = running.grace_seconds if grace is None else grace
    drain = running.drain_seconds if drain is None else drain
    if stop_requested is None:
        stop_requested = stop_on_signals()
    waiter = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([waiter, asyncio.ensure_future(running.server.wait_for_termination())],
                       return_when=asyncio.FIRST_COMPLETED)
    if exit_watchdog:
        start_exit_watchdog(drain + grace + EXIT_WATCHDOG_MARGIN_S)
    log.info("shutting down: NOT_SERVING, serving %.1fs more (drain), then up to %.1fs for calls in flight",
             drain, grace)
    stop_requested.clear()  # from here on a signal means: skip the rest of the drain
    await running.stop(grace, drain=drain, drain_cut=stop_requested)


def exit_after_shutdown(code: int = 0) -> None:
    """End a server process whose shutdown has finished (server stopped, hooks run).

    Runs the atexit handlers and flushes the logs, then leaves with ``os._exit``: the
    interpreter's own teardown of torch, faiss and the tokenizers took ~5 s on a
    shared 2-core host (measured in tests/test_abuse_shutdown.py's setting), which would
    break the promise of an exit within drain + grace + 1 s; a batch abandoned in
    its daemon thread is dropped the same way.
    """
    import atexit

    atexit._run_exitfuncs()
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
