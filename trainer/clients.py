"""The two interfaces the trainer receives (it never builds them itself).

Implementations:
- ``calibrl.trainer.grpc_clients``: async gRPC clients with deadlines, retries
  (tenacity, on UNAVAILABLE / DEADLINE_EXCEEDED) and bounded concurrency;
- ``calibrl.trainer.inprocess``: the same interfaces over an in-process ``Retriever``
  and ``Judge``, so the loop runs with no network (tests, the demo's ablations).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from calibrl.judge_server.types import ItemScore, JudgeItem
from calibrl.retrieval_server.types import Hit, RetrievalScore, ScoreItem, SearchMode


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
