"""Fault tests on loopback: services that go away, a trainer that is killed, servers
that shut down with calls in flight.

Everything is real: a tiny random Llama policy trained for real, a MiniLM/FAISS/BM25
index of the twelve test passages behind a real retrieval server, a programmatic
rubric behind a real judge server, and the trainer's real gRPC clients (deadlines,
tenacity retries). The judge listens on a fixed port so that it can be stopped and
started again at the same address, as a restarted pod behind a Service would be.

- judge down mid-training: the trainer retries, waits, and continues once the judge
  is back; every step is identical to an uninterrupted run's (nothing was trained on
  partial rewards). A judge that stays down stops the run with RewardError and a
  checkpoint of the state before the failed step.
- `calibrl train` killed with SIGKILL: rerun with --resume, it continues from its
  last checkpoint and ends where an uninterrupted run ends.
- graceful shutdown (stop(grace) in process, SIGTERM on `calibrl serve judge`): no
  call in flight is lost, new calls are refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from calibrl.errors import RewardError
from calibrl.v1 import judge_pb2 as jpb
from calibrl.v1 import judge_pb2_grpc as jpb_grpc
from calibrl.v1 import retrieval_pb2 as rpb
from calibrl.v1 import retrieval_pb2_grpc as rpb_grpc
from calibrl.api import retrieval_wire
from calibrl.testing import TINY_CORPUS, build_test_index, start_test_server
from calibrl.api.retrieval import ScoreItem

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUBRIC_ID = "faults-rewriter"
RUBRIC_YAML = f"""\
id: {RUBRIC_ID}
version: "1"
description: Programmatic rubric for the fault tests.
criteria:
  - {{name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.4}}
  - {{name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.3}}
  - {{name: specific, kind: programmatic, scorer: specificity, weight: 0.2}}
  - {{name: length, kind: programmatic, scorer: length, weight: 0.1}}
"""
STEPS = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# =============================================================================== the world


@dataclass
class World:
    root: pathlib.Path
    policy_dir: pathlib.Path
    index_dir: pathlib.Path
    rubric_dir: pathlib.Path
    tasks_path: pathlib.Path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from calibrl.testing import save_tiny_policy

    root = tmp_path_factory.mktemp("faults")
    rubric_dir = root / "rubrics"
    rubric_dir.mkdir()
    (rubric_dir / f"{RUBRIC_ID}.yaml").write_text(RUBRIC_YAML)
    tasks_path = root / "rewrite.jsonl"
    tasks_path.write_text("".join(
        json.dumps({"id": p["_id"], "query": f"tell me about {p['title'].lower()}", "gold_doc_ids": [p["_id"]]}) + "\n"
        for p in TINY_CORPUS
    ))
    return World(root, save_tiny_policy(root / "policy"), build_test_index(root / "index"), rubric_dir, tasks_path)


def _judge_server_config(rubric_dir, port: int, **overrides):
    from calibrl.serving import ServingConfig
    from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig

    return JudgeServerConfig(
        rubrics=str(rubric_dir),
        judge=JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0),
        serving=ServingConfig(port=port, grace_seconds=5.0),
        **overrides,
    )


class Services:
    """Both servers on a background event loop; the judge on a fixed port, so it
    can be taken down and brought back at the same address."""

    def __init__(self, world: World) -> None:
        from calibrl.trainer.aio import BackgroundLoop

        self.world = world
        self.loop = BackgroundLoop(name="fault-servers")
        self.retrieval = self.loop.run(start_test_server(world.index_dir), timeout=300)
        self.judge_port = _free_port()
        self.judge = self.loop.run(self._start_judge(), timeout=60)

    @property
    def retrieval_target(self) -> str:
        return f"127.0.0.1:{self.retrieval.port}"

    @property
    def judge_target(self) -> str:
        return f"127.0.0.1:{self.judge_port}"

    async def _start_judge(self):
        from calibrl.judge_server import server as judge_server

        return await judge_server.start(_judge_server_config(self.world.rubric_dir, self.judge_port))

    def judge_down(self) -> None:
        self.loop.run(self.judge.stop(grace=0), timeout=30)
        self.judge = None

    def judge_up(self) -> float:
        """Start the judge again on its port; returns the monotonic time it serves from."""
        if self.judge is None:
            self.judge = self.loop.run(self._start_judge(), timeout=60)
        return time.monotonic()

    def close(self) -> None:
        if self.judge is not None:
            self.loop.run(self.judge.stop(grace=0), timeout=30)
        self.loop.run(self.retrieval.stop(grace=0), timeout=30)
        self.loop.close()


@pytest.fixture(scope="module")
def services(world):
    services = Services(world)
    yield services
    services.close()


def _overrides(world: World, services: Services, output_dir: pathlib.Path, *extra: str) -> list[str]:
    """A small rewrite run against the two servers: 4 tasks x 4 rollouts per step."""
    return [
        f"policy.path={world.policy_dir}",
        "policy.device=cpu",
        f"tasks.path={world.tasks_path}",
        f"services.retrieval={services.retrieval_target}",
        f"services.judge={services.judge_target}",
        f"reward.rubric_id={RUBRIC_ID}",
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=6",
        "optimizer.lr=1e-3",
        f"steps={STEPS}",
        f"output_dir={output_dir}",
        "checkpoint_every=0",
        "progress_bar=false",
        "tensorboard=false",
        *extra,
    ]


class StatusRecorder(grpc.aio.UnaryUnaryClientInterceptor):
    """Client-side record of every attempt: (method, final status, monotonic time)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        call = await continuation(client_call_details, request)
        method = client_call_details.method
        method = (method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1]
        try:
            code = (await call.code()).name
        except asyncio.CancelledError:
            code = "CANCELLED"
        self.calls.append((method, code, time.monotonic()))
        return call

    def count(self, method: str, code: str) -> int:
        return sum(1 for m, c, _ in self.calls if m == method and c == code)


