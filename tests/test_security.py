"""TLS, mutual TLS, API keys, per-tenant limits and telemetry, on a real retrieval
server on loopback."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from calibrl import telemetry
from calibrl.config import ConfigError
from calibrl.security import channel_credentials, load_tenants
from calibrl.telemetry import TelemetryConfig
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import build_test_index, start_test_server
from tests.tls_helpers import make_pki

KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("security") / "index")


@pytest.fixture(scope="module")
def retriever(tiny_index):
    return Retriever.load(tiny_index, device="cpu")


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "tenants:\n"
        f"  - name: team-a\n    key_sha256: {_digest(KEY_A)}\n"
        f"  - name: team-b\n    key_sha256: {_digest(KEY_B)}\n    max_request_bytes: 200\n"
        "    rate_per_second: 1\n    burst: 2\n"
    )
    return path


async def _search(channel, metadata=(), query="iron tower in Paris"):
    stub = pb_grpc.RetrievalServiceStub(channel)
    return await stub.Search(pb.SearchRequest(queries=[query], top_k=2), metadata=metadata, timeout=30)


async def test_api_keys_tenant_limits_and_open_health(tiny_index, retriever, keys_file):
    running = await start_test_server(tiny_index, f"serving.api_keys_file={keys_file}", retriever=retriever)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await _search(channel)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer" in missing.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await _search(channel, [("authorization", "Bearer not-a-key")])
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "not-a-key" not in wrong.value.details()
            reply = await _search(channel, [("authorization", f"Bearer {KEY_A}")])
            assert reply.results[0].hits[0].doc_id == "eiffel"
            reply = await _search(channel, [("x-api-key", KEY_A)])
            assert len(reply.results[0].hits) == 2
            # team-b: requests above 200 bytes are refused, naming the limit
            with pytest.raises(grpc.aio.AioRpcError) as too_big:
                await _search(channel, [("x-api-key", KEY_B)], query="paris " * 60)
            assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "200 bytes" in too_big.value.details()
            # team-b: burst of 2 at 1/s; the oversize call above took one token (the rate is checked
            # from the metadata, before the body is read), so the second call in a row is refused
            codes = []
            for _ in range(4):
                try:
                    await _search(channel, [("x-api-key", KEY_B)])
                    codes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code().name)
            assert codes[0] == "OK" and "RESOURCE_EXHAUSTED" in codes[1:]
            # health checking needs no key (probes)
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service="calibrl.v1.RetrievalService"))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop(grace=1.0)


def test_keys_file_errors_name_the_entry(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  - name: a\n    key_sha256: abc\n")
    with pytest.raises(ConfigError, match=r"tenants\[0\].key_sha256: expected 64 hex"):
        load_tenants(path)
    path.write_text(f"tenants:\n  - name: a\n    key_sha256: {_digest('x')}\n    rate_per_second: 0\n")
    with pytest.raises(ConfigError, match=r"rate_per_second=0: must be > 0"):
        load_tenants(path)


async def test_tls_and_mutual_tls(tiny_index, retriever, tmp_path):
    pki = make_pki(tmp_path)
    running = await start_test_server(
        tiny_index, f"serving.tls_cert_file={pki['server.crt']}", f"serving.tls_key_file={pki['server.key']}",
        retriever=retriever,
    )
    try:
        target = f"localhost:{running.port}"
        async with grpc.aio.secure_channel(target, channel_credentials(pki["ca.crt"])) as channel:
            assert (await _search(channel)).results[0].hits[0].doc_id == "eiffel"
        async with grpc.aio.insecure_channel(target) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _search(plaintext)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(grace=1.0)

    running = await start_test_server(
        tiny_index, f"serving.tls_cert_file={pki['server.crt']}", f"serving.tls_key_file={pki['server.key']}",
        f"serving.tls_client_ca_file={pki['ca.crt']}", retriever=retriever,
    )
    try:
        target = f"localhost:{running.port}"
        mutual = channel_credentials(pki["ca.crt"], pki["client.crt"], pki["client.key"])
        async with grpc.aio.secure_channel(target, mutual) as channel:
            assert (await _search(channel)).results[0].hits[0].doc_id == "eiffel"
        async with grpc.aio.secure_channel(target, channel_credentials(pki["ca.crt"])) as no_client_cert:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _search(no_client_cert)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(grace=1.0)


async def test_spans_follow_the_callers_trace_and_metrics_are_recorded(tiny_index, retriever):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans, metrics = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry.configure(TelemetryConfig(enabled=True), "test", span_exporter=spans, metric_reader=metrics)
    try:
        running = await start_test_server(tiny_index, retriever=retriever)
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                with telemetry.tracer().start_as_current_span("train-step") as parent:
                    await _search(channel, telemetry.inject_metadata())
                    trace_id = parent.get_span_context().trace_id
                stub = pb_grpc.RetrievalServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Search(pb.SearchRequest(queries=[""], top_k=2))
        finally:
            await running.stop(grace=1.0)
        finished = spans.get_finished_spans()
        server_spans = [s for s in finished if s.name == "/calibrl.v1.RetrievalService/Search"]
        assert len(server_spans) == 2
        assert server_spans[0].context.trace_id == trace_id, "server span not parented on the caller's trace"
        assert server_spans[1].attributes["rpc.grpc.status_code"] == "INVALID_ARGUMENT"
        # a refusal is a status on the span, not a fault: no traceback event is formatted for it
        assert server_spans[1].status.status_code.name == "ERROR"
        assert server_spans[1].status.description == "INVALID_ARGUMENT"
        assert not server_spans[1].events
        assert server_spans[0].status.status_code.name == "UNSET"
        names = {
            m.name
            for rm in metrics.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }
        assert {"calibrl.rpc.server.duration", "calibrl.batch.size", "calibrl.queue.depth"} <= names
    finally:
        telemetry.shutdown()
