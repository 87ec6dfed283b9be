"""gRPC adapter of the Retriever: calibrl.v1.RetrievalService.

The servicer validates each request on its own (so one caller's bad input never
fails another's batch), then hands its queries to a MicroBatcher keyed by mode:
the queries of concurrent Search and ScoreRetrieval calls share one embedding
pass and one index search at the largest top_k of the batch, and each request
is cut back to its own k. Each request's work is estimated first
(:func:`~calibrl.retrieval_server.limits.query_cost_s`) and refused above
``max_request_cost_s``; the batcher queues it for the call's tenant (API key, else
peer) in bounded units, fairly, and sheds what could not be served in time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from calibrl.admission import check_budget
from calibrl.batching import MicroBatcher
from calibrl.serving import rpc_errors, tenant_of_call, time_remaining
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.retrieval_server import limits as rules
from calibrl.api import retrieval_wire as wire
from calibrl.retrieval_server.retriever import Retriever
from calibrl.retrieval_server.signals import score_hits
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RetrievalService"].full_name


@dataclass(frozen=True)
class QueryWork:
    """One query of one request, as queued in the batcher."""

    query: str
    top_k: int
    item: ScoreItem | None = None  # set for ScoreRetrieval: signals are computed in the batch


def answer_batch(retriever: Retriever, mode: Hashable, work: Sequence[QueryWork]) -> list[list[Hit] | RetrievalScore]:
    """One ranking pass for every query of the batch at its largest k, then each cut to its own k.

    Rankings never depend on the k asked (see Retriever), so the cut equals a direct call.
    """
    assert isinstance(mode, SearchMode)
    largest_k = max(w.top_k for w in work)
    ranked = retriever.ranked([w.query for w in work], largest_k, mode)
    answers: list[list[Hit] | RetrievalScore] = []
    for w, hits in zip(work, ranked):
        if w.item is None:
            answers.append(hits[: w.top_k])
        else:
            answers.append(score_hits(w.item, hits, w.top_k, include_text=True))
    return answers


class RetrievalServicer(pb_grpc.RetrievalServiceServicer):
    """Translates protobuf <-> dataclasses; the work is done by the Retriever via the batcher."""

    def __init__(self, retriever: Retriever, batcher: MicroBatcher, max_request_bytes: int = 0) -> None:
        self.retriever = retriever
        self.batcher = batcher
        self.max_request_bytes = max_request_bytes  # the transport's limit, shown in IndexInfo

    @rpc_errors
    async def Search(self, request: pb.SearchRequest, context: Any) -> pb.SearchResponse:
        mode = wire.mode_from_proto(request.mode, self.retriever.default_mode)
        queries = list(request.queries)
        rules.check_search(queries, request.top_k, self.retriever.limits)
        costs = self._costs(mode, request.top_k, [(q, None) for q in queries], "queries")
        results = await self.batcher.submit(mode, [QueryWork(q, request.top_k) for q in queries],
                                            timeout_s=time_remaining(context), tenant=tenant_of_call(context),
                                            costs=costs)
        return pb.SearchResponse(results=[wire.hits_to_proto(hits, request.include_text) for hits in results])

    @rpc_errors
    async def ScoreRetrieval(self, request: pb.ScoreRetrievalRequest, context: Any) -> pb.ScoreRetrievalResponse:
        mode = wire.mode_from_proto(request.mode, self.retriever.default_mode)
        items = [wire.score_item_from_proto(message) for message in request.items]
        rules.check_score(items, request.top_k, self.retriever.limits)
        costs = self._costs(mode, request.top_k, [(i.query, i) for i in items], "items")
        scores = await self.batcher.submit(mode, [QueryWork(i.query, request.top_k, i) for i in items],
                                           timeout_s=time_remaining(context), tenant=tenant_of_call(context),
                                           costs=costs)
        return pb.ScoreRetrievalResponse(
            scores=[wire.retrieval_score_to_proto(score, request.include_text) for score in scores]
        )

    def _costs(self, mode: SearchMode, top_k: int, work: Sequence[tuple[str, ScoreItem | None]],
               field: str) -> list[float]:
        """Estimated seconds per query; the request is refused above the budget."""
        doc_count = self.retriever.doc_count
        costs = [rules.query_cost_s(query, top_k, mode, doc_count, item) for query, item in work]
        check_budget(field, costs, self.retriever.limits.max_request_cost_s, "max_request_cost_s")
        return costs

    @rpc_errors
    async def GetIndexInfo(self, request: pb.GetIndexInfoRequest, context: Any) -> pb.IndexInfo:
        manifest = self.retriever.manifest
        limits = self.retriever.limits
        return pb.IndexInfo(
            doc_count=manifest.doc_count,
            embedder=manifest.embedder,
            dimension=manifest.dimension,
            dense_index_type=self.retriever.dense_index_type,
            corpus_sha256=manifest.corpus_sha256,
            library_versions=manifest.library_versions,
            modes=[wire.mode_to_proto(m) for m in self.retriever.modes],
            default_mode=wire.mode_to_proto(self.retriever.default_mode),
            max_top_k=limits.max_top_k,
            max_batch_size=limits.max_batch_size,
            max_query_chars=limits.max_query_chars,
            max_ids_per_item=limits.max_ids_per_item,
            max_ids_per_request=limits.max_ids_per_request,
            max_answers_per_request=limits.max_answers_per_request,
            max_id_chars=limits.max_id_chars,
            max_answer_chars=limits.max_answer_chars,
            max_request_bytes=self.max_request_bytes,
            max_request_cost_s=limits.max_request_cost_s,
        )
