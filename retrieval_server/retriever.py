"""The core of the retrieval service: a loaded index folder that ranks queries and scores them.

Plain Python, no gRPC: the servicer, the trainer's in-process client and the tests
all call :class:`Retriever` directly::

    retriever = Retriever.load("indexes/hotpotqa")
    hits = retriever.search(["who directed Alien?"], top_k=5, mode="hybrid")
    [score] = retriever.score([ScoreItem("who directed Alien?", gold_doc_ids=("Alien (film)",))], top_k=5)
    score.recall, score.ndcg, score.is_new

Rankings per mode: ``dense`` (inner product of unit embeddings), ``bm25``, and
``hybrid`` (reciprocal-rank fusion of the two, each ranking cut at a fixed depth
of max(hybrid_depth, max_top_k) candidates, so a query's fused order never
depends on the k it was asked with). Dense search also runs at that depth, with ties
ordered by passage index; with batch-invariant encoding and search
(``calibrl.embedding``, ``calibrl.retrieval_server.dense``), a query's hits and scores are a
pure function of (index, query, parameters), whatever it was batched with.
"""

from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING, Any, Sequence

from calibrl.retrieval_server import limits as rules
from calibrl.retrieval_server.corpus import Passage
from calibrl.retrieval_server.fusion import RRF_K, reciprocal_rank_fusion
from calibrl.retrieval_server.limits import RetrievalLimits
from calibrl.retrieval_server.manifest import Manifest, read_manifest, verify_files
from calibrl.retrieval_server.signals import score_hits
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode

if TYPE_CHECKING:
    from calibrl.retrieval_server.config import RetrievalServerConfig

log = logging.getLogger(__name__)

Ranking = list[tuple[int, float]]  # (passage index, score), best first


