"""SIGTERM during training: finish the step, write a checkpoint, return."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Callable, Union

# What signal.signal returns: a handler function, SIG_DFL / SIG_IGN, or None (not set from Python).
SignalHandler = Union[Callable[[int, "FrameType | None"], object], int, signal.Handlers, None]

log = logging.getLogger(__name__)


class StopSignal:
    """Sets ``raised`` on SIGTERM while active (main thread only: Python delivers
    signals there); the loop then finishes its step, writes a checkpoint and returns.
    The previous handler is restored on exit."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: SignalHandler = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        log.warning("SIGTERM received: finishing this step, then writing a checkpoint")
        self.raised = True

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


__all__ = ["StopSignal"]
