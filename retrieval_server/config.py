"""Configuration of the retrieval server (one dataclass, loaded with calibrl.config.load_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from calibrl.config import option
from calibrl.errors import ConfigError
from calibrl.serving import ServingConfig
from calibrl.retrieval_server.limits import RetrievalLimits
from calibrl.api.retrieval import SearchMode


@dataclass
class RetrievalServerConfig:
    """Everything `calibrl serve retrieval` needs; every field has a default but index_dir."""

    index_dir: str = option("", "Index folder built by `calibrl index build` (required).")
    default_mode: SearchMode = option(SearchMode.HYBRID, "Mode of requests that leave it unspecified.")
    max_top_k: int = option(100, "Largest top_k a request may ask for.")
    max_batch_size: int = option(256, "Most queries (Search) or items (ScoreRetrieval) in one request.")
    max_query_chars: int = option(2048, "Longest query accepted, in characters.")
    max_ids_per_item: int = option(1024, "Most gold ids, gold answers or seen ids in one ScoreItem.")
    max_ids_per_request: int = option(16384, "Most gold ids + seen ids, all items of one ScoreRetrieval together.")
    max_answers_per_request: int = option(
        2048, "Most gold answers, all items of one ScoreRetrieval together (each is matched against top_k passages).")
    max_id_chars: int = option(256, "Longest gold or seen doc id, in characters.")
    max_answer_chars: int = option(512, "Longest gold answer, in characters.")
    hybrid_depth: int = option(100, "Candidates taken from each of dense and BM25 before RRF (raised to max_top_k).")
    device: str = option("auto", "Embedder and torch-search device: auto (cuda when present), cpu, cuda, cuda:N.")
    dense_backend: Literal["auto", "faiss", "torch"] = option(
        "auto", "auto: the index's own type; torch: exact torch.topk search over the stored embeddings."
    )
    embedder: str = option("", "Local sentence-transformers folder overriding the manifest's embedder.")
    encode_batch_size: int = option(64, "Queries tokenised together (each is embedded alone or in an invariant group).")
    encoder_backend: Literal["auto", "torch", "onnx"] = option(
        "auto", "Query encoder: auto (the backend the index manifest records), torch or onnx; it must match the "
        "manifest's (docs/concepts/encoders.md).")
    embedding_cache_size: int = option(16384, "Query vectors kept in the exact LRU cache; 0 disables it.")
    torch_threads: int = option(
        0, "CPU threads of the embedder (torch.set_num_threads; ONNX Runtime uses as many) in `calibrl serve`; 0 keeps "
        "torch's default."
    )
    hnsw_ef_search: int = option(128, "HNSW search breadth (raised to at least max_top_k).")
    ivf_nprobe: int = option(16, "IVF cells visited per query.")
    verify_checksums: bool = option(True, "Check every index file against the manifest's sha256 at start.")
    batch_max_items: int = option(
        32, "Most queries in one batch: a large request is split, so other callers wait for at most one such batch.")
    batch_max_wait_ms: float = option(2.0, "How long the batcher waits for more callers before a batch runs.")
    batch_max_queue_items: int = option(4096, "Queued queries beyond which calls get RESOURCE_EXHAUSTED.")
    serving: ServingConfig = option(factory=ServingConfig, doc="Network settings (host, port, grace, sizes).")

    def limits(self) -> RetrievalLimits:
        return RetrievalLimits(
            max_top_k=self.max_top_k,
            max_batch_size=self.max_batch_size,
            max_query_chars=self.max_query_chars,
            max_ids_per_item=self.max_ids_per_item,
            max_ids_per_request=self.max_ids_per_request,
            max_answers_per_request=self.max_answers_per_request,
            max_id_chars=self.max_id_chars,
            max_answer_chars=self.max_answer_chars,
            max_request_cost_s=self.serving.max_request_cost_s,
        )

    def validate(self) -> None:
        if not self.index_dir:
            raise ConfigError("index_dir: required; pass --index DIR or index_dir=DIR")
        for name in ("max_top_k", "max_batch_size", "max_query_chars", "max_ids_per_item", "max_ids_per_request",
                     "max_answers_per_request", "max_id_chars", "max_answer_chars", "hybrid_depth",
                     "encode_batch_size", "hnsw_ef_search", "ivf_nprobe", "batch_max_items"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}={value}: must be >= 1")
        if self.encoder_backend == "onnx":
            from calibrl.embedding import check_onnx_installed

            check_onnx_installed("encoder_backend")
        if self.embedding_cache_size < 0:
            raise ConfigError(f"embedding_cache_size={self.embedding_cache_size}: must be >= 0 (0 disables it)")
        if self.torch_threads < 0:
            raise ConfigError(f"torch_threads={self.torch_threads}: must be >= 0 (0 keeps torch's default)")
        if self.batch_max_wait_ms < 0:
            raise ConfigError(f"batch_max_wait_ms={self.batch_max_wait_ms}: must be >= 0")
        if self.batch_max_queue_items < self.max_batch_size:
            raise ConfigError(
                f"batch_max_queue_items={self.batch_max_queue_items} < max_batch_size={self.max_batch_size}: "
                "a full request could never be queued; raise batch_max_queue_items"
            )
