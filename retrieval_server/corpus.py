"""Corpus formats an index is built from, and the HotpotQA questions used to evaluate it.

Formats:
- ``beir``: a BEIR ``corpus.jsonl``, one object a line with ``_id``, ``title`` (may be
  empty) and ``text``.
- ``hotpotqa``: the IRCoT-style HotpotQA layout (one question a line with ``contexts``
  of ``title`` / ``paragraph_text``); the corpus is the union of every question's
  contexts and a passage's id is its title.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from calibrl.errors import InvalidArgument

CORPUS_FORMATS = ("beir", "hotpotqa")


@dataclass(frozen=True)
class Passage:
    """One retrievable unit of the corpus."""

    doc_id: str
    title: str
    text: str

    @property
    def full_text(self) -> str:
        """Title and text together: what BM25 indexes and what answers are looked for in."""
        return f"{self.title} {self.text}" if self.title else self.text

    @property
    def embedding_text(self) -> str:
        """What the sentence embedder sees for this passage."""
        return f"{self.title}. {self.text}" if self.title else self.text


@dataclass(frozen=True)
class HotpotQuestion:
    """A HotpotQA question with its two gold (supporting) passage titles."""

    question_id: str
    question: str
    answers: tuple[str, ...]
    gold_titles: tuple[str, ...]


def file_sha256(path: str | pathlib.Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def records_sha256(records: Iterable[Passage]) -> str:
    """SHA-256 of a canonical JSON-lines rendering of passages (for corpora built in memory)."""
    digest = hashlib.sha256()
    for passage in records:
        line = json.dumps({"_id": passage.doc_id, "title": passage.title, "text": passage.text}, sort_keys=True)
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def _json_lines(path: pathlib.Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{number}", f"not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise InvalidArgument(f"{path}:{number}", "expected a JSON object")
            yield number, row


def resolve_corpus_path(path: str | pathlib.Path, corpus_format: str) -> pathlib.Path:
    """The corpus file; for ``beir`` a dataset folder holding ``corpus.jsonl`` works too."""
    path = pathlib.Path(path)
    if corpus_format == "beir" and path.is_dir():
        path = path / "corpus.jsonl"
    if not path.is_file():
        raise InvalidArgument("corpus", f"{path} is not a file")
    return path


def read_beir_corpus(path: str | pathlib.Path) -> list[Passage]:
    """Passages of a BEIR ``corpus.jsonl``; ids must be unique and text non-empty."""
    path = resolve_corpus_path(path, "beir")
    passages: list[Passage] = []
    seen: set[str] = set()
    for number, row in _json_lines(path):
        where = f"{path}:{number}"
        if "_id" not in row:
            raise InvalidArgument(f"{where}._id", "missing (BEIR corpus lines need _id, title, text)")
        doc_id = str(row["_id"])
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(f"{where}.text", f"missing or empty for _id {doc_id!r}")
        title = row.get("title") or ""
        if not isinstance(title, str):
            raise InvalidArgument(f"{where}.title", f"expected a string, got {type(title).__name__}")
        if doc_id in seen:
            raise InvalidArgument(f"{where}._id", f"duplicate id {doc_id!r}")
        seen.add(doc_id)
        passages.append(Passage(doc_id, title, text))
    if not passages:
        raise InvalidArgument("corpus", f"{path} holds no passages")
    return passages


def read_hotpotqa_corpus(path: str | pathlib.Path) -> list[Passage]:
    """The union of every question's ``contexts``, first-seen order, id = title.

    A title seen twice with different text is an error: the title is the passage's
    identity, so two texts under one title would make gold ids ambiguous.
    """
    path = resolve_corpus_path(path, "hotpotqa")
    by_title: dict[str, Passage] = {}
    for number, row in _json_lines(path):
        contexts = row.get("contexts")
        if not isinstance(contexts, list):
            raise InvalidArgument(f"{path}:{number}.contexts", "missing (expected the HotpotQA IRCoT layout)")
        for position, context in enumerate(contexts):
            where = f"{path}:{number}.contexts[{position}]"
            title = context.get("title")
            text = context.get("paragraph_text")
            if not isinstance(title, str) or not title:
                raise InvalidArgument(f"{where}.title", "missing or empty")
            if not isinstance(text, str):
                raise InvalidArgument(f"{where}.paragraph_text", "missing")
            known = by_title.get(title)
            if known is None:
                by_title[title] = Passage(title, title, text)
            elif known.text != text:
                raise InvalidArgument(f"{where}.title", f"{title!r} appears with two different texts")
    if not by_title:
        raise InvalidArgument("corpus", f"{path} holds no contexts")
    return list(by_title.values())


def read_corpus(path: str | pathlib.Path, corpus_format: str) -> list[Passage]:
    if corpus_format == "beir":
        return read_beir_corpus(path)
    if corpus_format == "hotpotqa":
        return read_hotpotqa_corpus(path)
    raise InvalidArgument("format", f"unknown corpus format {corpus_format!r}; use one of {list(CORPUS_FORMATS)}")


def passages_from_dicts(records: Iterable[dict[str, Any]]) -> list[Passage]:
    """Passages from dicts with ``_id`` (or ``doc_id`` / ``id``), optional ``title`` and ``text``."""
    passages = []
    seen: set[str] = set()
    for position, record in enumerate(records):
        raw_id = record.get("_id", record.get("doc_id", record.get("id")))
        if raw_id is None:
            raise InvalidArgument(f"records[{position}]._id", "missing")
        doc_id = str(raw_id)
        if doc_id in seen:
            raise InvalidArgument(f"records[{position}]._id", f"duplicate id {doc_id!r}")
        text = record.get("text", "")
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(f"records[{position}].text", "missing or empty")
        seen.add(doc_id)
        passages.append(Passage(doc_id, str(record.get("title") or ""), text))
    if not passages:
        raise InvalidArgument("records", "no passages given")
    return passages


def read_hotpotqa_questions(path: str | pathlib.Path) -> list[HotpotQuestion]:
    """Questions of the HotpotQA layout: text, gold answers and the supporting titles."""
    questions = []
    for number, row in _json_lines(pathlib.Path(path)):
        answers: list[str] = []
        for answer in row.get("answers_objects", []):
            answers.extend(span for span in answer.get("spans", []) if span)
        gold = tuple(c["title"] for c in row.get("contexts", []) if c.get("is_supporting"))
        questions.append(
            HotpotQuestion(
                question_id=str(row.get("question_id", number)),
                question=row["question_text"],
                answers=tuple(answers),
                gold_titles=gold,
            )
        )
    return questions
