"""The judge's result cache: (rubric hash, model id, item) -> scores.

An in-memory LRU in front of an optional SQLite file (which survives restarts and
can be shared by replicas on one host). GRPO asks for the same outputs again and
again (identical rollouts within a group, repeated evaluation sets); answering them
from the cache gives the same bits as computing them again: every backend scores an
item independently of its batch (see ``backends/hf.py`` and ``calibrl.embedding``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import sqlite3
import threading
from dataclasses import dataclass, replace

from calibrl.api.judge import CriterionScore, ItemScore, JudgeItem


# Bumped when the same (rubric, model, item) starts to score differently, so a cache
# file written before never answers for the new code. 2: batch-invariant scoring.
SCORING_VERSION = 2


def cache_key(rubric_hash: str, model_id: str, item: JudgeItem) -> str:
    payload = [SCORING_VERSION, rubric_hash, model_id, item.query, item.output, list(item.retrieved_texts),
               list(item.retrieved_doc_ids), [list(kv) for kv in item.context]]
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _encode(score: ItemScore) -> str:
    return json.dumps({"total": score.total, "criteria": [[c.name, c.score, c.weight, c.penalty]
                                                          for c in score.criteria]})


def _decode(text: str, rubric_id: str, rubric_hash: str, model_id: str) -> ItemScore:
    data = json.loads(text)
    criteria = tuple(CriterionScore(n, float(s), float(w), bool(p)) for n, s, w, p in data["criteria"])
    return ItemScore(criteria, float(data["total"]), rubric_id, rubric_hash, model_id, cached=True)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    disk_hits: int = 0


class ResultCache:
    """Thread-safe LRU of ``max_items`` entries (0 disables it), optionally backed by SQLite."""

    def __init__(self, max_items: int = 100_000, path: str | pathlib.Path | None = None) -> None:
        self.max_items = max_items
        self._memory: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self._db: sqlite3.Connection | None = None
        if path:
            path = pathlib.Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS scores (key TEXT PRIMARY KEY, value TEXT NOT NULL)")

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 or self._db is not None

    def get(self, key: str, rubric_id: str, rubric_hash: str, model_id: str) -> ItemScore | None:
        with self._lock:
            text = self._memory.get(key)
            if text is not None:
                self._memory.move_to_end(key)
            elif self._db is not None:
                row = self._db.execute("SELECT value FROM scores WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    text = row[0]
                    self.stats.disk_hits += 1
                    self._remember(key, text)
            if text is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
        return _decode(text, rubric_id, rubric_hash, model_id)

    def put(self, key: str, score: ItemScore) -> None:
        text = _encode(replace(score, cached=False))
        with self._lock:
            self._remember(key, text)
            if self._db is not None:
                self._db.execute("INSERT OR REPLACE INTO scores (key, value) VALUES (?, ?)", (key, text))

    def _remember(self, key: str, text: str) -> None:
        if self.max_items <= 0:
            return
        self._memory[key] = text
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_items:
            self._memory.popitem(last=False)

    def __len__(self) -> int:
        return len(self._memory)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
