"""OpenTelemetry for both services and the trainer: spans with context propagated
through gRPC metadata (W3C traceparent), and metrics (latency histograms, batch
sizes, queue depth, cache lookups, per-tenant requests and refusals).

Off by default. ``TelemetryConfig(enabled=True)`` turns it on; with
``otlp_endpoint`` set, spans and metrics are exported over OTLP/gRPC (the
``otlp`` extra); with ``prometheus_port`` set, the same metrics are served at
``http://<prometheus_host>:<prometheus_port>/metrics`` for Prometheus to scrape
(OpenTelemetry's Prometheus exporter, the ``prometheus`` extra); otherwise they
stay in-process (useful with the in-memory exporters in tests). Providers are
owned by this module, not installed as the OpenTelemetry globals, so tests can
reconfigure them.

The instruments, by the key :func:`record` takes (Prometheus name in brackets):

- ``rpc_duration`` (``calibrl_rpc_server_duration_seconds``): server latency, by method and code
- ``client_duration`` (``calibrl_rpc_client_duration_seconds``): client latency, retries included
- ``batch_size`` (``calibrl_batch_size``): items per server-side batch, by batcher
- ``calibrl.queue.depth`` gauge (``calibrl_queue_depth``): items waiting, by batcher
- ``cache`` (``calibrl_cache_lookups_total``): judge cache lookups, by result (hit|miss) and rubric
- ``judge_calls`` (``calibrl_judge_calls_total``): judge Score calls, by rubric
- ``judge_batch_size`` (``calibrl_judge_batch_size``): items per computed judge batch (callers joined), by rubric
- ``judge_batch_mix`` (``calibrl_judge_batch_mix_total``): computed judge batches, by rubric, by how many Score
  calls they joined (calls: one|several) and whether a call of another rubric was waiting meanwhile
  (other_rubric: waiting|none); batches never mix rubrics
- ``judge_rubric_versions`` (``calibrl_judge_rubric_versions_total``): rubric version changes, by rubric and
  action (loaded, refused, removed, retired); see calibrl.judge_server.rubric_store
- ``tenant_requests`` (``calibrl_tenant_requests_total``): authenticated calls, by tenant and method
- ``refusals`` (``calibrl_tenant_refusals_total``): calls refused before any work, by tenant and
  reason (unauthenticated, request_size, rate_limit, queue_full)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from calibrl.config import option
from calibrl.errors import ConfigError


@dataclass
class TelemetryConfig:
    enabled: bool = option(False, "Record OpenTelemetry spans and metrics.")
    otlp_endpoint: str = option("", "OTLP/gRPC collector endpoint, e.g. http://otel-collector:4317; empty: no export.")
    service_name: str = option("", "service.name resource attribute; empty: the component's own name.")
    export_interval_s: float = option(10.0, "How often metrics are exported, in seconds.")
    prometheus_port: int = option(0, "Serve the metrics at http://prometheus_host:PORT/metrics for scraping; 0: off.")
    prometheus_host: str = option("127.0.0.1", "Address of the /metrics listener; 0.0.0.0 to let Prometheus reach it.")

    def validate(self) -> None:
        if self.export_interval_s <= 0:
            raise ConfigError(f"serving.telemetry.export_interval_s={self.export_interval_s}: must be > 0")
        if self.otlp_endpoint and not self.enabled:
            raise ConfigError("serving.telemetry.otlp_endpoint is set but serving.telemetry.enabled=false: "
                              "set serving.telemetry.enabled=true")
        if not 0 <= self.prometheus_port <= 65535:
            raise ConfigError(f"serving.telemetry.prometheus_port={self.prometheus_port}: must be in 1..65535 (0: off)")
        if self.prometheus_port and not self.enabled:
            raise ConfigError("serving.telemetry.prometheus_port is set but serving.telemetry.enabled=false: "
                              "set serving.telemetry.enabled=true")
        if self.prometheus_port and not self.prometheus_host.strip():
            raise ConfigError("serving.telemetry.prometheus_host is empty: give an address, e.g. 0.0.0.0")


# Latency buckets in seconds (the SDK default, 0..10000, suits milliseconds) and
# batch-size buckets in items; both reach past the servers' default limits.
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class _State:
    tracer_provider: Any = None
    meter_provider: Any = None
    instruments: dict[str, Any] = {}
    prometheus_server: Any = None
    prometheus_port: int = 0


_state = _State()


def configure(
    config: TelemetryConfig,
    default_service_name: str,
    *,
    span_exporter: Any = None,
    metric_reader: Any = None,
) -> bool:
    """Set up providers per ``config``; returns whether telemetry is on.

    ``span_exporter`` / ``metric_reader`` replace the OTLP ones (tests pass the
    in-memory exporter and reader)."""
    shutdown()
    if not config.enabled:
        return False
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    resource = Resource.create({"service.name": config.service_name or default_service_name})
    tracer_provider = TracerProvider(resource=resource)
    readers = []
    if span_exporter is not None:
        tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    if metric_reader is not None:
        readers.append(metric_reader)
    if config.otlp_endpoint:
        readers.append(_add_otlp_exporters(config, tracer_provider))
    if config.prometheus_port:
        readers.append(_start_prometheus(config))
    _state.tracer_provider = tracer_provider
    _state.meter_provider = MeterProvider(resource=resource, metric_readers=readers, views=_views())
    _state.instruments = _instruments(_state.meter_provider.get_meter("calibrl"))
    return True


def _add_otlp_exporters(config: TelemetryConfig, tracer_provider: Any) -> Any:
    """Send spans to ``config.otlp_endpoint`` (added to ``tracer_provider``); returns the metric reader
    that exports there every ``export_interval_s``."""
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "telemetry.otlp_endpoint needs the OTLP exporter: pip install 'calibrl[otlp]'"
        ) from None
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint)))
    return PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=config.otlp_endpoint),
        export_interval_millis=config.export_interval_s * 1000,
    )


def _instruments(meter: Any) -> dict[str, Any]:
    """Every instrument calibrl records, by the key the recording functions use."""
    instruments = {
        "rpc_duration": meter.create_histogram(
            "calibrl.rpc.server.duration", unit="s", description="Server-side latency of each RPC"
        ),
        "client_duration": meter.create_histogram(
            "calibrl.rpc.client.duration", unit="s", description="Client-side latency of each RPC, retries included"
        ),
        "batch_size": meter.create_histogram(
            "calibrl.batch.size", unit="{item}", description="Items per server-side batch"
        ),
        "cache": meter.create_counter("calibrl.cache.lookups",
                                      description="Judge cache lookups by result (hit|miss) and rubric"),
        "judge_calls": meter.create_counter("calibrl.judge.calls", description="Judge Score calls by rubric"),
        "judge_batch_size": meter.create_histogram(
            "calibrl.judge.batch.size", unit="{item}",
            description="Items per computed judge batch (concurrent callers joined), by rubric"
        ),
        "judge_batch_mix": meter.create_counter(
            "calibrl.judge.batch.mix",
            description="Computed judge batches by rubric, Score calls joined (one|several) and whether a call "
            "of another rubric was waiting (waiting|none)"
        ),
        "judge_rubric_versions": meter.create_counter(
            "calibrl.judge.rubric.versions",
            description="Rubric version changes by rubric and action (loaded|refused|removed|retired)"
        ),
        "tenant_requests": meter.create_counter(
            "calibrl.tenant.requests", description="Authenticated calls by tenant and method"
        ),
        "refusals": meter.create_counter(
            "calibrl.tenant.refusals",
            description="Calls refused, by tenant and reason: before any work (unauthenticated, request_size, "
            "rate_limit, queue_full, tenant_queue_full, deadline), or after admission when the server slowed and "
            "they could no longer meet their deadline (slowed)",
        ),
        "queue_time": meter.create_histogram(
            "calibrl.tenant.queue.time", unit="s",
            description="Seconds from a call's admission to its first unit of work, by tenant and batcher"
        ),
        "cost_admitted": meter.create_counter(
            "calibrl.tenant.cost.admitted", unit="s",
            description="Estimated server seconds of the calls admitted to the queue, by tenant and batcher"
        ),
        "cost_refused": meter.create_counter(
            "calibrl.tenant.cost.refused", unit="s",
            description="Estimated server seconds of the calls refused (over budget or shed), by tenant and reason"
        ),
        "cancelled_items": meter.create_counter(
            "calibrl.tenant.cancelled.items", unit="{item}",
            description="Queued items dropped before they ran because the caller cancelled or ran out of time"
        ),
        "deadline_missed": meter.create_counter(
            "calibrl.tenant.deadline.missed",
            description="Admitted calls that ran out of time on the server, by tenant and where "
                        "(queued: expired before their last unit started; late: finished after their deadline; "
                        "cancelled: cancelled by their deadline while they waited or ran)"
        ),
        "loop_lag": meter.create_histogram(
            "calibrl.server.loop.lag", unit="s",
            description="How late the server's event loop ran a timer due every 10 ms: the time a ready call "
                        "waits for the loop (its other ready work, a pause of the whole process)"
        ),
        "client_retries": meter.create_counter(
            "calibrl.client.retries",
            description="Client attempts retried (by service, method and status code; SHED: pushed back by the server)"
        ),
    }
    meter.create_observable_counter(
        "calibrl.embedding.cache.lookups", callbacks=[_embedding_cache_lookups],
        description="Text -> vector cache lookups of each loaded encoder since the process started, by cache "
                    "(encoder, backend, device) and result (hit|miss)")
    meter.create_observable_gauge(
        "calibrl.embedding.cache.entries", callbacks=[_embedding_cache_entries],
        description="Vectors held in each encoder's text -> vector cache, by cache (capacity: its capacity)")
    return instruments


def _embedding_cache_lookups(_options: Any) -> list[Any]:
    from opentelemetry.metrics import Observation

    from calibrl.embedding_cache import embedding_cache_stats

    return [Observation(count, {"cache": stats.name, "result": result})
            for stats in embedding_cache_stats() for result, count in (("hit", stats.hits), ("miss", stats.misses))]


def _embedding_cache_entries(_options: Any) -> list[Any]:
    from opentelemetry.metrics import Observation

    from calibrl.embedding_cache import embedding_cache_stats

    return [Observation(stats.size, {"cache": stats.name, "capacity": stats.capacity})
            for stats in embedding_cache_stats()]


def _views() -> list[Any]:
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    return [
        View(instrument_name="calibrl.rpc.*", aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS_S)),
        View(instrument_name="calibrl.tenant.queue.time",
             aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS_S)),
        View(instrument_name="calibrl.server.loop.lag",
             aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS_S)),
        View(instrument_name="calibrl.batch.size", aggregation=ExplicitBucketHistogramAggregation(_BATCH_BUCKETS)),
        View(instrument_name="calibrl.judge.batch.size",
             aggregation=ExplicitBucketHistogramAggregation(_BATCH_BUCKETS)),
    ]


def _start_prometheus(config: TelemetryConfig) -> Any:
    """The Prometheus metric reader, on its own registry, and its HTTP listener."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ConfigError(
            "telemetry.prometheus_port needs the Prometheus exporter: pip install 'calibrl[prometheus]'"
        ) from None
    # A registry of our own, not prometheus_client's global one: a reconfigure (tests,
    # two servers in one process) must not register the collector twice.
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(registry=registry)
    try:
        server, _thread = start_http_server(config.prometheus_port, addr=config.prometheus_host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"serving.telemetry.prometheus_port={config.prometheus_port}: cannot listen on "
            f"{config.prometheus_host}:{config.prometheus_port} ({exc.strerror or exc})"
        ) from None
    _state.prometheus_server = server
    _state.prometheus_port = server.server_port
    return reader


