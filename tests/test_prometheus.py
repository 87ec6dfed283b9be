"""Prometheus /metrics of a real judge server on loopback: calls are made over gRPC,
the page is scraped over HTTP and read with prometheus_client's own text parser."""

from __future__ import annotations

import hashlib
import socket
import urllib.request

import grpc
import pytest

from calibrl import telemetry
from calibrl.config import load_config
from calibrl.errors import ConfigError
from calibrl.telemetry import TelemetryConfig
from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeServerConfig
from calibrl.judge_server.server import start
from calibrl.api.judge import JudgeItem
from tests.test_judge_server import make_rubrics, server_config

pytest.importorskip("opentelemetry.exporter.prometheus", reason="the prometheus extra: pip install 'calibrl[prometheus]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"
SCORE = "/calibrl.v1.JudgeService/Score"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the page, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode("utf-8")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def _items(*outputs: str):
    return [wire.item_to_proto(JudgeItem.make("VTSAX expense ratio", o)) for o in outputs]


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "tenants:\n"
        f"  - name: team-a\n    key_sha256: {hashlib.sha256(KEY_A.encode()).hexdigest()}\n"
        f"  - name: team-b\n    key_sha256: {hashlib.sha256(KEY_B.encode()).hexdigest()}\n"
        "    rate_per_second: 0.001\n    burst: 1\n"
    )
    return path


async def test_metrics_page_counts_calls_latency_batches_cache_tenants_and_refusals(tmp_path, keys_file):
    rubrics = make_rubrics(tmp_path / "rubrics")
    with (rubrics / "rewriter.yaml").open("a") as rubric:
        rubric.write('tenants: ["*"]\n')  # every tenant may use it (tenants are not part of the rubric hash)
    config = server_config(rubrics)
    config.max_queue_items = 1  # a call with two new items is refused as queue_full
    config.serving.api_keys_file = str(keys_file)
    config.serving.telemetry = TelemetryConfig(enabled=True, prometheus_port=_free_port())
    running = await start(config)
    try:
        port = telemetry.prometheus_port()
        assert port == config.serving.telemetry.prometheus_port
        before = _scrape(port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            team_a = [("authorization", f"Bearer {KEY_A}")]
            request = pb.ScoreRequest(rubric_id="rewriter", items=_items("What is the VTSAX expense ratio?"))
            await stub.Score(request, metadata=team_a)  # cache miss, one batch of one item
            await stub.Score(request, metadata=team_a)  # cache hit, no batch
            await stub.Score(request, metadata=[("authorization", f"Bearer {KEY_B}")])  # team-b's one token
            refused = []
            for metadata, items in (
                ([("authorization", f"Bearer {KEY_B}")], request.items),  # over team-b's rate
                ([], request.items),  # no key
                (team_a, _items("VTSAX fund fees", "VTSAX expense ratio 2026")),  # two new items, queue of one
            ):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Score(pb.ScoreRequest(rubric_id="rewriter", items=items), metadata=metadata)
                refused.append(error.value.code())
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
                               grpc.StatusCode.RESOURCE_EXHAUSTED]
        after = _scrape(port)
    finally:
        await running.stop(0)
        telemetry.shutdown()

    def moved(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    latency = "calibrl_rpc_server_duration_seconds"
    assert moved(f"{latency}_count", method=SCORE, code="OK") == 3
    assert moved(f"{latency}_count", method=SCORE, code="RESOURCE_EXHAUSTED") == 2
    assert moved(f"{latency}_count", method=SCORE, code="UNAUTHENTICATED") == 1
    assert moved(f"{latency}_sum", method=SCORE) > 0
    # a histogram's buckets are cumulative: the +Inf bucket holds every call of its series
    assert moved(f"{latency}_bucket", method=SCORE, code="OK", le="+Inf") == 3
    assert moved("calibrl_batch_size_count") == 1 and moved("calibrl_batch_size_sum") == 1
    assert moved("calibrl_cache_lookups_total", result="miss") == 3  # first call + the two refused new items
    assert moved("calibrl_cache_lookups_total", result="hit") == 2
    assert moved("calibrl_tenant_requests_total", tenant="team-a", method=SCORE) == 3
    assert moved("calibrl_tenant_requests_total", tenant="team-b", method=SCORE) == 2
    assert moved("calibrl_tenant_refusals_total", tenant="team-b", reason="rate_limit") == 1
    assert moved("calibrl_tenant_refusals_total", tenant="unknown", reason="unauthenticated") == 1
    assert moved("calibrl_tenant_refusals_total", tenant="team-a", reason="queue_full") == 1
    depth = [v for (n, ls), v in after.items() if n == "calibrl_queue_depth" and ("batcher", "judge") in ls]
    assert depth == [0.0]  # the gauge, read at scrape time: nothing waits once the calls have returned


async def test_the_loop_lag_histogram_records_a_pause_of_the_event_loop(tmp_path):
    import asyncio
    import time

    config = server_config(make_rubrics(tmp_path / "rubrics"))
    config.serving.telemetry = TelemetryConfig(enabled=True, prometheus_port=_free_port())
    running = await start(config)
    try:
        await asyncio.sleep(0.3)  # the 10 ms timer fires about 30 times
        before = _scrape(telemetry.prometheus_port())
        time.sleep(0.3)  # the loop is held: the timer due meanwhile runs about 0.3 s late
        await asyncio.sleep(0.05)
        after = _scrape(telemetry.prometheus_port())
    finally:
        await running.stop(0)
        telemetry.shutdown()
    lag = "calibrl_server_loop_lag_seconds"
    assert _value(before, f"{lag}_count") >= 5
    late = [_value(page, f"{lag}_bucket", le="+Inf") - _value(page, f"{lag}_bucket", le="0.25") for page in (before, after)]
    assert late[0] == 0 and late[1] == 1  # one timer ran more than 0.25 s late: the pause, and nothing else
    assert _value(after, f"{lag}_sum") - _value(before, f"{lag}_sum") >= 0.29


async def test_the_listener_closes_with_telemetry_and_a_taken_port_is_a_clear_error():
    port = _free_port()
    telemetry.configure(TelemetryConfig(enabled=True, prometheus_port=port), "test")
    try:
        assert telemetry.prometheus_port() == port
        with pytest.raises(ConfigError, match=rf"telemetry.prometheus_port={port}: cannot listen on 127.0.0.1:{port}"):
            telemetry._start_prometheus(TelemetryConfig(enabled=True, prometheus_port=port))
    finally:
        telemetry.shutdown()
    assert telemetry.prometheus_port() == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # the port is free again: a reconfigured process serves on it anew
    telemetry.configure(TelemetryConfig(enabled=True, prometheus_port=port), "test")
    try:
        assert telemetry.prometheus_port() == port
        assert "python_info" not in {name for name, _ in _scrape(port)}, "the global registry leaked in"
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["serving.telemetry.prometheus_port=9464"], "serving.telemetry.prometheus_port is set but serving.telemetry.enabled=false"),
        (["serving.telemetry.enabled=true", "serving.telemetry.prometheus_port=70000"],
         r"prometheus_port=70000: must be in 1..65535"),
        (["serving.telemetry.enabled=true", "serving.telemetry.prometheus_port=9464",
          "serving.telemetry.prometheus_host="], "prometheus_host is empty"),
    ],
)
def test_bad_prometheus_settings_are_refused_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(JudgeServerConfig, None, [f"rubrics={tmp_path}", *overrides])
