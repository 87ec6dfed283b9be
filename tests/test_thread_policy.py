"""The thread policy a server sets at start (calibrl.threads): the user's OpenMP wait
policy wins, torch's thread count is set and reported, bad values are refused at load."""

from __future__ import annotations

import os
import pathlib

import pytest

from calibrl.errors import ConfigError
from calibrl.threads import apply_thread_policy, passive_openmp


def test_passive_openmp_is_a_default_the_user_overrides(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive_openmp()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_policy_sets_and_reports_torch_threads(monkeypatch, caplog):
    import logging

    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    try:
        with caplog.at_level(logging.INFO, logger="calibrl.threads"):
            policy = apply_thread_policy(2, "judge server")
        assert torch.get_num_threads() == 2
        assert policy == {"torch_threads": "2", "omp_wait_policy": "PASSIVE"}
        assert "judge server thread policy: 2 torch thread(s)" in caplog.text
        assert apply_thread_policy(0, "judge server")["torch_threads"] == "2"  # 0 keeps what is set
    finally:
        torch.set_num_threads(before)


def test_judge_server_config_refuses_negative_threads_and_cache():
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeServerConfig

    with pytest.raises(ConfigError, match="torch_threads=-1"):
        load_config(JudgeServerConfig, None, ["rubrics=x", "torch_threads=-1"])
    with pytest.raises(ConfigError, match="judge.embedder_cache_size=-2"):
        load_config(JudgeServerConfig, None, ["rubrics=x", "judge.embedder_cache_size=-2"])
    config = load_config(JudgeServerConfig, None, ["rubrics=x", "torch_threads=3"])
    assert config.torch_threads == 3 and config.judge.embedder_backend == "auto"


def test_retrieval_config_refuses_a_negative_cache():
    from calibrl.config import load_config
    from calibrl.retrieval_server.config import RetrievalServerConfig

    with pytest.raises(ConfigError, match="embedding_cache_size=-1"):
        load_config(RetrievalServerConfig, None, ["index_dir=x", "embedding_cache_size=-1"])


def test_a_server_lowers_the_gil_switch_interval_and_never_raises_it():
    import sys

    from calibrl.threads import SERVER_SWITCH_INTERVAL_S, responsive_gil

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert responsive_gil() == pytest.approx(SERVER_SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0005)
        assert responsive_gil() == pytest.approx(0.0005)  # a lower value the user chose stays
    finally:
        sys.setswitchinterval(before)


def _niceness() -> int:
    import os
    import threading

    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_thread_made_nicer_leaves_the_others_and_stops_at_19():
    import threading

    from calibrl.threads import MAX_NICE, lower_thread_priority

    base = _niceness()
    seen: dict[str, int | None] = {}

    def run(name: str, nice: int) -> None:
        seen[name] = lower_thread_priority(nice, name)
        seen[name + " read"] = _niceness()

    for name, nice in (("three", 3), ("many", 40), ("none", 0)):
        thread = threading.Thread(target=run, args=(name, nice))
        thread.start()
        thread.join()
    assert seen["three"] == seen["three read"] == min(MAX_NICE, base + 3)
    assert seen["many"] == seen["many read"] == MAX_NICE
    assert seen["none"] == seen["none read"] == base
    assert _niceness() == base  # the calling thread is untouched


async def test_the_batcher_workers_run_nicer_than_the_event_loop():
    import asyncio

    from calibrl.batching import MicroBatcher

    base = _niceness()
    ran_at: list[int] = []

    def process(key, items):
        ran_at.append(_niceness())
        return list(items)

    batcher = MicroBatcher(process, short_item_cost=0.5, worker_nice=4, name="nice")
    try:
        assert await batcher.submit("k", [1, 2], costs=[0.1, 0.1]) == [1, 2]
        for _ in range(100):  # the short lane's thread sets its niceness as it starts
            if batcher._short_executor.nice_in_force is not None:
                break
            await asyncio.sleep(0.01)
        assert ran_at and set(ran_at) == {min(19, base + 4)}
        assert batcher._executor.nice_in_force == batcher._short_executor.nice_in_force == min(19, base + 4)
        assert _niceness() == base  # the event loop's thread keeps its priority
    finally:
        await batcher.close(timeout_s=5)


def test_compute_nice_is_checked_and_5_for_both_servers_by_default():
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.retrieval_server.config import RetrievalServerConfig

    assert load_config(JudgeServerConfig, None, ["rubrics=x"]).serving.compute_nice == 5
    assert load_config(JudgeServerConfig, None, ["rubrics=x", "serving.compute_nice=0"]).serving.compute_nice == 0
    assert load_config(RetrievalServerConfig, None, ["index_dir=x"]).serving.compute_nice == 5
    assert load_config(RetrievalServerConfig, None, ["index_dir=x", "serving.compute_nice=10"]).serving.compute_nice == 10
    for bad in ("-1", "20"):
        with pytest.raises(ConfigError, match=f"serving.compute_nice={bad}: must be in 0..19"):
            load_config(JudgeServerConfig, None, ["rubrics=x", f"serving.compute_nice={bad}"])


def _thread_ids() -> set[int]:
    import os

    return {int(name) for name in os.listdir("/proc/self/task")}


def _thread_niceness(thread_id: int) -> int:
    import os

    return os.getpriority(os.PRIO_PROCESS, thread_id)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_an_onnx_session_made_in_call_nicer_runs_its_pool_at_that_niceness(tmp_path):
    """ONNX Runtime starts its intra-op pool when a session is made; a server makes its
    sessions inside call_nicer so that pool runs at the workers' niceness, not the loop's."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from calibrl.threads import MAX_NICE, call_nicer

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [64, 64], np.ones(64 * 64).tolist())])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))

    def make_session() -> "ort.InferenceSession":
        options = ort.SessionOptions()
        options.intra_op_num_threads = 3  # the caller's thread and a pool of 2
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    base = _niceness()
    before = _thread_ids()
    session = call_nicer(4, make_session)
    pool = _thread_ids() - before
    x = np.ones((64, 64), dtype=np.float32)
    assert session.run(None, {"x": x})[0][0, 0] == 64.0
    assert len(pool) >= 2, pool  # the session's pool threads (the loader thread has ended)
    assert {_thread_niceness(t) for t in pool} == {min(MAX_NICE, base + 4)}
    assert _niceness() == base  # the caller keeps its priority

    before = _thread_ids()
    plain = make_session()  # made in the calling thread: its pool runs at the caller's niceness
    assert {_thread_niceness(t) for t in _thread_ids() - before} == {base}
    del plain


def test_call_nicer_returns_the_result_raises_the_error_and_0_runs_in_place():
    import threading

    from calibrl.threads import call_nicer

    base = _niceness()
    assert call_nicer(2, lambda a, b: (a + b, _niceness()), 1, 2) == (3, min(19, base + 2))
    with pytest.raises(ValueError, match="bad value"):
        call_nicer(2, lambda: (_ for _ in ()).throw(ValueError("bad value")))
    assert call_nicer(0, threading.get_native_id) == threading.get_native_id()


def test_set_process_niceness_reaches_every_thread_and_those_started_later():
    """Run in a child process (a niceness once raised cannot be lowered without privilege)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, threading, time
        from calibrl.threads import set_process_niceness
        base = os.getpriority(os.PRIO_PROCESS, 0)
        started = threading.Event()
        stop = threading.Event()
        def before():
            started.set()
            stop.wait()
        early = threading.Thread(target=before)
        early.start()
        started.wait()
        target = min(19, base + 3)
        assert set_process_niceness(target) == target
        later = []
        own = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        worker = threading.Thread(target=lambda: later.append(own()))
        worker.start(); worker.join()
        nices = {int(open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[16])
                 for t in os.listdir("/proc/self/task")}
        stop.set(); early.join()
        print(base, target, later[0], sorted(nices))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    base, target, later, nices = out.stdout.split(" ", 3)
    assert int(target) == min(19, int(base) + 3)
    assert int(later) == int(target)  # a thread started afterwards inherits it
    assert nices.strip() == f"[{int(target)}]"  # the main thread and the one started before


def test_a_refused_niceness_names_the_field_and_the_privilege(monkeypatch):
    import errno

    from calibrl.threads import set_process_niceness

    def refuse(which, who, value):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "setpriority", refuse)
    with pytest.raises(ConfigError, match=r"serving.nice=-5: the system refused .* CAP_SYS_NICE \(root\) or an "
                                          r"RLIMIT_NICE of at least 25"):
        set_process_niceness(-5)


