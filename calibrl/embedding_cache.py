"""A bounded, exact text -> vector cache per loaded sentence encoder, with hit/miss counters.

A vector is a pure function of (encoder, text) (``calibrl.embedding``), so a cached
vector is bitwise the vector a fresh forward pass would give: the cache changes how
fast a score comes back, never the score. One cache per loaded encoder (model folder,
device, backend), shared by every user of that encoder in the process: the retrieval
index, the judge's embedding criteria and the trainer's in-process rewards.

Other code reads the counters with :func:`embedding_cache_stats` (the servers' metrics
export them from there).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CACHE_SIZE = 16384  # texts per encoder; a MiniLM vector is 1.5 KiB, so about 25 MiB at most

_registry: dict[str, "EmbeddingCache"] = {}
_registry_lock = threading.Lock()


@dataclass(frozen=True)
class CacheStats:
    """Counters of one encoder's cache since the process started."""

    name: str
    hits: int
    misses: int
    size: int
    capacity: int

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0


class EmbeddingCache:
    """Least-recently-used text -> vector map of at most ``capacity`` entries (0: off).

    Stored vectors are read-only copies, so no caller can change what another gets.
    Thread-safe.
    """

    def __init__(self, name: str, capacity: int = DEFAULT_CACHE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"embedding cache capacity={capacity}: must be >= 0 (0 disables it)")
        self.name = name
        self.capacity = capacity
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> Any | None:
        """The cached vector of ``text``, or None (counted as a miss)."""
        with self._lock:
            vector = self._entries.get(text)
            if vector is None:
                self.misses += 1
                return None
            self._entries.move_to_end(text)
            self.hits += 1
            return vector

    def put(self, text: str, vector: Any) -> None:
        if self.capacity == 0:
            return
        stored = vector.copy()
        stored.setflags(write=False)
        with self._lock:
            self._entries[text] = stored
            self._entries.move_to_end(text)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` entries from now on (the most recently used stay)."""
        if capacity < 0:
            raise ValueError(f"embedding cache capacity={capacity}: must be >= 0 (0 disables it)")
        with self._lock:
            self.capacity = capacity
            while len(self._entries) > capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.name, self.hits, self.misses, len(self._entries), self.capacity)


def cache_for(name: str, capacity: int | None = None) -> EmbeddingCache:
    """The process's cache called ``name`` (one per loaded encoder), created on first use.

    ``capacity``: resize it to this many entries; None leaves it as it is
    (:data:`DEFAULT_CACHE_SIZE` for a new one).
    """
    with _registry_lock:
        cache = _registry.get(name)
        if cache is None:
            cache = _registry[name] = EmbeddingCache(name, DEFAULT_CACHE_SIZE if capacity is None else capacity)
            return cache
    if capacity is not None and capacity != cache.capacity:
        cache.resize(capacity)
    return cache


def embedding_cache_stats() -> list[CacheStats]:
    """Counters of every encoder cache in this process, by name (what metrics export)."""
    with _registry_lock:
        caches = sorted(_registry.values(), key=lambda c: c.name)
    return [cache.stats() for cache in caches]
