"""protobuf <-> dataclass translation for the retrieval service, used by both the
servicer and the trainer's gRPC client (one place, so the two never drift)."""

from __future__ import annotations

from typing import Iterable

from calibrl.errors import InvalidArgument
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode

_MODE_TO_PB = {
    SearchMode.DENSE: pb.SEARCH_MODE_DENSE,
    SearchMode.BM25: pb.SEARCH_MODE_BM25,
    SearchMode.HYBRID: pb.SEARCH_MODE_HYBRID,
}
_PB_TO_MODE = {v: k for k, v in _MODE_TO_PB.items()}


def mode_to_proto(mode: SearchMode | None) -> int:
    return pb.SEARCH_MODE_UNSPECIFIED if mode is None else _MODE_TO_PB[SearchMode(mode)]


def mode_from_proto(value: int, default: SearchMode) -> SearchMode:
    """UNSPECIFIED -> ``default``; an unknown number -> InvalidArgument naming the field."""
    if value == pb.SEARCH_MODE_UNSPECIFIED:
        return default
    if value not in _PB_TO_MODE:
        raise InvalidArgument("mode", f"unknown search mode {value}; use DENSE (1), BM25 (2) or HYBRID (3)")
    return _PB_TO_MODE[value]


def hit_to_proto(hit: Hit, include_text: bool) -> pb.Hit:
    return pb.Hit(
        doc_id=hit.doc_id, title=hit.title, score=hit.score, rank=hit.rank, text=hit.text if include_text else ""
    )


def hit_from_proto(message: pb.Hit) -> Hit:
    return Hit(doc_id=message.doc_id, title=message.title, score=message.score, rank=message.rank, text=message.text)


def hits_to_proto(hits: Iterable[Hit], include_text: bool) -> pb.HitList:
    return pb.HitList(hits=[hit_to_proto(h, include_text) for h in hits])


def score_item_to_proto(item: ScoreItem) -> pb.ScoreItem:
    return pb.ScoreItem(
        query=item.query,
        gold_doc_ids=list(item.gold_doc_ids),
        gold_answers=list(item.gold_answers),
        seen_doc_ids=list(item.seen_doc_ids),
    )


def score_item_from_proto(message: pb.ScoreItem) -> ScoreItem:
    return ScoreItem(
        query=message.query,
        gold_doc_ids=tuple(message.gold_doc_ids),
        gold_answers=tuple(message.gold_answers),
        seen_doc_ids=tuple(message.seen_doc_ids),
    )


def retrieval_score_to_proto(score: RetrievalScore, include_text: bool) -> pb.RetrievalScore:
    return pb.RetrievalScore(
        hits=[hit_to_proto(h, include_text) for h in score.hits],
        hit=score.hit,
        all_gold=score.all_gold,
        recall=score.recall,
        mrr=score.mrr,
        ndcg=score.ndcg,
        first_gold_rank=score.first_gold_rank,
        is_new=list(score.is_new),
        contains_answer=list(score.contains_answer),
        is_gold=list(score.is_gold),
    )


def retrieval_score_from_proto(message: pb.RetrievalScore) -> RetrievalScore:
    return RetrievalScore(
        hits=tuple(hit_from_proto(h) for h in message.hits),
        hit=message.hit,
        all_gold=message.all_gold,
        recall=message.recall,
        mrr=message.mrr,
        ndcg=message.ndcg,
        first_gold_rank=message.first_gold_rank,
        is_new=tuple(message.is_new),
        contains_answer=tuple(message.contains_answer),
        is_gold=tuple(message.is_gold),
    )