def _train(config, services: Services, on_step=None, judge_knobs=None, recorder=None):
    """Run calibrl.trainer.loop.train with real gRPC clients; closes their channels after."""
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
    from calibrl.trainer.loop import train

    knobs = dict(judge_knobs or {})
    if recorder is not None:
        knobs["interceptors"] = [recorder]
    retrieval = GrpcRetrievalClient(services.retrieval_target, timeout_s=60)
    judge = GrpcJudgeClient(services.judge_target, **knobs)
    with BackgroundLoop(name="fault-trainer") as background:
        try:
            return train(config, retrieval=retrieval, judge=judge, on_step=on_step, background=background)
        finally:
            background.run(retrieval.close(), timeout=30)
            background.run(judge.close(), timeout=30)


@pytest.fixture(scope="module")
def uninterrupted(world, services, tmp_path_factory) -> list[dict]:
    """The metrics of an uninterrupted run: what every faulted run must reproduce."""
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.diagnostics import read_log

    out = tmp_path_factory.mktemp("uninterrupted")
    result = _train(load_train_config(None, _overrides(world, services, out)), services)
    assert result.stopped == "completed" and result.steps_done == STEPS
    return read_log(out / "metrics.jsonl")


def _same_steps(expected: list[dict], got: list[dict], names=("reward", "rewards/retrieval/mean",
                                                                "rewards/rubric/mean", "loss", "grad_norm")):
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got):
        for name in names:
            # Same machine and kernels; after a fault the services may batch the same items differently, which
            # moves a judge score by <= 3e-7 (issue 10): rel 1e-6 covers it, abs 1e-9 a value of ~0.
            assert b[name] == pytest.approx(a[name], rel=1e-6, abs=1e-9), f"step {a['step']}: {name}"


# =============================================================================== judge outage mid-training


