"""SME feedback: the JSONL records experts grade, read with line-numbered errors.

One JSON object a line::

    {"id": "fb-017",                          optional; stable id of the record
     "query": "vtsax expense ratio",          required; the user's query
     "output": "What is the expense ratio...",required; what the agent produced
     "retrieved_doc_ids": ["d12", "d7"],      optional
     "retrieved_texts": ["VTSAX has ..."],    optional
     "gold_doc_ids": ["d12"],                 optional
     "grade": 4,                              1..5; grade and/or verdict required
     "verdict": "pass",                       "pass" or "fail"
     "error_tags": ["missing_entity"],        optional, open set (normalised to snake_case)
     "notes": "dropped the ticker",           optional free text
     "context": {"domain": "funds"}}          optional string map, passed to the judge

When a record has no verdict, the expert's pass/fail is ``grade >= pass_grade``.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from calibrl.errors import ConfigError
from calibrl.json_types import JsonObject, JsonValue
from calibrl.judge_server.rubric import content_hash
from calibrl.api.judge import JudgeItem

_FIELDS = {
    "id", "query", "output", "retrieved_doc_ids", "retrieved_texts", "gold_doc_ids", "grade", "verdict",
    "error_tags", "notes", "context",
}


class FeedbackError(ConfigError):
    """A feedback file is malformed: ``file:line: field: problem``."""

    def __init__(self, source: str, line: int, field: str, problem: str) -> None:
        self.source, self.line, self.field, self.problem = source, line, field, problem
        super().__init__(f"{source}:{line}: {field}: {problem}")


def normalize_tag(tag: str) -> str:
    """``"Missing Entity"`` and ``"missing-entity"`` -> ``"missing_entity"``."""
    return re.sub(r"[^a-z0-9]+", "_", tag.strip().lower()).strip("_")


@dataclass(frozen=True)
class FeedbackRecord:
    query: str
    output: str
    grade: int | None = None
    verdict: str | None = None  # "pass" | "fail"
    error_tags: tuple[str, ...] = ()
    retrieved_doc_ids: tuple[str, ...] = ()
    retrieved_texts: tuple[str, ...] = ()
    gold_doc_ids: tuple[str, ...] = ()
    notes: str = ""
    context: tuple[tuple[str, str], ...] = ()
    id: str = ""

    def to_json(self) -> JsonObject:
        """Plain mapping (the JSONL form), optional fields left out when empty."""
        data: JsonObject = {"id": self.id, "query": self.query, "output": self.output}
        if self.grade is not None:
            data["grade"] = self.grade
        if self.verdict is not None:
            data["verdict"] = self.verdict
        for key in ("error_tags", "retrieved_doc_ids", "retrieved_texts", "gold_doc_ids"):
            if getattr(self, key):
                data[key] = list(getattr(self, key))
        if self.notes:
            data["notes"] = self.notes
        if self.context:
            data["context"] = dict(self.context)
        if not self.id:
            del data["id"]
        return data

    @property
    def record_hash(self) -> str:
        """SHA-256 of the record's canonical JSON: the key of the golden split."""
        return content_hash(self.to_json())

    def expert_pass(self, pass_grade: int = 4) -> bool:
        if self.verdict is not None:
            return self.verdict == "pass"
        assert self.grade is not None
        return self.grade >= pass_grade

    def to_item(self) -> JudgeItem:
        return JudgeItem.make(self.query, self.output, self.retrieved_texts, self.retrieved_doc_ids,
                              dict(self.context))