class Retriever:
    """Search and reward signals over one fixed index (see the module docstring)."""

    def __init__(
        self,
        passages: Sequence[Passage],
        dense: Any,
        bm25: Any,
        embedder: Any,
        manifest: Manifest,
        *,
        limits: RetrievalLimits = RetrievalLimits(),
        default_mode: SearchMode = SearchMode.HYBRID,
        hybrid_depth: int = 100,
        rrf_k: int = RRF_K,
        encode_batch_size: int = 64,
        index_dir: pathlib.Path | None = None,
    ) -> None:
        self.passages = list(passages)
        self.dense = dense
        self.bm25 = bm25
        self.embedder = embedder
        self.manifest = manifest
        self.limits = limits
        self.default_mode = SearchMode(default_mode)
        self.fusion_depth = max(hybrid_depth, limits.max_top_k)
        self.rrf_k = rrf_k
        self.encode_batch_size = encode_batch_size
        self.index_dir = index_dir

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        index_dir: str | pathlib.Path,
        *,
        limits: RetrievalLimits = RetrievalLimits(),
        default_mode: SearchMode | str = SearchMode.HYBRID,
        device: str = "auto",
        dense_backend: str = "auto",
        embedder: Any = None,
        encoder_backend: str = "auto",
        embedding_cache_size: int | None = None,
        verify: bool = True,
        hybrid_depth: int = 100,
        rrf_k: int = RRF_K,
        encode_batch_size: int = 64,
        hnsw_ef_search: int = 128,
        ivf_nprobe: int = 16,
    ) -> "Retriever":
        """Load an index folder, checking its files against the manifest first.

        embedder: an :class:`~calibrl.embedding.SentenceEmbedder`, a local model path
        overriding the one in the manifest, or None for the manifest's. encoder_backend:
        ``auto`` (the one the manifest records), ``torch`` or ``onnx``. embedding_cache_size:
        the query-vector cache's entries (None: as it is; 0: off).
        Raises FailedPrecondition when the folder does not match its manifest, or its
        passages were embedded by another encoder than the one that would embed queries.
        """
        from calibrl.errors import FailedPrecondition
        from calibrl.retrieval_server.dense import load_searcher
        from calibrl.embedding import resolve_device
        from calibrl.retrieval_server.index import read_docs
        from calibrl.retrieval_server.sparse import BM25_DIR, BM25Searcher

        index_dir = pathlib.Path(index_dir)
        manifest = read_manifest(index_dir)
        if verify:
            extra = verify_files(index_dir, manifest)
            if extra:
                log.warning("files in %s not listed in its manifest (ignored): %s", index_dir, extra)
        device = resolve_device(device)
        embedder = _query_embedder(index_dir, manifest, embedder, device=device, encoder_backend=encoder_backend,
                                   cache_size=embedding_cache_size)
        manifest = served_manifest(manifest, embedder)
        passages = read_docs(index_dir)
        bm25 = BM25Searcher(index_dir / BM25_DIR)
        if not len(passages) == bm25.doc_count == manifest.doc_count:
            raise FailedPrecondition(
                f"{index_dir}: {len(passages)} passages, {bm25.doc_count} in BM25, manifest says {manifest.doc_count}"
            )
        fusion_depth = max(hybrid_depth, limits.max_top_k)
        dense = load_searcher(
            index_dir,
            manifest.index_type,
            backend=dense_backend,
            device=device,
            ef_search=max(hnsw_ef_search, fusion_depth),  # >= every k asked: results never depend on k
            nprobe=ivf_nprobe,
        )
        return cls(
            passages,
            dense,
            bm25,
            embedder,
            manifest,
            limits=limits,
            default_mode=SearchMode(default_mode),
            hybrid_depth=hybrid_depth,
            rrf_k=rrf_k,
            encode_batch_size=encode_batch_size,
            index_dir=index_dir,
        )

    @classmethod
    def from_config(cls, config: "RetrievalServerConfig") -> "Retriever":
        return cls.load(
            config.index_dir,
            limits=config.limits(),
            default_mode=config.default_mode,
            device=config.device,
            dense_backend=config.dense_backend,
            embedder=config.embedder or None,
            encoder_backend=config.encoder_backend,
            embedding_cache_size=config.embedding_cache_size,
            verify=config.verify_checksums,
            hybrid_depth=config.hybrid_depth,
            encode_batch_size=config.encode_batch_size,
            hnsw_ef_search=config.hnsw_ef_search,
            ivf_nprobe=config.ivf_nprobe,
        )

    @property
    def doc_count(self) -> int:
        return len(self.passages)

    @property
    def dense_index_type(self) -> str:
        """What serves dense search: the manifest's type, or ``torch`` when that backend was chosen."""
        from calibrl.retrieval_server.dense import TorchSearcher

        return "torch" if isinstance(self.dense, TorchSearcher) else self.manifest.index_type

    @property
    def modes(self) -> tuple[SearchMode, ...]:
        return rules.MODES

    # --------------------------------------------------------------- public API
    def search(
        self, queries: Sequence[str], top_k: int = 10, mode: SearchMode | str | None = None, include_text: bool = False
    ) -> list[list[Hit]]:
        """Ranked hits per query, best first (at most ``top_k``; BM25 may return fewer)."""
        mode = rules.parse_mode(mode, self.default_mode)
        rules.check_search(queries, top_k, self.limits)
        return self.ranked(queries, top_k, mode, include_text=include_text)

    def score(
        self,
        items: Sequence[ScoreItem],
        top_k: int = 10,
        mode: SearchMode | str | None = None,
        include_text: bool = False,
    ) -> list[RetrievalScore]:
        """Reward signals per item at cut-off ``top_k`` (see retrieval.proto, RetrievalScore)."""
        mode = rules.parse_mode(mode, self.default_mode)
        rules.check_score(items, top_k, self.limits)
        ranked = self.ranked([item.query for item in items], top_k, mode)
        return [score_hits(item, hits, top_k, include_text) for item, hits in zip(items, ranked)]

    # ---------------------------------------------------------------- internals
    def ranked(self, queries: Sequence[str], top_k: int, mode: SearchMode, include_text: bool = True
               ) -> list[list[Hit]]:
        """Unchecked ranking (inputs already validated); hits carry their passage text unless
        ``include_text`` is False (each Hit is built once)."""
        if mode is SearchMode.DENSE:
            rankings = self._dense(queries, top_k)
        elif mode is SearchMode.BM25:
            rankings = self.bm25.search(queries, top_k)
        else:
            dense = self._dense(queries, self.fusion_depth)
            sparse = self.bm25.search(queries, self.fusion_depth)
            rankings = [
                reciprocal_rank_fusion([[i for i, _ in d], [i for i, _ in s]], top_k, self.rrf_k)
                for d, s in zip(dense, sparse)
            ]
        return [self._hits(ranking, include_text) for ranking in rankings]

    def _dense(self, queries: Sequence[str], k: int) -> list[Ranking]:
        """Top ``k`` per query. Searched at the fixed fusion depth whatever ``k`` (the server
        batches calls at their largest k) and ties ordered by passage index, so the order
        of equal scores (duplicate passages) never depends on k or on the backend's heap."""
        vectors = self.embedder.encode(queries, batch_size=self.encode_batch_size)
        scores, indices = self.dense.search(vectors, max(k, self.fusion_depth))
        rankings = []
        for row_indices, row_scores in zip(indices, scores):
            ranking = [(int(i), float(s)) for i, s in zip(row_indices, row_scores) if i >= 0]
            rankings.append(sorted(ranking, key=lambda hit: (-hit[1], hit[0]))[:k])
        return rankings

    def _hits(self, ranking: Ranking, include_text: bool = True) -> list[Hit]:
        passages = self.passages
        if include_text:
            return [Hit(doc_id=passages[i].doc_id, title=passages[i].title, score=score, rank=rank,
                        text=passages[i].text) for rank, (i, score) in enumerate(ranking, start=1)]
        return [Hit(doc_id=passages[i].doc_id, title=passages[i].title, score=score, rank=rank)
                for rank, (i, score) in enumerate(ranking, start=1)]