@pytest.mark.slow
def test_judge_outage_mid_training_is_retried_and_the_run_continues(world, services, uninterrupted, tmp_path):
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.diagnostics import read_log

    recorder = StatusRecorder()
    outage: dict[str, float] = {}
    restarted = threading.Event()

    def bring_judge_back() -> None:
        # Back only once the trainer has really hit the outage (two refused attempts)
        # and it lasted over a second: the test cannot pass without retries.
        deadline = outage["down"] + 60
        while time.monotonic() < deadline:
            long_enough = time.monotonic() - outage["down"] > 1.2
            if long_enough and recorder.count("Score", "UNAVAILABLE") >= 2:
                break
            time.sleep(0.05)
        outage["up"] = services.judge_up()
        restarted.set()

    def take_judge_down_after_step_one(step: int, metrics: dict) -> None:
        if step == 1:
            services.judge_down()
            outage["down"] = time.monotonic()
            threading.Thread(target=bring_judge_back, daemon=True).start()
            outage["next_step_from"] = time.monotonic()

    config = load_train_config(None, _overrides(world, services, tmp_path))
    # A retry budget that outlasts the outage: 100 attempts, 50-250 ms apart.
    knobs = dict(timeout_s=10, max_attempts=100, backoff_initial_s=0.05, backoff_max_s=0.25)
    try:
        result = _train(config, services, on_step=take_judge_down_after_step_one, judge_knobs=knobs,
                        recorder=recorder)
    finally:
        if "down" in outage:
            restarted.wait(90)
        services.judge_up()  # for the other tests, whatever happened

    assert result.stopped == "completed" and result.steps_done == STEPS
    records = read_log(tmp_path / "metrics.jsonl")
    # The outage was real and the trainer's calls hit it, then succeeded once it ended.
    assert outage["up"] - outage["down"] > 1.0
    assert recorder.count("Score", "UNAVAILABLE") >= 2
    assert any(m == "Score" and c == "OK" and t >= outage["up"] for m, c, t in recorder.calls)
    # Step 2 waited for the judge instead of going on without it.
    assert records[1]["timing/step"] >= outage["up"] - outage["next_step_from"] - 0.1
    # No step was trained on partial rewards: every logged number equals the uninterrupted run's.
    _same_steps(uninterrupted, records)
    assert all(r["rewards/rubric/mean"] > 0 for r in records)


@pytest.mark.slow
def test_judge_that_stays_down_stops_the_run_with_a_checkpoint_and_nothing_half_scored(world, services, tmp_path):
    from calibrl.trainer.checkpoint import find_checkpoint, load_train_state
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.diagnostics import read_log

    def take_judge_down_after_step_one(step: int, metrics: dict) -> None:
        if step == 1:
            services.judge_down()

    config = load_train_config(None, _overrides(world, services, tmp_path, "steps=2", "reward.max_attempts=2",
                                                "reward.retry_backoff_s=0.1"))
    knobs = dict(timeout_s=5, max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.1)
    try:
        with pytest.raises(RewardError, match=r"step 2: .*UNAVAILABLE.*checkpoint written"):
            _train(config, services, on_step=take_judge_down_after_step_one, judge_knobs=knobs)
    finally:
        services.judge_up()
    assert [r["step"] for r in read_log(tmp_path / "metrics.jsonl")] == [1]
    checkpoint = find_checkpoint(tmp_path)
    state = load_train_state(checkpoint)
    assert (checkpoint.name, state.step, state.reason) == ("step_000001", 1, "reward_error")


# =============================================================================== trainer killed


def _wait_for_checkpoint(run_dir: pathlib.Path, process: subprocess.Popen, timeout: float) -> None:
    from calibrl.errors import NotFound
    from calibrl.trainer.checkpoint import find_checkpoint

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            find_checkpoint(run_dir)
            return
        except NotFound:
            pass
        if process.poll() is not None:
            pytest.fail(f"trainer exited with {process.returncode} before writing a checkpoint")
        time.sleep(0.02)
    pytest.fail(f"no checkpoint under {run_dir} after {timeout}s")


