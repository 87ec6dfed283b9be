"""Reward signals of one query or search step, from its ranked hits."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from calibrl.text import normalize_answer
from calibrl.retrieval_server import metrics
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem


def score_hits(item: ScoreItem, hits: Sequence[Hit], top_k: int, include_text: bool = False) -> RetrievalScore:
    """Signals of ``item`` at cut-off ``top_k``.

    ``hits`` must carry their passage text (answers are looked for in title + text);
    the returned hits keep it only when ``include_text`` is set.
    """
    hits = list(hits[:top_k])
    ranked = [h.doc_id for h in hits]
    gold = set(item.gold_doc_ids)
    rank = metrics.first_gold_rank(ranked, gold, top_k)
    # each answer normalised once, not once per hit: the check is then top_k x answers substring tests
    needles = [f" {n} " for n in dict.fromkeys(normalize_answer(a) for a in item.gold_answers) if n]
    return RetrievalScore(
        hits=tuple(h if include_text else dataclasses.replace(h, text="") for h in hits),
        hit=rank > 0,
        all_gold=metrics.all_gold_at_k(ranked, gold, top_k),
        recall=metrics.recall_at_k(ranked, gold, top_k),
        mrr=metrics.reciprocal_rank(ranked, gold, top_k),
        ndcg=metrics.ndcg_at_k(ranked, gold, top_k),
        first_gold_rank=rank,
        is_new=tuple(metrics.new_flags(ranked, item.seen_doc_ids)),
        contains_answer=tuple(_contains_any(f"{h.title} {h.text}", needles) for h in hits),
        is_gold=tuple(metrics.gold_flags(ranked, gold)),
    )


def _contains_any(passage: str, needles: Sequence[str]) -> bool:
    """calibrl.text.contains_answer with the answers already normalised and padded."""
    if not needles:
        return False
    haystack = f" {normalize_answer(passage)} "
    return any(needle in haystack for needle in needles)
