"""Input rules of the retrieval service, checked before any work is queued.

Each violation raises a calibrl error whose message names the field and the limit:
InvalidArgument for malformed input (empty batch or query, top_k out of range,
unknown mode), ResourceExhausted for input over a size limit (batch, query
length, ids per item).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from calibrl.errors import InvalidArgument, ResourceExhausted
from retrieval_server.types import ScoreItem, SearchMode

MODES = tuple(SearchMode)


@dataclass(frozen=True)
class RetrievalLimits:
    """Request size limits (mirrored in IndexInfo)."""

    max_top_k: int = 100
    max_batch_size: int = 256
    max_query_chars: int = 2048
    max_ids_per_item: int = 1024


def parse_mode(mode: SearchMode | str | None, default: SearchMode) -> SearchMode:
    """None -> ``default``; a SearchMode or its name (``dense``, ``bm25``, ``hybrid``)."""
    if mode is None or mode == "":
        return default
    try:
        return SearchMode(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise InvalidArgument("mode", f"unknown mode {mode!r}; use one of {[m.value for m in MODES]}") from None


def check_top_k(top_k: int, limits: RetrievalLimits) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise InvalidArgument("top_k", f"must be an integer in 1..{limits.max_top_k}, got {top_k!r}")
    if not 1 <= top_k <= limits.max_top_k:
        raise InvalidArgument("top_k", f"must be in 1..{limits.max_top_k} (max_top_k), got {top_k}")


def _check_batch(size: int, field: str, limits: RetrievalLimits) -> None:
    if size == 0:
        raise InvalidArgument(field, "empty batch; send at least one")
    if size > limits.max_batch_size:
        raise ResourceExhausted(
            f"{field}: {size} in one request, limit max_batch_size={limits.max_batch_size}; split the batch"
        )


def _check_query(query: object, field: str, limits: RetrievalLimits) -> None:
    if not isinstance(query, str):
        raise InvalidArgument(field, f"expected a string, got {type(query).__name__}")
    if not query.strip():
        raise InvalidArgument(field, "empty query")
    if len(query) > limits.max_query_chars:
        raise ResourceExhausted(
            f"{field}: {len(query)} characters, limit max_query_chars={limits.max_query_chars}"
        )


def check_search(queries: Sequence[str], top_k: int, limits: RetrievalLimits) -> None:
    """Validate a Search request (mode is checked by :func:`parse_mode`)."""
    _check_batch(len(queries), "queries", limits)
    for position, query in enumerate(queries):
        _check_query(query, f"queries[{position}]", limits)
    check_top_k(top_k, limits)


def check_score(items: Sequence[ScoreItem], top_k: int, limits: RetrievalLimits) -> None:
    """Validate a ScoreRetrieval request."""
    _check_batch(len(items), "items", limits)
    for position, item in enumerate(items):
        if not isinstance(item, ScoreItem):
            raise InvalidArgument(f"items[{position}]", f"expected a ScoreItem, got {type(item).__name__}")
        _check_query(item.query, f"items[{position}].query", limits)
        for name in ("gold_doc_ids", "gold_answers", "seen_doc_ids"):
            count = len(getattr(item, name))
            if count > limits.max_ids_per_item:
                raise ResourceExhausted(
                    f"items[{position}].{name}: {count} entries, limit max_ids_per_item={limits.max_ids_per_item}"
                )
    check_top_k(top_k, limits)