@pytest.mark.slow
def test_killed_trainer_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_run(
        world, services, uninterrupted, tmp_path):
    from calibrl.trainer.checkpoint import find_checkpoint, load_train_state
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.diagnostics import read_log

    run_dir = tmp_path / "run"
    config_file = tmp_path / "train.yaml"
    config = load_train_config(None, _overrides(world, services, run_dir, "checkpoint_every=1", "keep_checkpoints=0"))
    config_file.write_text(config.to_yaml())
    command = [sys.executable, "-m", "calibrl", "train", "--config", str(config_file)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")

    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(run_dir, first, timeout=240)
        first.send_signal(signal.SIGKILL)  # no handler, no final checkpoint: a crash or an OOM kill
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    first_stderr = first.stderr.read()
    assert first.returncode == -signal.SIGKILL, first_stderr[-2000:]
    checkpoint = find_checkpoint(run_dir)
    killed_at = load_train_state(checkpoint).step
    assert 1 <= killed_at < STEPS, f"the run finished (step {killed_at}) before it could be killed"

    second = subprocess.run([*command, "--resume", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert re.search(rf"resumed from \S*{checkpoint.name} at step {killed_at}\b", second.stderr), second.stderr[-3000:]
    assert f"completed: {STEPS} steps" in second.stderr
    # The resumed process trained only the remaining steps (one interval checkpoint each)...
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        f"step_{s:06d}" for s in range(1, STEPS + 1)]
    # ...each step appears once in the log, and the run ends exactly where the uninterrupted one does.
    _same_steps(uninterrupted, read_log(run_dir / "metrics.jsonl"))


# =============================================================================== graceful shutdown


CALLS_IN_FLIGHT = 8
QUERIES_PER_CALL = 8  # 64 queries to embed: seconds of work on a small shared CPU
ITEMS_PER_CALL = 32  # judge items per call
ARRIVAL_TIMEOUT_S = 60.0  # for every call of a burst to reach the server's queue on a loaded CPU
HOLD_WINDOW_MS = 1000 * (ARRIVAL_TIMEOUT_S + 60.0)  # a batching window that outlasts the arrival


def _retrieval_items(call: int) -> list[ScoreItem]:
    items = []
    for n in range(QUERIES_PER_CALL):
        passage = TINY_CORPUS[(call + n) % len(TINY_CORPUS)]
        items.append(ScoreItem(f"{passage['title']} {passage['text'].split()[n % 5]} {call}-{n}",
                               gold_doc_ids=(passage["_id"],), gold_answers=(passage["title"],)))
    return items


async def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


async def test_retrieval_stop_finishes_every_call_in_flight_and_refuses_new_ones(world):
    # A long batching window holds every call in the server's queue until all have
    # arrived, however slowly a loaded machine delivers them (a 2 s window once closed
    # before the eighth call came); stop() ends the window, so the test does not wait it
    # out, and the 64 queries are embedded and searched as one batch. The window opens only
    # while less than one unit of work is queued, so the unit is made large enough for all 64.
    running = await start_test_server(world.index_dir, f"batch_max_wait_ms={HOLD_WINDOW_MS}", "batch_max_items=64",
                                      "serving.max_unit_cost_s=100")
    channel = grpc.aio.insecure_channel(running.address)
    stub = rpb_grpc.RetrievalServiceStub(channel)
    try:
        await stub.GetIndexInfo(rpb.GetIndexInfoRequest(), timeout=30)  # connected before the burst
        batches = [_retrieval_items(call) for call in range(CALLS_IN_FLIGHT)]
        requests = [rpb.ScoreRetrievalRequest(items=[retrieval_wire.score_item_to_proto(i) for i in items], top_k=3)
                    for items in batches]
        calls = [asyncio.ensure_future(stub.ScoreRetrieval(request, timeout=120)) for request in requests]
        total = CALLS_IN_FLIGHT * QUERIES_PER_CALL
        await _wait_until(lambda: running.batcher.queue_depth == total, ARRIVAL_TIMEOUT_S,
                          "every call is queued in the server")
        assert not any(call.done() for call in calls)
        await running.stop(grace=60)
        assert running.batcher.stats.items == total  # stop() returned after the server did all the work

        replies = await asyncio.gather(*calls)  # raises if any call failed
        for items, reply in zip(batches, replies):
            expected = running.retriever.score(items, top_k=3)
            assert [[h.doc_id for h in s.hits] for s in reply.scores] == [[h.doc_id for h in e.hits] for e in expected]
            assert [s.recall for s in reply.scores] == [e.recall for e in expected]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Search(rpb.SearchRequest(queries=["Mozart"], top_k=1), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await running.stop(grace=0)


def _judge_items(call: int) -> list[jpb.JudgeItem]:
    return [jpb.JudgeItem(query=f"What did {p['title']} do? ({call}-{n})",
                          output=f"{p['title']} {p['text'][: 20 + n]}")
            for n, p in ((n, TINY_CORPUS[(call + n) % len(TINY_CORPUS)]) for n in range(ITEMS_PER_CALL))]


def _judge_totals(rubric_dir, requests: list[list[jpb.JudgeItem]]) -> list[list[float]]:
    from calibrl.api import judge_wire
    from calibrl.judge_server.judge import Judge

    judge = Judge.from_config(_judge_server_config(rubric_dir, 0).judge, rubric_dir)
    try:
        return [[s.total for s in judge.score(RUBRIC_ID, [judge_wire.item_from_proto(m) for m in items])]
                for items in requests]
    finally:
        judge.close()


async def test_judge_stop_finishes_every_call_in_flight_and_refuses_new_ones(world):
    from calibrl.judge_server import server as judge_server

    config = _judge_server_config(world.rubric_dir, 0, max_wait_ms=HOLD_WINDOW_MS, max_batch_items=64)
    config.serving.max_unit_cost_s = 100.0  # the window opens only below one unit's worth: one unit holds all calls
    running = await judge_server.start(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = jpb_grpc.JudgeServiceStub(channel)
    try:
        await stub.ListRubrics(jpb.ListRubricsRequest(), timeout=30)
        requests = [_judge_items(call) for call in range(CALLS_IN_FLIGHT)]
        calls = [asyncio.ensure_future(stub.Score(jpb.ScoreRequest(rubric_id=RUBRIC_ID, items=items), timeout=120))
                 for items in requests]
        batcher = running.servicer.batcher
        total = CALLS_IN_FLIGHT * ITEMS_PER_CALL
        await _wait_until(lambda: batcher.queue_depth == total, ARRIVAL_TIMEOUT_S, "every call is queued in the judge")
        assert not any(call.done() for call in calls)
        await running.stop(grace=60)

        replies = await asyncio.gather(*calls)
        assert [[s.total for s in r.scores] for r in replies] == _judge_totals(world.rubric_dir, requests)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Score(jpb.ScoreRequest(rubric_id=RUBRIC_ID, items=requests[0][:1]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await running.stop(grace=0)


def test_sigterm_on_calibrl_serve_judge_answers_every_call_in_flight(world):
    """The production path: SIGTERM -> NOT_SERVING -> stop(grace) -> exit 0."""
    command = [sys.executable, "-m", "calibrl", "serve", "judge", "--rubrics", str(world.rubric_dir), "--port", "0",
               "--allow-unvalidated", "judge.embedder=hashed-ngrams", "judge.cache_size=0", "max_wait_ms=2500",
               "max_batch_items=64", "serving.grace_seconds=60"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        assert match, f"no port in {line!r}; stderr: {process.stderr.read()[-2000:] if process.poll() else ''}"
        with grpc.insecure_channel(f"127.0.0.1:{match.group(1)}") as channel:
            stub = jpb_grpc.JudgeServiceStub(channel)
            stub.ListRubrics(jpb.ListRubricsRequest(), timeout=30)
            requests = [_judge_items(call) for call in range(CALLS_IN_FLIGHT)]
            futures = [stub.Score.future(jpb.ScoreRequest(rubric_id=RUBRIC_ID, items=items), timeout=120)
                       for items in requests]
            time.sleep(1.0)  # inside the 2.5 s batching window: every call has arrived and waits in the queue
            assert not any(f.done() for f in futures)
            process.send_signal(signal.SIGTERM)
            replies = [f.result() for f in futures]  # raises if any call was dropped
            assert [[s.total for s in r.scores] for r in replies] == _judge_totals(world.rubric_dir, requests)
            assert process.wait(timeout=60) == 0
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListRubrics(jpb.ListRubricsRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
