"""What a request may cost, and the refusals that say so.

A server estimates the work of every request before it is queued, in seconds of
server time on a reference CPU (each service measures its own per-unit costs; see
``calibrl.judge_server.costs`` and ``calibrl.retrieval_server.limits``), and
refuses one above its per-request budget at once. Two refusals carry machine-
readable hints as trailing metadata (``calibrl.serving.rpc_errors`` adds them):

- :class:`OverBudget` (RESOURCE_EXHAUSTED, permanent for this request): the
  estimated cost, the budget, and ``calibrl-max-items``, how many of the request's
  leading items fit the budget, so a client can split the request and resend.
- :class:`Shed` (RESOURCE_EXHAUSTED, transient): the server cannot start the work
  before the caller's deadline, or the caller's queue is full; the standard
  ``grpc-retry-pushback-ms`` trailer says when to try again.

A RESOURCE_EXHAUSTED without the pushback trailer is not worth retrying as it is.
"""

from __future__ import annotations

from typing import Sequence

from calibrl.errors import ResourceExhausted

PUSHBACK_KEY = "grpc-retry-pushback-ms"
MAX_ITEMS_KEY = "calibrl-max-items"


class OverBudget(ResourceExhausted):
    """A request whose estimated cost is above the per-request budget."""

    def __init__(self, field: str, cost_s: float, limit_s: float, fits_items: int, limit_name: str) -> None:
        self.field, self.cost_s, self.limit_s, self.fits_items = field, cost_s, limit_s, fits_items
        super().__init__(
            f"{field}: estimated cost {cost_s:.3f} s of server time, limit {limit_name}={limit_s:g} s; "
            f"split the request (the first {fits_items} item(s) fit)")

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((MAX_ITEMS_KEY, str(self.fits_items)),)


class Shed(ResourceExhausted):
    """A call refused at once because it could not be served in time (or its tenant's
    queue is full); ``retry_after_s`` is the pushback."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = max(0.0, retry_after_s)
        super().__init__(f"{message}; retry in {self.retry_after_s * 1000:.0f} ms")

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((PUSHBACK_KEY, str(int(round(self.retry_after_s * 1000)))),)


def check_budget(field: str, costs: Sequence[float], limit_s: float, limit_name: str) -> float:
    """The total of ``costs`` (seconds); raises :class:`OverBudget` above ``limit_s``
    (``limit_s <= 0``: no budget)."""
    total = float(sum(costs))
    if limit_s > 0 and total > limit_s:
        fits, running = 0, 0.0
        for cost in costs:
            if running + cost > limit_s:
                break
            running += cost
            fits += 1
        raise OverBudget(field, total, limit_s, fits, limit_name)
    return total
