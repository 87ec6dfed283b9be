"""One error vocabulary for every calibrl component.

Library code raises these; the gRPC adapters map them to status codes in one
place (:func:`grpc_status_for`), and clients map status codes back
(:func:`error_from_status`). The tree::

    CalibrlError
    ├── InvalidArgument        bad input: names the field and the limit   -> INVALID_ARGUMENT
    ├── NotFound               unknown rubric, document, checkpoint        -> NOT_FOUND
    ├── ResourceExhausted      over a size/rate limit, queue full          -> RESOURCE_EXHAUSTED
    ├── FailedPrecondition     unvalidated rubric, index/manifest mismatch -> FAILED_PRECONDITION
    ├── Unauthenticated        missing or unknown API key                  -> UNAUTHENTICATED
    ├── PermissionDenied       key valid, resource belongs to another tenant -> PERMISSION_DENIED
    ├── Unavailable            a service is down or draining               -> UNAVAILABLE
    │   └── DeadlineExceeded   the caller's deadline passed before its work ran -> DEADLINE_EXCEEDED
    ├── ConfigError            a config file or override is invalid (local, never on the wire)
    └── RewardError            a reward could not be computed; never becomes a silent 0
"""

from __future__ import annotations

from typing import Any


class CalibrlError(Exception):
    """Base of every error calibrl raises on purpose."""


class InvalidArgument(CalibrlError):
    """Input breaks a documented rule. The message names the field and the limit."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class NotFound(CalibrlError):
    """A named thing (rubric, document, checkpoint) does not exist or is not visible."""


class ResourceExhausted(CalibrlError):
    """A size or rate limit was passed, or a bounded queue is full."""


class FailedPrecondition(CalibrlError):
    """The request is well formed but the system is not in a state to serve it."""


class Unauthenticated(CalibrlError):
    """No API key, or an unknown one."""


class PermissionDenied(CalibrlError):
    """The caller is known but may not use this resource."""


class Unavailable(CalibrlError):
    """A service could not be reached or is shutting down."""


class DeadlineExceeded(Unavailable):
    """The caller's deadline passed before its work could run (the work was dropped).
    A kind of Unavailable: transient, worth a retry with a longer deadline."""


class ConfigError(CalibrlError):
    """A configuration value is invalid; the message names the value and the fix."""


class RewardError(CalibrlError):
    """A reward could not be computed. Training must retry or stop, never score it 0."""


def _status_table() -> dict[type[CalibrlError], Any]:
    import grpc

    return {
        InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        NotFound: grpc.StatusCode.NOT_FOUND,
        ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
        FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
        Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
        DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,  # before Unavailable, its base class
        Unavailable: grpc.StatusCode.UNAVAILABLE,
    }


def grpc_status_for(error: BaseException) -> Any:
    """The grpc.StatusCode a server answers for ``error`` (INTERNAL when unmapped)."""
    import grpc

    for cls, code in _status_table().items():
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: Any, details: str) -> CalibrlError:
    """The calibrl error a client raises for a non-OK status."""
    for cls, mapped in _status_table().items():
        if mapped == code:
            if cls is InvalidArgument:
                field, _, problem = details.partition(": ")
                return InvalidArgument(field, problem or details)
            return cls(details)
    return Unavailable(f"{getattr(code, 'name', code)}: {details}")
