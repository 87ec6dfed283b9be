"""The feedback JSONL the review page writes: one record per (item, reviewer), saved at once.

The file is the format ``calibrl rubric distill`` reads (:mod:`calibrl.judge_server.authoring.feedback`),
nothing added: a reviewer's answer to item ``rw-0012`` is the record with id
``rw-0012@alice``. Each answer rewrites the whole file through a temporary file,
``fsync`` and a rename (then an ``fsync`` of the folder), so a crash leaves the old
file or the new one, never half of one. A changed answer replaces the reviewer's
earlier record for that item, so distillation never sees an item twice from one
reviewer. Records of the file that are not answers to this sample (an id without
``@``, or an item this sample lacks) are kept, in place: nothing the user had is lost.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import threading
from dataclasses import dataclass
from typing import Sequence

from calibrl.errors import ConfigError
from calibrl.judge_server.authoring.feedback import FeedbackRecord, read_feedback

REVIEWER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
REVIEWER_RULE = "1-40 characters: letters, digits, '_', '.', '-' (starting with a letter or digit)"


def check_reviewer(name: str) -> str:
    """A reviewer name, stripped; :class:`ConfigError` naming the rule when it breaks it."""
    name = (name or "").strip()
    if not REVIEWER_PATTERN.match(name):
        raise ConfigError(f"reviewer {name!r}: must be {REVIEWER_RULE}")
    return name


def feedback_id(item_id: str, reviewer: str) -> str:
    return f"{item_id}@{reviewer}"


def split_feedback_id(record_id: str) -> tuple[str, str] | None:
    """(item id, reviewer) of an answer's id, or None for any other record."""
    item_id, at, reviewer = record_id.rpartition("@")
    if not at or not item_id or not REVIEWER_PATTERN.match(reviewer):
        return None
    return item_id, reviewer


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Replace ``path`` with ``text``: temporary file in the same folder, fsync, rename, fsync folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename is still atomic
        return
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


@dataclass(frozen=True)
class Answer:
    """One reviewer's answer to one item."""

    item_id: str
    reviewer: str
    record: FeedbackRecord


class FeedbackStore:
    """The answers of every reviewer, backed by one feedback JSONL (see module doc).

    Safe to call from the web server's threads: every method takes one lock.
    """

    def __init__(self, path: str | pathlib.Path, item_ids: Sequence[str]) -> None:
        self.path = pathlib.Path(path)
        self._item_ids = set(item_ids)
        self._lock = threading.Lock()
        # In file order: ("answer", (item, reviewer)) or ("kept", record); answers live in _answers.
        self._order: list[tuple[str, object]] = []
        self._answers: dict[tuple[str, str], FeedbackRecord] = {}
        if self.path.exists() and self.path.stat().st_size and self.path.read_text(encoding="utf-8").strip():
            for record in read_feedback(self.path):  # a malformed file stops the start, naming the line
                key = split_feedback_id(record.id)
                if key is None or key[0] not in self._item_ids:
                    self._order.append(("kept", record))
                elif key in self._answers:
                    raise ConfigError(f"{self.path}: two records with id {record.id!r}; keep one and restart")
                else:
                    self._answers[key] = record
                    self._order.append(("answer", key))

    def save(self, item_id: str, reviewer: str, record: FeedbackRecord) -> None:
        """Record (or replace) ``reviewer``'s answer to ``item_id`` and write the file before returning."""
        if item_id not in self._item_ids:
            raise ConfigError(f"item {item_id!r} is not in the sample")
        key = (item_id, check_reviewer(reviewer))
        with self._lock:
            if key not in self._answers:
                self._order.append(("answer", key))
            self._answers[key] = record
            self._write()

    def answer(self, item_id: str, reviewer: str) -> FeedbackRecord | None:
        with self._lock:
            return self._answers.get((item_id, reviewer))

    def answers(self) -> list[Answer]:
        with self._lock:
            return [Answer(key[0], key[1], record) for key, record in self._answers.items()]

    def reviewers(self) -> list[str]:
        with self._lock:
            return sorted({reviewer for _, reviewer in self._answers})

    def graded_by(self, reviewer: str) -> set[str]:
        with self._lock:
            return {item for item, who in self._answers if who == reviewer}

    def kept(self) -> list[FeedbackRecord]:
        """Records of the file that are not answers to this sample."""
        with self._lock:
            return [entry for kind, entry in self._order if kind == "kept"]  # type: ignore[misc]

    def _write(self) -> None:
        records = [self._answers[entry] if kind == "answer" else entry  # type: ignore[index]
                   for kind, entry in self._order]
        text = "".join(json.dumps(r.to_json(), sort_keys=True, ensure_ascii=False) + "\n" for r in records)
        atomic_write_text(self.path, text)
