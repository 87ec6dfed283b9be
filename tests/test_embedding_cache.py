"""The exact text -> vector cache of an encoder (calibrl.embedding_cache): bounded LRU,
counted hits and misses, cached vectors bitwise the computed ones and read-only."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import torch_threads_one

from calibrl.embedding import SentenceEmbedder
from calibrl.embedding_cache import EmbeddingCache, cache_for, embedding_cache_stats

one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


def test_lru_keeps_the_most_recently_used_and_counts():
    cache = EmbeddingCache("test-lru", capacity=2)
    a, b, c = (np.full(3, value, dtype=np.float32) for value in (1, 2, 3))
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", c)  # evicts b
    assert cache.get("b") is None and cache.get("c") is not None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.size, stats.capacity) == (2, 1, 2, 2)
    assert stats.hit_rate == pytest.approx(2 / 3)
    cache.resize(1)
    assert cache.stats().size == 1 and cache.get("c") is not None


def test_stored_vectors_are_copies_nobody_can_change():
    cache = EmbeddingCache("test-readonly", capacity=4)
    vector = np.ones(3, dtype=np.float32)
    cache.put("x", vector)
    vector[0] = 5.0  # the caller's array changes, the cached one does not
    stored = cache.get("x")
    assert stored.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        stored[0] = 2.0


def test_capacity_zero_stores_nothing_and_negative_is_refused():
    cache = EmbeddingCache("test-off", capacity=0)
    cache.put("x", np.ones(2, dtype=np.float32))
    assert cache.get("x") is None and cache.stats().size == 0
    with pytest.raises(ValueError, match="capacity=-1"):
        EmbeddingCache("bad", capacity=-1)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_encoder_cache_is_exact_and_shared_per_model(backend):
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    texts = ["who directed alien", "VTSAX expense ratio", "who directed alien", "iron tower in Paris"]
    embedder = SentenceEmbedder(None, device="cpu", backend=backend, cache_size=64)
    embedder.cache.clear()
    fresh = embedder.encode(texts, use_cache=False)
    before = embedder.cache.stats()
    first = embedder.encode(texts)  # all misses, fills the cache
    second = embedder.encode(list(reversed(texts)))  # all hits
    after = embedder.cache.stats()
    assert first.tobytes() == fresh.tobytes()
    assert second.tobytes() == fresh[::-1].tobytes()
    assert after.misses - before.misses == len(texts) and after.hits - before.hits == len(texts)
    assert after.size == 3
    other = SentenceEmbedder(None, device="cpu", backend=backend)  # another user of the same model: same cache
    assert other.cache is embedder.cache and other.cache.capacity == 64
    names = [s.name for s in embedding_cache_stats()]
    assert embedder.cache.name in names and embedder.cache.name.endswith(f"|{backend}|cpu")


def test_cache_for_resizes_only_when_asked():
    cache = cache_for("test-registry", 5)
    assert cache_for("test-registry") is cache and cache.capacity == 5
    assert cache_for("test-registry", 7).capacity == 7