def prometheus_port() -> int:
    """The port the /metrics listener is bound to (0 when there is none)."""
    return _state.prometheus_port


def shutdown() -> None:
    """Flush and drop the providers (safe to call when telemetry is off)."""
    if _state.tracer_provider is not None:
        _state.tracer_provider.shutdown()
    if _state.meter_provider is not None:
        _state.meter_provider.shutdown()
    if _state.prometheus_server is not None:
        _state.prometheus_server.shutdown()
        _state.prometheus_server.server_close()
    _state.prometheus_server = None
    _state.prometheus_port = 0
    _state.tracer_provider = None
    _state.meter_provider = None
    _state.instruments = {}


def enabled() -> bool:
    return _state.tracer_provider is not None


def tracer() -> Any:
    """The calibrl tracer (a no-op tracer when telemetry is off)."""
    from opentelemetry import trace

    if _state.tracer_provider is None:
        return trace.NoOpTracer()
    return _state.tracer_provider.get_tracer("calibrl")


def record(instrument: str, value: float, **attributes: Any) -> None:
    """Record into a named instrument; nothing happens when telemetry is off."""
    inst = _state.instruments.get(instrument)
    if inst is None:
        return
    if hasattr(inst, "record"):
        inst.record(value, attributes)
    else:
        inst.add(value, attributes)


