"""The two interfaces the trainer receives (it never builds them itself).

Implementations:
- ``calibrl.trainer.grpc_clients``: async gRPC clients with deadlines, retries
  (tenacity, on UNAVAILABLE / DEADLINE_EXCEEDED) and bounded concurrency;
- ``calibrl.trainer.inprocess``: the same interfaces over an in-process ``Retriever``
  and ``Judge``, so the loop runs with no network (tests, the demo's ablations).
"""

from __future__ import annotations

from typing import Protocol, Sequence, TypedDict

from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode


class IndexInfo(TypedDict):
    """What a retrieval client's ``index_info()`` returns (gRPC GetIndexInfo, or the in-process index)."""

    doc_count: int
    embedder: str
    dimension: int
    dense_index_type: str
    corpus_sha256: str
    library_versions: dict[str, str]
    modes: list[str]  # dense | bm25 | hybrid
    default_mode: str | None
    max_top_k: int
    max_batch_size: int
    max_query_chars: int


class RubricInfo(TypedDict):
    """One rubric of a judge client's ``list_rubrics()``."""

    id: str
    version: str
    hash: str
    description: str
    num_criteria: int
    validated: bool


class RetrievalClient(Protocol):
    async def search(
        self, queries: Sequence[str], top_k: int, mode: SearchMode | None = None, include_text: bool = False
    ) -> list[list[Hit]]:
        """Ranked hits per query, in order."""
        ...

    async def score(
        self, items: Sequence[ScoreItem], top_k: int, mode: SearchMode | None = None, include_text: bool = False
    ) -> list[RetrievalScore]:
        """Reward signals per item, in order."""
        ...


class JudgeClient(Protocol):
    async def score(self, rubric_id: str, items: Sequence[JudgeItem]) -> list[ItemScore]:
        """Rubric scores per item, in order."""
        ...
