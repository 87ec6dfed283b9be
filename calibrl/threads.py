"""The CPU thread policy of a server process, set once at start and recorded.

Scores depend on the thread count: a torch kernel may split a sum differently on 1 and
on 4 threads, which moves the last bit of a float (the ONNX encoder's self-test runs at
the thread count it serves with). So a server sets its threads once, before its models
load, logs them, and a replica with the same setting computes the same bits.

OpenMP wait policy: with ``OMP_WAIT_POLICY=PASSIVE`` idle OpenMP workers sleep instead of
spinning, leaving the cores to the event loop and gRPC threads between encoder calls
(spinning workers made served calls many times slower on a small shared machine,
``benchmarks/README.md``). It must be in the environment before torch loads its OpenMP
runtime, so :func:`passive_openmp` runs first thing in a server's entry point; a value
the user set wins. ONNX Runtime sessions follow it (``allow_spinning`` off when passive).

Worker niceness: a server's batch workers can run nicer than its event loop and gRPC
threads (``serving.compute_nice``, 5 by default), so a
call the server refuses at once is answered while every core is busy scoring: the loop
does not queue for a core behind the work it admitted. Linux gives each thread its own
niceness; it orders the server's threads among themselves and, on a host shared with
other busy processes of the same session or container, makes the workers yield to those
too. Native libraries start their own compute threads (ONNX Runtime's intra-op pool when a
session is created, OpenMP's team at a thread's first parallel region), and a new thread
inherits its creator's niceness; so a server loads its models and warms them up in a thread
at the workers' niceness (:func:`call_nicer`), or those pools would run beside the event loop
at its priority.

Server niceness: on cores shared with other busy processes, a server's event loop and gRPC
threads queue for a core behind them, and a call it refuses at once waits for its turn.
``serving.nice`` sets the niceness of the whole server at start (:func:`set_process_niceness`:
every thread it has, and so every thread started later; the workers stay ``compute_nice``
steps nicer), so an operator can put the server ahead of batch neighbours. A niceness below
the one the server was started with needs ``CAP_SYS_NICE`` (root) or an ``RLIMIT_NICE`` that
allows it (``ulimit -e``, 20 minus the lowest niceness); without it the server refuses to
start, naming the field.

GIL switch interval: a server's event loop and its batcher's short lane need the GIL
back quickly while a worker runs Python scorers over a long item; at CPython's default
(5 ms) every hand-over can cost a small call 5 ms. :func:`responsive_gil` lowers it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


def passive_openmp() -> None:
    """Default ``OMP_WAIT_POLICY`` to PASSIVE (before torch is imported; the user's value wins)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def apply_thread_policy(torch_threads: int, process: str) -> dict[str, str]:
    """Set torch's CPU threads (0 keeps torch's default) and log the policy; returns it
    as a dict (torch threads, OpenMP wait policy) for a server to report."""
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    policy = {"torch_threads": str(torch.get_num_threads()),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(OpenMP default)")}
    log.info("%s thread policy: %d torch thread(s) (ONNX Runtime encoders use as many), OMP_WAIT_POLICY=%s",
             process, torch.get_num_threads(), policy["omp_wait_policy"])
    return policy


SERVER_SWITCH_INTERVAL_S = 0.001


def responsive_gil() -> float:
    """Lower the interpreter's GIL switch interval to :data:`SERVER_SWITCH_INTERVAL_S`
    (never raise it); returns the interval in force."""
    if sys.getswitchinterval() > SERVER_SWITCH_INTERVAL_S:
        sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    return sys.getswitchinterval()


MAX_NICE = 19


def lower_thread_priority(nice: int, name: str = "") -> int | None:
    """Make the calling thread ``nice`` steps nicer (capped at :data:`MAX_NICE`; 0 leaves
    it); returns the niceness in force, or None where threads have no niceness of their
    own (not Linux) or the system refused (logged when a change was asked for). Raising a
    niceness needs no privilege, and threads the caller starts later inherit it."""
    if not sys.platform.startswith("linux"):  # elsewhere a niceness belongs to the whole process
        if nice:
            log.warning("thread %s: no per-thread niceness on %s; it runs at the process's", name, sys.platform)
        return None
    thread_id = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        if nice:
            os.setpriority(os.PRIO_PROCESS, thread_id, min(MAX_NICE, current + nice))
            current = os.getpriority(os.PRIO_PROCESS, thread_id)
    except OSError as exc:
        if nice:
            log.warning("thread %s: niceness not changed (%s)", name, exc)
        return None
    if nice:
        log.info("thread %s runs at niceness %d", name, current)
    return current


def set_process_niceness(nice: int, field: str = "serving.nice") -> int:
    """Give every thread of this process niceness ``nice`` (threads it starts later inherit
    it from their creator); returns the niceness in force. Raises ConfigError naming
    ``field`` where the system refuses (a value below the current one needs CAP_SYS_NICE)
    or threads have no niceness of their own (not Linux: use ``nice`` to start the server)."""
    from calibrl.errors import ConfigError

    if not sys.platform.startswith("linux"):
        raise ConfigError(f"{field}={nice}: per-thread niceness is Linux's; on {sys.platform} start the server "
                          "under `nice -n N` instead")
    tasks = pathlib.Path("/proc/self/task")
    thread_ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [threading.get_native_id()]
    for thread_id in thread_ids:
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:
            current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            raise ConfigError(f"{field}={nice}: the system refused to set it ({exc.strerror}); a niceness below the "
                              f"one the server started with ({current}) needs CAP_SYS_NICE (root) or an RLIMIT_NICE "
                              f"of at least {20 - nice} (ulimit -e; in a container --ulimit nice={20 - nice})") from exc
    current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    log.info("server niceness %d (its batch workers run nicer by serving.compute_nice)", current)
    return current


def call_nicer(nice: int, fn: Callable[..., T], *args: object, name: str = "model-loader") -> T:
    """``fn(*args)`` in a new thread ``nice`` steps nicer than the caller (joined: the call
    returns ``fn``'s result or raises its exception), so that threads native libraries start
    inside it (an ONNX Runtime session's pool, an OpenMP team) inherit that niceness; the
    calling thread keeps its own. ``nice`` 0 calls ``fn`` in the calling thread."""
    if not nice:
        return fn(*args)
    outcome: dict[str, object] = {}

    def run() -> None:
        lower_thread_priority(nice, name)
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
