"""OpenTelemetry for both services and the trainer: spans with context propagated
through gRPC metadata (W3C traceparent), and metrics (latency histograms, batch
sizes, queue depth, cache hit ratio).

Off by default. ``TelemetryConfig(enabled=True)`` turns it on; with
``otlp_endpoint`` set, spans and metrics are exported over OTLP/gRPC (the
``otlp`` extra); otherwise they stay in-process (useful with the in-memory
exporters in tests). Providers are owned by this module, not installed as the
OpenTelemetry globals, so tests can reconfigure them.
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

    def validate(self) -> None:
        if self.export_interval_s <= 0:
            raise ConfigError(f"telemetry.export_interval_s={self.export_interval_s}: must be > 0")
        if self.otlp_endpoint and not self.enabled:
            raise ConfigError("telemetry.otlp_endpoint is set but telemetry.enabled=false: set enabled=true")


class _State:
    tracer_provider: Any = None
    meter_provider: Any = None
    instruments: dict[str, Any] = {}


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
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": config.service_name or default_service_name})
    tracer_provider = TracerProvider(resource=resource)
    readers = []
    if span_exporter is not None:
        tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    if metric_reader is not None:
        readers.append(metric_reader)
    if config.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                "telemetry.otlp_endpoint needs the OTLP exporter: pip install 'calibrl[otlp]'"
            ) from None
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint)))
        readers.append(
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=config.otlp_endpoint),
                export_interval_millis=config.export_interval_s * 1000,
            )
        )
    _state.tracer_provider = tracer_provider
    _state.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    meter = _state.meter_provider.get_meter("calibrl")
    _state.instruments = {
        "rpc_duration": meter.create_histogram(
            "calibrl.rpc.server.duration", unit="s", description="Server-side latency of each RPC"
        ),
        "client_duration": meter.create_histogram(
            "calibrl.rpc.client.duration", unit="s", description="Client-side latency of each RPC, retries included"
        ),
        "batch_size": meter.create_histogram(
            "calibrl.batch.size", unit="{item}", description="Items per server-side batch"
        ),
        "cache": meter.create_counter("calibrl.cache.lookups", description="Judge cache lookups by result (hit|miss)"),
    }
    return True


def shutdown() -> None:
    """Flush and drop the providers (safe to call when telemetry is off)."""
    if _state.tracer_provider is not None:
        _state.tracer_provider.shutdown()
    if _state.meter_provider is not None:
        _state.meter_provider.shutdown()
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


class TracingInterceptor(_server_interceptor_base()):  # type: ignore[misc]
    """Server span per call, parented on the caller's trace context, plus a latency
    histogram labelled by method and status code."""

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        import grpc

        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or _state.tracer_provider is None:
            return handler
        method = handler_call_details.method
        if method.startswith("/grpc."):
            return handler
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        inner = handler.unary_unary

        async def traced(request: Any, context: Any) -> Any:
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            parent = TraceContextTextMapPropagator().extract(carrier)
            start = time.perf_counter()
            code = "OK"
            with tracer().start_as_current_span(method, context=parent, kind=SpanKind.SERVER) as span:
                span.set_attribute("rpc.system", "grpc")
                span.set_attribute("rpc.method", method)
                try:
                    return await inner(request, context)
                except BaseException:
                    code = context.code().name if context.code() is not None else "UNKNOWN"
                    span.set_status(Status(StatusCode.ERROR, code))
                    raise
                finally:
                    span.set_attribute("rpc.grpc.status_code", code)
                    record("rpc_duration", time.perf_counter() - start, method=method, code=code)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