SERVED_ENCODER_KEY = "serving.encoder"  # in library_versions: GetIndexInfo reports it without a new field


def served_manifest(manifest: Manifest, embedder: Any) -> Manifest:
    """``manifest`` with what embeds the queries added to its library versions (in memory
    only): the backend, its runtime version and, on onnx, the start-up self-test's verdict,
    so a client reading GetIndexInfo sees whether groups or one text per pass run."""
    import dataclasses

    describe = getattr(embedder, "describe", None)
    if describe is None:
        return manifest
    return dataclasses.replace(manifest, library_versions={**manifest.library_versions,
                                                           SERVED_ENCODER_KEY: describe()})


def _query_embedder(index_dir: pathlib.Path, manifest: Any, embedder: Any, *, device: str, encoder_backend: str,
                    cache_size: int | None) -> Any:
    """The embedder of an index's queries (see :meth:`Retriever.load` for ``embedder``), checked to be
    the encoder that embedded its passages, with their dimension."""
    from calibrl.embedding import SentenceEmbedder
    from calibrl.errors import FailedPrecondition
    from calibrl.retrieval_server.manifest import check_encoder, manifest_backend

    if not isinstance(embedder, SentenceEmbedder):
        backend = manifest_backend(manifest) if encoder_backend == "auto" else encoder_backend
        embedder = SentenceEmbedder(embedder or manifest.embedder, device=device, backend=backend,
                                    cache_size=cache_size)
    elif cache_size is not None:
        embedder.cache.resize(cache_size)
    check_encoder(manifest, embedder.encoder_record(), index_dir)
    log.info("queries of %s are embedded by %s", index_dir, embedder.describe())
    if embedder.dimension != manifest.dimension:
        raise FailedPrecondition(
            f"embedder {embedder.label} makes {embedder.dimension}-d vectors, the index holds "
            f"{manifest.dimension}-d ones (built with {manifest.embedder})"
        )
    return embedder
