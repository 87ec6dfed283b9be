"""The demo's processes: the two services (the real `calibrl serve ...` commands, as
subprocesses on loopback) and its training runs (`calibrl train`, up to two at once).

Each service is started the way a user starts it (the ``calibrl`` console script,
or ``python -m calibrl`` where the script is not installed), on a free loopback
port, with its output in a log file. :meth:`Service.wait_healthy` polls the gRPC
health protocol (``calibrl health`` does the same) until the server answers
SERVING, and fails with the log's tail if the process exits first.
:meth:`Service.stop` sends SIGTERM (the server goes NOT_SERVING, drains, exits)
and kills only after a grace period.

:class:`TrainingProcesses` runs training runs the way a user's agents run: each a
`calibrl train` process of its own, reaching both services over gRPC, at most
``jobs`` at once; it records when each ran (:class:`RunSpan`), fails with the log
tail of a run that fails, and stops the runs still going when anything (Ctrl-C
included) ends it early.
"""

from __future__ import annotations

import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Callable, Mapping, Sequence

from calibrl.errors import CalibrlError, Unavailable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def calibrl_command() -> list[str]:
    """How to run the ``calibrl`` CLI: the console script beside this Python, else ``python -m calibrl``."""
    script = pathlib.Path(sys.executable).with_name("calibrl")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "calibrl"]


def service_env(threads: int = 1) -> dict[str, str]:
    """The environment of a service process: offline, and a fixed number of CPU threads
    (on a small shared machine, several processes that each spin every core starve
    each other)."""
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    })
    return env


