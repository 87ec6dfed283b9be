"""Reciprocal-rank fusion (Cormack, Clarke and Buettcher, SIGIR 2009).

A document's fused score is ``sum over rankings of 1 / (k + rank)`` with 1-based
ranks; a ranking that does not list the document contributes nothing. ``k = 60``
is the constant of the original paper and the project default.
"""

from __future__ import annotations

from typing import Sequence

RRF_K = 60


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], top_k: int, k: int = RRF_K
) -> list[tuple[int, float]]:
    """Fuse ranked lists of document indices into the best ``top_k`` (index, score) pairs.

    rankings: one list per ranker, best first, each without duplicates.
    Ties are broken by the best single rank the document reached, then by the
    lower index, so the result is deterministic.
    """
    if k <= 0:
        raise ValueError(f"rrf k must be > 0, got {k}")
    scores: dict[int, float] = {}
    best_rank: dict[int, int] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking, start=1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
            best_rank[doc] = min(best_rank.get(doc, rank), rank)
    ordered = sorted(scores, key=lambda doc: (-scores[doc], best_rank[doc], doc))
    return [(doc, scores[doc]) for doc in ordered[:top_k]]
