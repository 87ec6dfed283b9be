"""Input rules of the retrieval service, checked before any work is queued.

Each violation raises a calibrl error whose message names the field and the limit:
InvalidArgument for malformed input (empty batch or query, top_k out of range,
unknown mode), ResourceExhausted for input over a size limit (batch, query
length, ids per item, ids or answers per request, id or answer length).

The limits bound the work of one request, not only its parts: ranking costs
one embedding pass and one BM25 pass over at most ``max_batch_size`` queries of
at most ``max_query_chars``; the answer check of ScoreRetrieval costs at most
``max_top_k`` passages x ``max_answers_per_request`` answers (each answer is
matched against the hits of its own item only); the id signals are set lookups
over at most ``max_ids_per_request`` ids.

Beyond the limits, every request's work is estimated before it is queued
(:func:`query_cost_s`, seconds of server time per query) and a request above
``max_request_cost_s`` is refused (:class:`calibrl.admission.OverBudget`). The
constants were measured with one torch thread on a shared 2-core host (load average
~5, so they err on the slow side) over the demo corpus (980 passages), by::

    python benchmarks/bench_tenants.py --only calibrate

- dense embedding (each query alone, MiniLM): 4 words 17-24 ms, 64 words (~455
  chars) 52-59 ms, 300 words (~1,900 chars) 175-182 ms per query;
- BM25: 0.07 ms (4 words) to 0.73 ms (300 words) per query at 980 passages, growing
  with the corpus; building hits: ~12 us per hit (300 words, top_k 1 -> 100: +1.2 ms);
- ScoreRetrieval's signals: ~10 us per hit (passages normalised) plus ~0.1 us per
  answer x hit (1 answer: 1.08 ms, 64 answers: 1.56 ms at top_k 100).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from calibrl.errors import InvalidArgument, ResourceExhausted
from calibrl.api.retrieval import ScoreItem, SearchMode

MODES = tuple(SearchMode)

PER_QUERY_S = 0.0001
DENSE_PER_QUERY_S = 0.015
DENSE_PER_CHAR_S = 85e-6
BM25_PER_QUERY_S = 0.0001
BM25_PER_CHAR_PER_1K_DOCS_S = 0.4e-6
PER_HIT_S = 12e-6
SCORE_PER_HIT_S = 10e-6
SCORE_PER_ANSWER_HIT_S = 0.1e-6


def query_cost_s(query: str, top_k: int, mode: SearchMode, doc_count: int, item: ScoreItem | None = None) -> float:
    """Estimated seconds of server time one query costs (see the module doc)."""
    cost = PER_QUERY_S + PER_HIT_S * top_k
    if mode in (SearchMode.DENSE, SearchMode.HYBRID):
        cost += DENSE_PER_QUERY_S + DENSE_PER_CHAR_S * len(query)
    if mode in (SearchMode.BM25, SearchMode.HYBRID):
        cost += BM25_PER_QUERY_S + BM25_PER_CHAR_PER_1K_DOCS_S * len(query) * max(1.0, doc_count / 1000)
    if item is not None:
        cost += top_k * (SCORE_PER_HIT_S + SCORE_PER_ANSWER_HIT_S * len(item.gold_answers))
    return cost


@dataclass(frozen=True)
class RetrievalLimits:
    """Request size limits (mirrored in IndexInfo)."""

    max_top_k: int = 100
    max_batch_size: int = 256
    max_query_chars: int = 2048
    max_ids_per_item: int = 1024
    max_ids_per_request: int = 16384
    max_answers_per_request: int = 2048
    max_id_chars: int = 256
    max_answer_chars: int = 512
    max_request_cost_s: float = 1.0


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
            values = getattr(item, name)
            if len(values) > limits.max_ids_per_item:
                raise ResourceExhausted(
                    f"items[{position}].{name}: {len(values)} entries, limit max_ids_per_item={limits.max_ids_per_item}"
                )
            longest, limit_name = ((limits.max_answer_chars, "max_answer_chars") if name == "gold_answers"
                                   else (limits.max_id_chars, "max_id_chars"))
            for index, value in enumerate(values):
                if len(value) > longest:
                    raise ResourceExhausted(
                        f"items[{position}].{name}[{index}]: {len(value)} characters, limit {limit_name}={longest}"
                    )
    ids = sum(len(item.gold_doc_ids) + len(item.seen_doc_ids) for item in items)
    if ids > limits.max_ids_per_request:
        raise ResourceExhausted(
            f"items[*].gold_doc_ids + seen_doc_ids: {ids} ids in one request, limit "
            f"max_ids_per_request={limits.max_ids_per_request}; split the batch"
        )
    answers = sum(len(item.gold_answers) for item in items)
    if answers > limits.max_answers_per_request:
        raise ResourceExhausted(
            f"items[*].gold_answers: {answers} answers in one request, limit "
            f"max_answers_per_request={limits.max_answers_per_request}; split the batch"
        )
    check_top_k(top_k, limits)
