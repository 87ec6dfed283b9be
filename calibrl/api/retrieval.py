"""Plain data types of the retrieval service, shared by the core, the gRPC
adapter (calibrl.api.retrieval_wire) and the trainer's clients."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SearchMode(str, enum.Enum):
    """How candidates are ranked (mirrors calibrl.v1.SearchMode)."""

    DENSE = "dense"
    BM25 = "bm25"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class Hit:
    """One retrieved passage at a 1-based rank."""

    doc_id: str
    title: str
    score: float
    rank: int
    text: str = ""


@dataclass(frozen=True)
class ScoreItem:
    """A query (or one search step) with what is known to be relevant."""

    query: str
    gold_doc_ids: tuple[str, ...] = ()
    gold_answers: tuple[str, ...] = ()
    seen_doc_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RetrievalScore:
    """Reward signals of one item at cut-off k (see RetrievalScore in retrieval.proto)."""

    hits: tuple[Hit, ...]
    hit: bool
    all_gold: bool
    recall: float
    mrr: float
    ndcg: float
    first_gold_rank: int  # 0 when no gold passage is in the top k
    is_new: tuple[bool, ...] = field(default=())
    contains_answer: tuple[bool, ...] = field(default=())
    is_gold: tuple[bool, ...] = field(default=())

    @property
    def doc_ids(self) -> list[str]:
        return [h.doc_id for h in self.hits]
