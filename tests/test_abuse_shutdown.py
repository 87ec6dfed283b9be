"""SIGTERM on a real `calibrl serve retrieval` process: health says NOT_SERVING while the
server keeps answering for serving.drain_seconds, then it stops with the grace period and
exits within drain + grace + 1 s even with a heavy cancelled call's work pending."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.testing import build_test_index

DRAIN_S, GRACE_S = 2.0, 1.0


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("abuse-shutdown") / "index")


def _start(index) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "retrieval", "--index", str(index), "--port", "0", "device=cpu",
         "torch_threads=1", f"serving.drain_seconds={DRAIN_S}", f"serving.grace_seconds={GRACE_S}",
         "batch_max_items=16", "batch_max_wait_ms=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = process.stdout.readline()
    assert "listening on" in line, line
    return process, f"127.0.0.1:{line.strip().rsplit(':', 1)[1]}"


def _status(channel) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.slow
def test_sigterm_drains_while_not_serving_then_exits_in_time(tiny_index):
    process, address = _start(tiny_index)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.RetrievalServiceStub(channel)
            assert _status(channel) == "SERVING"
            # a heavy dense call (256 long queries through the embedder, 16 per batch), given up by its caller
            heavy = stub.Search.future(pb.SearchRequest(
                queries=[f"tower {i} " + "lattice iron " * 10 for i in range(256)], top_k=100,
                mode=pb.SEARCH_MODE_DENSE), timeout=60)
            time.sleep(0.5)
            heavy.cancel()
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            seen_not_serving = served_while_draining = False
            while time.monotonic() - signalled < DRAIN_S - 0.5:
                if _status(channel) == "NOT_SERVING":
                    seen_not_serving = True
                    reply = stub.Search(pb.SearchRequest(queries=["Mozart"], top_k=1, mode=pb.SEARCH_MODE_BM25),
                                        timeout=5)
                    served_while_draining = reply.results[0].hits[0].doc_id == "mozart"
                    break
                time.sleep(0.05)
            assert seen_not_serving, "health never said NOT_SERVING during the drain"
            assert served_while_draining, "a call during the drain was not answered"
        code = process.wait(timeout=60)
        elapsed = time.monotonic() - signalled
        assert code == 0
        assert elapsed < DRAIN_S + GRACE_S + 1.0, f"exited {elapsed:.1f}s after SIGTERM"
        assert elapsed >= DRAIN_S - 0.1  # it did keep serving for the drain delay
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_second_signal_cuts_the_drain_short(tiny_index):
    process, _ = _start(tiny_index)
    try:
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert time.monotonic() - signalled < DRAIN_S
        assert "drain delay cut short" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


RUBRIC = ("id: shutdown\nversion: '1'\ncriteria:\n"
          "  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.5}\n"
          "  - {name: invented, kind: programmatic, scorer: invented_entities, weight: 0.5, penalty: true}\n")


@pytest.mark.slow
def test_the_judge_exits_in_time_with_calls_that_outlive_the_grace(tmp_path):
    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import judge_pb2_grpc

    (tmp_path / "shutdown.yaml").write_text(RUBRIC)
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "judge", "--rubrics", str(tmp_path), "--port", "0",
         "--allow-unvalidated", "judge.embedder=hashed-ngrams", "judge.cache_size=0",
         "serving.max_tenant_queue_cost_s=1000",  # the burst below is one tenant's: queue it, never shed it
         f"serving.drain_seconds={DRAIN_S}", f"serving.grace_seconds={GRACE_S}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line + process.stderr.read()
        address = f"127.0.0.1:{line.strip().rsplit(':', 1)[1]}"
        with grpc.insecure_channel(address) as channel:
            assert _status(channel) == "SERVING"  # printed after the probe item was scored
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            text = ("Vanguard VTSAX Admiral 2024 ETF " * 300)[:8000]
            # 60 calls, each near the 1 s cost budget: far more queued work than drain + grace, even on
            # a fast CPU (12 such calls once finished within the grace)
            calls = [stub.Score.future(jpb.ScoreRequest(rubric_id="shutdown", items=[
                jpb.JudgeItem(query=f"{c} {i} {text}"[:8000], output=f"{i} {c} {text}"[:8000]) for i in range(40)]),
                timeout=3600) for c in range(60)]  # deadlines they all meet: none is shed to protect another
            time.sleep(0.5)
            assert not all(call.done() for call in calls), "the work did not outlive the signal"
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
            elapsed = time.monotonic() - signalled
            codes = []
            for call in calls:
                try:
                    call.result()
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
        assert code == 0
        assert elapsed < DRAIN_S + GRACE_S + 1.0, f"exited {elapsed:.1f}s after SIGTERM"
        assert "OK" in codes or elapsed >= DRAIN_S - 0.1
        assert set(codes) - {"OK"} <= {"UNAVAILABLE", "CANCELLED"}, codes  # cut off, never a wrong score
        assert codes.count("OK") < len(codes), "every call finished: the test did not outlive the grace"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# A server process whose shutdown hangs after the grace (an on_stop hook that never returns):
# the exit watchdog still ends it, with code 0 and a log line; without it the process stays.
HANGING_SERVER = """
import asyncio, sys, time
from calibrl.serving import ServingConfig, serve_until_signal, start_server, stop_on_signals

async def main(watchdog):
    stop_requested = stop_on_signals()
    async def hang():
        time.sleep(60)  # blocks the loop itself, as a stuck native call would
    running = await start_server(ServingConfig(port=0, drain_seconds=0.5, grace_seconds=0.5),
                                 lambda server: None, [], on_stop=[hang])
    print("listening on", running.port, flush=True)
    await serve_until_signal(running, stop_requested=stop_requested, exit_watchdog=watchdog)

asyncio.run(main(sys.argv[1] == "on"))
"""


@pytest.mark.parametrize("watchdog", ["on", "off"])
def test_a_shutdown_that_hangs_past_the_grace_is_ended_by_the_watchdog(watchdog):
    from calibrl.serving import EXIT_WATCHDOG_MARGIN_S

    process = subprocess.Popen([sys.executable, "-c", HANGING_SERVER, watchdog],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line + process.stderr.read()
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - signalled
        if watchdog == "on":
            assert code == 0
            assert 0.5 + 0.5 + EXIT_WATCHDOG_MARGIN_S - 0.05 <= elapsed < 0.5 + 0.5 + 1.0, elapsed
            assert "shutdown still running" in process.stderr.read()
        else:
            assert code is None, "the hook's hang should have held a process without a watchdog open"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