class Service:
    """One `calibrl serve ...` subprocess."""

    def __init__(self, name: str, args: Sequence[str], port: int, log_path: pathlib.Path, threads: int = 1) -> None:
        self.name = name
        self.args = list(args)
        self.port = port
        self.target = f"127.0.0.1:{port}"
        self.log_path = log_path
        self.threads = threads
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        return [*calibrl_command(), *self.args]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=service_env(self.threads),
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float = 120.0) -> float:
        """Seconds until the server answered SERVING; Unavailable when it exits or times out."""
        import grpc

        from calibrl.healthcheck import check

        assert self.process is not None, "start() first"
        started = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise Unavailable(f"{self.name} exited with code {code} before serving:\n{self.log_tail()}")
            try:
                if check(self.target, timeout_s=2.0) == "SERVING":
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            if time.monotonic() - started > timeout_s:
                raise Unavailable(f"{self.name} did not report SERVING within {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def log_tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)


class IndexBuild:
    """`calibrl index build` as a subprocess, started at once, so the demo's other stages
    run beside it. A process, not a thread: a thread of the demo's own process shares
    its torch and transformers state (thread pools, lazy imports), and an index built
    in a thread beside the LLM judge's training changed the judge's trained weights."""

    def __init__(self, corpus: pathlib.Path, index_dir: pathlib.Path, log_path: pathlib.Path,
                 threads: int = 1) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w", encoding="utf-8")
        self.command = [*calibrl_command(), "index", "build", "--corpus", str(corpus), "--out", str(index_dir),
                        "--device", "cpu", "--overwrite", "--no-progress"]
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=service_env(threads), start_new_session=True)

    def wait(self) -> None:
        """Block until the index is written; :class:`CalibrlError` with the log's tail if the build failed."""
        code = self.process.wait()
        self._close_log()
        if code != 0:
            raise CalibrlError(f"calibrl index build exited with code {code}:\n{log_tail(self.log_path)}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Kill a build still running (the demo failed or was stopped before it joined)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._close_log()

    def _close_log(self) -> None:
        if not self._log.closed:
            self._log.close()


# --- training runs as `calibrl train` subprocesses ------------------------------------------------------------------


class TrainingFailed(CalibrlError):
    """A `calibrl train` subprocess exited with an error; the message holds its log's tail."""


@dataclass
class RunSpan:
    """When one training process ran: seconds since its :class:`TrainingProcesses` started."""

    name: str
    start_s: float
    end_s: float = math.nan
    returncode: int | None = None
    where: str = "calibrl train process"  # or "demo process" (a run the demo trained itself)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict[str, str | float]:
        return {"where": self.where, "start_s": round(self.start_s, 2), "end_s": round(self.end_s, 2),
                "seconds": round(self.seconds, 2)}


def overlap_seconds(a: RunSpan, b: RunSpan) -> float:
    """Seconds during which both runs were running."""
    return max(0.0, min(a.end_s, b.end_s) - max(a.start_s, b.start_s))


class TrainingProcesses:
    """Training runs as `calibrl train` subprocesses, at most ``jobs`` at once, started in
    the order of ``runs`` (name -> config overrides), each with its output in
    ``logs/train_<name>.log``. A run that fails stops the others (SIGTERM: each writes a
    checkpoint and exits) and raises :class:`TrainingFailed` with its log's tail; so does
    anything else that leaves :meth:`run` early, Ctrl-C included."""

    def __init__(self, runs: Mapping[str, Sequence[str]], logs: pathlib.Path, jobs: int = 2,
                 poll_s: float = 0.5, command: Sequence[str] | None = None) -> None:
        """``command``: what each run's overrides follow (default ``calibrl train --log-level INFO``)."""
        if jobs < 1:
            raise ValueError(f"jobs={jobs}: must be >= 1")
        self.runs = {name: list(overrides) for name, overrides in runs.items()}
        self.logs = logs
        self.jobs = jobs
        self.poll_s = poll_s
        self.command = list(command) if command is not None else [*calibrl_command(), "train", "--log-level", "INFO"]
        self.spans: dict[str, RunSpan] = {}
        self._running: dict[str, tuple[subprocess.Popen, IO[str]]] = {}
        self.started = time.monotonic()  # reset when run() starts: the spans' zero

    def log_path(self, name: str) -> pathlib.Path:
        return self.logs / f"train_{name}.log"

    def run(self, on_exit: Callable[[str, RunSpan], None] | None = None,
            on_tick: Callable[[float, list[str]], None] | None = None) -> dict[str, RunSpan]:
        """Run every training run; returns their spans. ``on_exit(name, span)`` runs when a
        run has finished well (the others may still run); ``on_tick(seconds, running)``
        about every ``poll_s``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        waiting = list(self.runs)
        try:
            while waiting or self._running:
                while waiting and len(self._running) < self.jobs:
                    self._start(waiting.pop(0))
                time.sleep(self.poll_s)
                for name in [n for n, (process, _) in self._running.items() if process.poll() is not None]:
                    span = self._finish(name)
                    if span.returncode != 0:
                        raise TrainingFailed(f"training run {name} failed (exit {span.returncode}); "
                                             f"{self.log_path(name)} ends:\n{log_tail(self.log_path(name), 40)}")
                    if on_exit is not None:
                        on_exit(name, span)
                if on_tick is not None:
                    on_tick(time.monotonic() - self.started, list(self._running))
        finally:
            self.stop()
        return dict(self.spans)

    def _start(self, name: str) -> None:
        log = open(self.log_path(name), "w", encoding="utf-8")
        args = [*self.command, *self.runs[name]]
        log.write(" ".join(args) + "\n")
        log.flush()
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=service_env(1),
                                   start_new_session=True)  # Ctrl-C reaches the demo, which stops the runs
        self._running[name] = (process, log)
        self.spans[name] = RunSpan(name, time.monotonic() - self.started)

    def _finish(self, name: str) -> RunSpan:
        process, log = self._running.pop(name)
        log.close()
        span = self.spans[name]
        span.end_s, span.returncode = time.monotonic() - self.started, process.returncode
        return span

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every run still running (each checkpoints and exits), SIGKILL after ``grace_s``."""
        for process, _ in self._running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, (process, _) in list(self._running.items()):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
            self._finish(name)


def log_tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


__all__ = ["IndexBuild", "RunSpan", "Service", "TrainingFailed", "TrainingProcesses", "calibrl_command", "free_port",
           "log_tail", "overlap_seconds", "service_env"]