def test_serving_nice_is_optional_and_checked():
    from calibrl.config import load_config
    from calibrl.judge_server.cli import _server_config_cls
    from calibrl.retrieval_server.config import RetrievalServerConfig

    assert load_config(_server_config_cls(), None, ["rubrics=x"]).serving.nice is None  # as started
    assert load_config(RetrievalServerConfig, None, ["index_dir=x", "serving.nice=-5"]).serving.nice == -5
    for bad in (-21, 20):
        with pytest.raises(ConfigError, match=f"serving.nice={bad}: must be in -20..19"):
            load_config(RetrievalServerConfig, None, ["index_dir=x", f"serving.nice={bad}"])


def test_a_served_retrieval_server_runs_at_serving_nice_with_its_workers_compute_nice_after(tmp_path):
    import subprocess
    import sys

    import grpc

    from calibrl.testing import build_test_index
    from calibrl.v1 import retrieval_pb2 as pb
    from calibrl.v1 import retrieval_pb2_grpc as pb_grpc

    index = build_test_index(tmp_path / "index")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nice = min(12, base + 2)
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "retrieval", "--index", str(index), "--port", "0", "device=cpu",
         "torch_threads=1", f"serving.nice={nice}", "serving.compute_nice=5", "serving.drain_seconds=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "listening on" in line, process.stderr.read() if process.poll() is not None else line
        with grpc.insecure_channel(f"127.0.0.1:{line.strip().rsplit(':', 1)[1]}") as channel:
            pb_grpc.RetrievalServiceStub(channel).Search(pb.SearchRequest(queries=["tower"], top_k=3), timeout=30)
        nices = []
        for task in (pathlib.Path(f"/proc/{process.pid}/task")).iterdir():
            try:
                nices.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        main = int(pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        assert main == nice  # the event loop's thread
        assert min(nices) == nice and max(nices) == nice + 5  # gRPC's threads as the loop; the workers after
        assert set(nices) <= {nice, nice + 5}
    finally:
        process.terminate()
        process.wait(30)
