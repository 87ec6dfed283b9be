"""The trainer's client interfaces over in-process cores: no network, no serialisation.

:class:`InProcessRetrievalClient` wraps a :class:`calibrl.retrieval_server.retriever.Retriever`
and :class:`InProcessJudgeClient` a :class:`calibrl.judge_server.judge.Judge`. Calls run in
a worker thread (``asyncio.to_thread``) so the event loop, and the other service's
call, keep going while an index or a judge model computes. The cores check their
inputs exactly as the servers do, so the same bad request raises the same
calibrl error in-process and over gRPC; like the gRPC clients, batches larger
than the core's ``max_batch_size`` are split into chunks.

Used by tests, by the demo's ablations, and by anyone who wants the training loop
without starting the services.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Sequence, TypeVar

from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.judge_server.judge import Judge
    from calibrl.trainer.clients import IndexInfo, RubricInfo
    from calibrl.retrieval_server.retriever import Retriever

T = TypeVar("T")


_NO_LIMIT = 1 << 30  # a core without a batch limit gets the whole batch at once


def _chunks(items: Sequence[T], size: int) -> list[list[T]]:
    return [list(items[start:start + size]) for start in range(0, len(items), size)]


class InProcessRetrievalClient:
    """RetrievalClient over a Retriever object (anything with ``search`` and ``score``)."""

    def __init__(self, retriever: "Retriever") -> None:
        self.retriever = retriever

    async def search(
        self, queries: Sequence[str], top_k: int, mode: SearchMode | None = None, include_text: bool = False
    ) -> list[list[Hit]]:
        results: list[list[Hit]] = []
        for part in _chunks(queries, self._batch_size()):
            results.extend(await asyncio.to_thread(self.retriever.search, part, top_k, mode, include_text))
        return results

    async def score(
        self, items: Sequence[ScoreItem], top_k: int, mode: SearchMode | None = None, include_text: bool = False
    ) -> list[RetrievalScore]:
        results: list[RetrievalScore] = []
        for part in _chunks(items, self._batch_size()):
            results.extend(await asyncio.to_thread(self.retriever.score, part, top_k, mode, include_text))
        return results

    def _batch_size(self) -> int:
        limits = getattr(self.retriever, "limits", None)
        return getattr(limits, "max_batch_size", 0) or _NO_LIMIT

    async def index_info(self) -> "IndexInfo":
        """The index and its limits, with the same keys as GrpcRetrievalClient.index_info()."""
        retriever = self.retriever
        manifest = retriever.manifest
        limits = retriever.limits
        return {
            "doc_count": retriever.doc_count,
            "embedder": manifest.embedder,
            "dimension": manifest.dimension,
            "dense_index_type": retriever.dense_index_type,
            "corpus_sha256": manifest.corpus_sha256,
            "library_versions": dict(manifest.library_versions),
            "modes": [SearchMode(m).value for m in retriever.modes],
            "default_mode": SearchMode(retriever.default_mode).value,
            "max_top_k": limits.max_top_k,
            "max_batch_size": limits.max_batch_size,
            "max_query_chars": limits.max_query_chars,
        }

    async def close(self) -> None:
        """Nothing to release; the retriever belongs to the caller."""


class InProcessJudgeClient:
    """JudgeClient over a Judge object (anything with ``score(rubric_id, items)``)."""

    def __init__(self, judge: "Judge") -> None:
        self.judge = judge

    async def score(self, rubric_id: str, items: Sequence[JudgeItem]) -> list[ItemScore]:
        config = getattr(self.judge, "config", None)
        size = getattr(config, "max_batch_size", 0) or _NO_LIMIT
        results: list[ItemScore] = []
        for part in _chunks(items, size):
            results.extend(await asyncio.to_thread(self.judge.score, rubric_id, part))
        return results

    async def list_rubrics(self) -> "list[RubricInfo]":
        """Same keys as GrpcJudgeClient.list_rubrics()."""
        return [
            {"id": s.rubric.id, "version": s.rubric.version, "hash": s.rubric.hash,
             "description": s.rubric.description, "num_criteria": len(s.rubric.criteria), "validated": s.validated}
            for s in self.judge.statuses()
        ]

    async def close(self) -> None:
        """Nothing to release; the judge belongs to the caller."""


__all__ = ["InProcessJudgeClient", "InProcessRetrievalClient"]
