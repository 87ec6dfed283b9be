"""What every stage of ``calibrl demo`` reads: the run's settings and folders
(:class:`RunContext`), the stage printer and timer (:class:`Stages`), and the demo's error."""

from __future__ import annotations

import contextlib
import os
import pathlib
import platform
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence, TextIO

from calibrl import kernels
from calibrl.demo.settings import DemoSettings
from calibrl.errors import CalibrlError


class DemoError(CalibrlError):
    """A demo stage failed; the message says which and shows its log."""


class Stages:
    """Prints each stage as it starts and records how long it took."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done: list[tuple[str, float]] = []
        self.stream = stream or sys.stdout

    @contextlib.contextmanager
    def stage(self, title: str) -> Iterator[None]:
        number = len(self.done) + 1
        print(f"\n==> [{number}/{self.total}] {title}", file=self.stream, flush=True)
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.done.append((title, seconds))
        print(f"    done in {seconds:.1f}s", file=self.stream, flush=True)


@dataclass(frozen=True)
class RunContext:
    """One demo run: its sizes, seed and output folder, as every stage reads them."""

    settings: DemoSettings
    out: pathlib.Path
    seed: int
    progress: bool
    report_to: Sequence[str]  # the experiment trackers of every training run
    command: str  # how the run was started, for the report
    machine: str  # machine_description() at the start
    stages: Stages

    @property
    def logs(self) -> pathlib.Path:
        return self.out / "logs"


def machine_description() -> str:
    cores = os.cpu_count() or 0
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        threads = torch.get_num_threads()
        floats = kernels.describe()
    except Exception:  # noqa: BLE001 - description only
        gpu, threads, floats = "torch unavailable", 0, "unknown"
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} at the start"
    return (f"{platform.system()} {platform.machine()}, {cores} CPU cores, {gpu}, Python {platform.python_version()}, "
            f"{threads} torch thread(s) in the demo process, float kernels {floats}{load}")


def log_to_file(path: pathlib.Path) -> None:
    """Library logging (the trainer's per-step health warnings, the CLIs' INFO lines) goes
    to one file rather than between the progress bars; set up before any CLI function
    runs, so their own ``logging.basicConfig`` calls change nothing."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


__all__ = ["DemoError", "RunContext", "Stages", "log_to_file", "machine_description"]