def strings_field(value: object, source: str, line: int, field: str,
                  error: type[ConfigError] | None = None) -> tuple[str, ...]:
    """A list-of-strings field of a JSONL record; ``error(source, line, field, problem)`` otherwise
    (default :class:`FeedbackError`)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise (error or FeedbackError)(source, line, field, f"expected a list of strings, got {value!r}")
    return tuple(value)


def jsonl_lines(path: pathlib.Path, error: type[ConfigError] | None = None) -> Iterator[tuple[int, JsonValue]]:
    """``(line number, decoded JSON)`` of each non-blank line of a JSONL file; a line that is not
    JSON raises ``error(source, line, "(json)", problem)`` (default :class:`FeedbackError`)."""
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            yield number, json.loads(text)
        except json.JSONDecodeError as exc:
            raise (error or FeedbackError)(str(path), number, "(json)",
                                           f"not valid JSON: {exc.msg} at column {exc.colno}") from None


def check_record_object(data: JsonValue, source: str, line: int, fields: set[str] | frozenset[str],
                        error: type[ConfigError] | None = None) -> JsonObject:
    """The checks every query/output JSONL record starts with (SME feedback, SME sample items):
    a JSON object, only known ``fields``, a non-empty string ``query`` and ``output``."""
    error = error or FeedbackError
    if not isinstance(data, dict):
        raise error(source, line, "(record)", f"expected a JSON object, got {type(data).__name__}")
    for key in data:
        if key not in fields:
            raise error(source, line, key, f"unknown field; valid fields: {sorted(fields)}")
    for key in ("query", "output"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise error(source, line, key, "required, a non-empty string")
    return data


def parse_record(data: JsonValue, source: str = "<feedback>", line: int = 1) -> FeedbackRecord:
    """Check one decoded JSON object and build its record."""
    data = check_record_object(data, source, line, _FIELDS)
    grade = data.get("grade")
    if grade is not None:
        if isinstance(grade, float) and grade.is_integer():
            grade = int(grade)
        if isinstance(grade, bool) or not isinstance(grade, int) or not 1 <= grade <= 5:
            raise FeedbackError(source, line, "grade", f"must be an integer 1..5, got {data['grade']!r}")
    verdict = data.get("verdict")
    if verdict is not None:
        if not isinstance(verdict, str) or verdict.strip().lower() not in ("pass", "fail"):
            raise FeedbackError(source, line, "verdict", f"must be 'pass' or 'fail', got {verdict!r}")
        verdict = verdict.strip().lower()
    if grade is None and verdict is None:
        raise FeedbackError(source, line, "grade", "a record needs a grade (1-5), a verdict (pass/fail) or both")
    tags = strings_field(data.get("error_tags", []), source, line, "error_tags")
    normalized = tuple(sorted({normalize_tag(t) for t in tags if normalize_tag(t)}))
    context = data.get("context", {}) or {}
    if not isinstance(context, dict) or not all(isinstance(v, str) for v in context.values()):
        raise FeedbackError(source, line, "context", f"expected an object of strings, got {context!r}")
    notes = data.get("notes", "") or ""
    if not isinstance(notes, str):
        raise FeedbackError(source, line, "notes", f"expected a string, got {notes!r}")
    record_id = data.get("id", "")
    if not isinstance(record_id, (str, int)) or isinstance(record_id, bool):
        raise FeedbackError(source, line, "id", f"expected a string, got {record_id!r}")
    return FeedbackRecord(
        query=data["query"],
        output=data["output"],
        grade=grade,
        verdict=verdict,
        error_tags=normalized,
        retrieved_doc_ids=strings_field(data.get("retrieved_doc_ids", []), source, line, "retrieved_doc_ids"),
        retrieved_texts=strings_field(data.get("retrieved_texts", []), source, line, "retrieved_texts"),
        gold_doc_ids=strings_field(data.get("gold_doc_ids", []), source, line, "gold_doc_ids"),
        notes=notes,
        context=tuple(sorted((str(k), v) for k, v in context.items())),
        id=str(record_id),
    )


def parse_field_map(text: str) -> dict[str, str]:
    """``"grade=score,output=rewrite"`` -> ``{"score": "grade", "rewrite": "output"}``: each pair names a
    documented field and the field another team's file holds it in (documented=theirs)."""
    mapping: dict[str, str] = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        ours, sep, theirs = (part.strip() for part in pair.partition("="))
        if not sep or not ours or not theirs:
            raise ConfigError(f"--field-map: {pair!r} is not DOCUMENTED=THEIRS (e.g. grade=score)")
        if ours not in _FIELDS:
            raise ConfigError(f"--field-map: {ours!r} is not a feedback field; valid fields: {sorted(_FIELDS)}")
        if theirs in mapping or ours in mapping.values():
            raise ConfigError(f"--field-map: {pair!r} maps a field twice")
        mapping[theirs] = ours
    return mapping


def rename_fields(data: JsonValue, field_map: dict[str, str], source: str, line: int) -> JsonValue:
    """One decoded record with another team's field names turned into the documented ones."""
    if not field_map or not isinstance(data, dict):
        return data
    renamed: JsonObject = {}
    for key, value in data.items():
        target = field_map.get(key, key)
        if target in renamed:
            raise FeedbackError(source, line, target, f"given twice (as {key!r} and under its documented name)")
        renamed[target] = value
    return renamed


def read_feedback(path: str | pathlib.Path, field_map: dict[str, str] | None = None) -> list[FeedbackRecord]:
    """All records of a JSONL file; blank lines are skipped; errors name the line. ``field_map``
    (from :func:`parse_field_map`) renames another team's fields to the documented ones first."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"feedback file {path} does not exist")
    records = [parse_record(rename_fields(data, field_map or {}, str(path), number), str(path), number)
               for number, data in jsonl_lines(path)]
    if not records:
        raise ConfigError(f"feedback file {path} has no records")
    return records


def write_feedback(path: str | pathlib.Path, records: Iterable[FeedbackRecord]) -> None:
    """Write records as canonical JSONL (sorted keys): same records, same bytes."""
    lines = [json.dumps(r.to_json(), sort_keys=True, ensure_ascii=False) for r in records]
    pathlib.Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
