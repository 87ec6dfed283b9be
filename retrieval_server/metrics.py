"""Retrieval metrics as small pure functions over a ranked list of ids.

Every function takes ``ranked_ids`` (best first, already cut to the k of
interest, or cut here by ``k``) and ``gold_ids`` (a collection; duplicates do
not count twice). Relevance is binary: a passage is gold or it is not.
Without gold ids every score is 0 / False: there is nothing to find, and the
caller decides what that means for a reward.
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Sequence


def _top(ranked_ids: Sequence[str], k: int | None) -> Sequence[str]:
    if k is not None and k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return ranked_ids if k is None else ranked_ids[:k]


def first_gold_rank(ranked_ids: Sequence[str], gold_ids: Collection[str], k: int | None = None) -> int:
    """1-based rank of the first gold id in the top k; 0 when there is none."""
    gold = set(gold_ids)
    for rank, doc_id in enumerate(_top(ranked_ids, k), start=1):
        if doc_id in gold:
            return rank
    return 0


def hit_at_k(ranked_ids: Sequence[str], gold_ids: Collection[str], k: int | None = None) -> bool:
    """At least one gold id in the top k."""
    return first_gold_rank(ranked_ids, gold_ids, k) > 0


def recall_at_k(ranked_ids: Sequence[str], gold_ids: Collection[str], k: int | None = None) -> float:
    """Share of the distinct gold ids found in the top k (0.0 without gold)."""
    gold = set(gold_ids)
    if not gold:
        return 0.0
    return len(gold.intersection(_top(ranked_ids, k))) / len(gold)


def all_gold_at_k(ranked_ids: Sequence[str], gold_ids: Collection[str], k: int | None = None) -> bool:
    """Every gold id in the top k (False without gold)."""
    gold = set(gold_ids)
    return bool(gold) and gold.issubset(_top(ranked_ids, k))


def reciprocal_rank(ranked_ids: Sequence[str], gold_ids: Collection[str], k: int | None = None) -> float:
    """1 / rank of the first gold id in the top k (0.0 when none); its mean over queries is MRR."""
    rank = first_gold_rank(ranked_ids, gold_ids, k)
    return 1.0 / rank if rank else 0.0


def ndcg_at_k(ranked_ids: Sequence[str], gold_ids: Collection[str], k: int | None = None) -> float:
    """nDCG@k with binary relevance: DCG = sum over gold hits of 1/log2(rank+1), divided by
    the DCG of an ideal list that puts min(#gold, k) gold ids first. 0.0 without gold.

    A gold id repeated in the ranking is credited once, at its best rank.
    """
    gold = set(gold_ids)
    top = _top(ranked_ids, k)
    if not gold:
        return 0.0
    credited: set[str] = set()
    dcg = 0.0
    for rank, doc_id in enumerate(top, start=1):
        if doc_id in gold and doc_id not in credited:
            credited.add(doc_id)
            dcg += 1.0 / math.log2(rank + 1)
    cutoff = len(top) if k is None else k
    ideal_hits = min(len(gold), cutoff)
    idcg = sum(1.0 / math.log2(rank + 1) for rank in range(1, ideal_hits + 1))
    return dcg / idcg if idcg else 0.0


def new_flags(ranked_ids: Sequence[str], seen_ids: Iterable[str]) -> list[bool]:
    """Per position: the id is neither among ``seen_ids`` nor earlier in the list."""
    seen = set(seen_ids)
    flags = []
    for doc_id in ranked_ids:
        flags.append(doc_id not in seen)
        seen.add(doc_id)
    return flags


def gold_flags(ranked_ids: Sequence[str], gold_ids: Collection[str]) -> list[bool]:
    """Per position: the id is gold."""
    gold = set(gold_ids)
    return [doc_id in gold for doc_id in ranked_ids]