def observe_gauge(name: str, callback: Callable[[], float], description: str = "", **attributes: Any) -> None:
    """Register an observable gauge (e.g. queue depth) read at each export."""
    if _state.meter_provider is None:
        return
    from opentelemetry.metrics import Observation

    meter = _state.meter_provider.get_meter("calibrl")
    meter.create_observable_gauge(
        name, callbacks=[lambda _options: [Observation(callback(), attributes)]], description=description
    )


def inject_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """Call metadata plus the W3C trace context of the current span (for clients)."""
    result = list(metadata)
    if _state.tracer_provider is None:
        return result
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    result.extend(carrier.items())
    return result


def _server_interceptor_base() -> type:
    import grpc

    return grpc.aio.ServerInterceptor


def _status_name(code: Any, failed: bool = False) -> str:
    """A call's status code name from ``context.code()`` (None: OK, or UNKNOWN for a call
    that raised without setting one)."""
    if code is None:
        return "UNKNOWN" if failed else "OK"
    return code.name


class TracingInterceptor(_server_interceptor_base()):  # type: ignore[misc]
    """Server span per call, parented on the caller's trace context, plus a latency
    histogram labelled by method and status code."""

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        import grpc

        handler = await continuation(handler_call_details)
        if handler is None or _state.tracer_provider is None:
            return handler
        # unary_unary: the services' calls; stream_unary: security's refusals, answered before the
        # body is read (they count in the latency histogram with their status code like any call).
        inner = handler.unary_unary or handler.stream_unary
        if inner is None:
            return handler
        method = handler_call_details.method
        if method.startswith("/grpc."):
            return handler
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}

        async def traced(request: Any, context: Any) -> Any:
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            parent = TraceContextTextMapPropagator().extract(carrier)
            start = time.perf_counter()
            code = "OK"
            # No traceback on the span: a refusal is a status, not a fault (the servicers log
            # unexpected errors themselves), and formatting one per shed call under overload
            # took a good share of the event loop's time.
            with tracer().start_as_current_span(method, context=parent, kind=SpanKind.SERVER,
                                                record_exception=False, set_status_on_exception=False) as span:
                span.set_attribute("rpc.system", "grpc")
                span.set_attribute("rpc.method", method)
                try:
                    response = await inner(request, context)
                    code = _status_name(context.code())  # a status set without raising (serving.rpc_errors)
                    return response
                except BaseException:
                    code = _status_name(context.code(), failed=True)
                    raise
                finally:
                    if code != "OK":
                        span.set_status(Status(StatusCode.ERROR, code))
                    span.set_attribute("rpc.grpc.status_code", code)
                    record("rpc_duration", time.perf_counter() - start, method=method, code=code)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
