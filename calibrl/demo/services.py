"""The demo's two services: the real `calibrl serve ...` commands, as subprocesses on loopback.

Each service is started the way a user starts it (the ``calibrl`` console script,
or ``python -m calibrl`` where the script is not installed), on a free loopback
port, with its output in a log file. :meth:`Service.wait_healthy` polls the gRPC
health protocol (``calibrl health`` does the same) until the server answers
SERVING, and fails with the log's tail if the process exits first.
:meth:`Service.stop` sends SIGTERM (the server goes NOT_SERVING, drains, exits)
and kills only after a grace period.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from calibrl.errors import Unavailable


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
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


__all__ = ["Service", "calibrl_command", "free_port", "service_env"]
