"""Configuration of a judge core (:class:`calibrl.judge_server.judge.Judge`), with or without gRPC.

The judge server's config (:class:`calibrl.judge_server.config.JudgeServerConfig`, section
``judge``) and the trainer's in-process judge (``services.inprocess_judge``) both hold one, so
it lives in the core, where the trainer can read it without importing the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from calibrl.config import option
from calibrl.embedding import check_onnx_installed
from calibrl.errors import ConfigError


@dataclass
class JudgeConfig:
    """What a :class:`calibrl.judge_server.judge.Judge` needs, with or without gRPC."""

    backend: str = option("programmatic", "Judge SPEC: programmatic | transformers:<model folder> | vllm:<model folder>.")
    allow_unvalidated: bool = option(
        False, "Serve rubrics without a passing validation record for this judge (logged loudly).")
    unvalidated_rubrics: list[str] = option(
        factory=list, doc="Rubric ids served without a passing validation record (logged loudly); "
        "allow_unvalidated serves every rubric.")
    embedder: Literal["minilm", "hashed-ngrams"] = option(
        "minilm", "Intent-similarity embedder; hashed-ngrams is a cheap surface-overlap fallback.")
    embedder_device: str = option("cpu", "Device of the sentence embedder.")
    embedder_backend: Literal["auto", "torch", "onnx"] = option(
        "auto", "MiniLM encoder: onnx (ONNX Runtime, texts grouped by padded length, self-tested at start; CPU only), torch "
        "(one text per forward pass), auto (onnx on the CPU, torch on a GPU). See docs/concepts/encoders.md.")
    embedder_cache_size: int = option(16384, "Texts whose MiniLM vector is kept in the exact LRU cache; 0 disables it.")
    llm_mode: Literal["prefix_cache", "flat", "generate"] = option(
        "prefix_cache", "transformers: shared-prefix KV reuse, one flat left-padded batch, or generate-and-parse.")
    device: str = option("auto", "transformers device: auto (cuda when available), cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", "Model dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.")
    max_items_per_forward: int = option(
        16, "Ignored since scores became batch-invariant (each item runs its own forward pass); kept so configs load.")
    max_docs: int = option(5, "Retrieved passages shown to an LLM judge, best first; 0: none.")
    max_doc_chars: int = option(600, "Characters of each retrieved passage shown to an LLM judge.")
    use_chat_template: Literal["auto", "true", "false"] = option(
        "auto", "Wrap judge prompts in the tokenizer's chat template (auto: when it has one).")
    max_new_tokens: int = option(4, "generate mode: tokens generated per answer.")
    vllm_tensor_parallel_size: int = option(1, "vllm: GPUs per model (tensor parallelism).")
    vllm_gpu_memory_utilization: float = option(0.85, "vllm: share of GPU memory for weights and KV cache.")
    vllm_batch_invariant: bool = option(
        True, "vllm: run with VLLM_BATCH_INVARIANT=1 so a score never depends on its batch (vLLM beta; slower).")
    cache_size: int = option(100_000, "Results kept in the in-memory LRU cache; 0 disables it.")
    cache_path: str = option("", "Optional SQLite file that persists cached results across restarts.")
    max_batch_size: int = option(256, "Most items in one Score request (RESOURCE_EXHAUSTED above).")
    max_text_chars: int = option(8000, "Longest query, output or retrieved text, in characters.")
    max_retrieved: int = option(50, "Most retrieved texts or ids per item.")
    max_id_chars: int = option(256, "Longest retrieved doc id, in characters.")
    max_context_entries: int = option(32, "Most context entries (key/value pairs) per item.")
    max_context_chars: int = option(8000, "Most characters of context per item, keys and values together.")
    max_request_chars: int = option(
        2_000_000, "Most characters in one Score request, every text, id and context entry of every item together.")
    llm_cost_per_item_s: float = option(
        0.0, "Estimated seconds one LLM criterion costs per item (added to the measured programmatic costs "
             "when a request is checked against max_request_cost_s); 0 counts LLM criteria as free.")

    def validate(self) -> None:
        # lazy: import cycle (judge_server.backends imports calibrl.api); the core imports no server at load
        from calibrl.judge_server.backends import parse_spec

        parse_spec(self.backend)
        if self.max_docs < 0:
            raise ConfigError(f"judge.max_docs={self.max_docs}: must be >= 0 (0 shows no retrieved passages)")
        for name in ("max_items_per_forward", "max_doc_chars", "max_new_tokens", "max_batch_size",
                     "max_text_chars", "max_retrieved", "max_id_chars", "max_context_entries", "max_context_chars",
                     "max_request_chars", "vllm_tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"judge.{name}={getattr(self, name)}: must be > 0")
        if self.embedder == "minilm" and (self.embedder_backend == "onnx" or (
                self.embedder_backend == "auto" and self.embedder_device.startswith("cpu"))):
            check_onnx_installed("judge.embedder_backend")
        if self.embedder_cache_size < 0:
            raise ConfigError(f"judge.embedder_cache_size={self.embedder_cache_size}: must be >= 0 (0 disables it)")
        if self.llm_cost_per_item_s < 0:
            raise ConfigError(f"judge.llm_cost_per_item_s={self.llm_cost_per_item_s}: must be >= 0")
        if self.cache_size < 0:
            raise ConfigError(f"judge.cache_size={self.cache_size}: must be >= 0 (0 disables the cache)")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ConfigError(f"judge.vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization}: "
                              "must be in (0, 1]")


__all__ = ["JudgeConfig"]
