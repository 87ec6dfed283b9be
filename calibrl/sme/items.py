"""The sample-input format: one JSON object a line, an item an expert may review.

``calibrl sme sample`` reads it, ``calibrl eval --sme-items FILE`` and the demo write
it, and the sample it writes is the same format (plus ``reasons``)::

    {"id": "rw-0012",                          optional; stable id (default: a hash of query + output)
     "query": "vtsax fees",                    required; the user's query or question
     "output": "VTSAX expense ratio",          required; what the agent produced
     "retrieved_doc_ids": ["d12", "d7"],       optional; in rank order
     "retrieved_texts": ["VTSAX has ..."],     optional; same order as the ids
     "gold_doc_ids": ["d12"],                  optional
     "signals": {"hit": 1, "mrr": 1.0},        optional; reward signals, numbers (hit: 1 or 0)
     "judge_total": 0.62,                      optional; a current judge's rubric total in [0, 1]
     "model": "step_100",                      optional; which model produced the output
     "context": {"domain": "funds"},           optional; string map, passed on to the feedback
     "reasons": ["..."]}                       written by the sampler: why the item was chosen
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable

from calibrl.errors import ConfigError
from calibrl.judge_server.authoring.feedback import check_record_object, jsonl_lines, strings_field

ITEM_FIELDS = frozenset({
    "id", "query", "output", "retrieved_doc_ids", "retrieved_texts", "gold_doc_ids", "signals", "judge_total",
    "model", "context", "reasons",
})
HIT_SIGNALS = ("hit", "hit@k")  # the signal names read as the retrieval outcome, in this order


class ItemError(ConfigError):
    """A sample-input file is malformed: ``file:line: field: problem``."""

    def __init__(self, source: str, line: int, field_name: str, problem: str) -> None:
        self.source, self.line, self.field, self.problem = source, line, field_name, problem
        super().__init__(f"{source}:{line}: {field_name}: {problem}")


@dataclass(frozen=True)
class SampleItem:
    """One item an expert may review (see the module doc for the JSON form)."""

    id: str
    query: str
    output: str
    retrieved_doc_ids: tuple[str, ...] = ()
    retrieved_texts: tuple[str, ...] = ()
    gold_doc_ids: tuple[str, ...] = ()
    signals: tuple[tuple[str, float], ...] = ()
    judge_total: float | None = None
    model: str = ""
    context: tuple[tuple[str, str], ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def outcome(self) -> str:
        """``hit`` / ``miss`` from the hit signal, else from gold vs retrieved ids, else ``unknown``."""
        signals = dict(self.signals)
        for name in HIT_SIGNALS:
            if name in signals:
                return "hit" if signals[name] > 0 else "miss"
        if self.gold_doc_ids and self.retrieved_doc_ids:
            return "hit" if set(self.gold_doc_ids) & set(self.retrieved_doc_ids) else "miss"
        return "unknown"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.id, "query": self.query, "output": self.output}
        for key in ("retrieved_doc_ids", "retrieved_texts", "gold_doc_ids", "reasons"):
            if getattr(self, key):
                data[key] = list(getattr(self, key))
        if self.signals:
            data["signals"] = dict(self.signals)
        if self.judge_total is not None:
            data["judge_total"] = self.judge_total
        if self.model:
            data["model"] = self.model
        if self.context:
            data["context"] = dict(self.context)
        return data


def default_item_id(query: str, output: str) -> str:
    digest = hashlib.sha256(json.dumps([query, output], ensure_ascii=False).encode("utf-8")).hexdigest()
    return f"item-{digest[:12]}"


def _strings(value: Any, source: str, line: int, name: str) -> tuple[str, ...]:
    return strings_field(value, source, line, name, ItemError)


def parse_item(data: Any, source: str = "<items>", line: int = 1) -> SampleItem:
    """Check one decoded JSON object and build its item."""
    data = check_record_object(data, source, line, ITEM_FIELDS, ItemError)
    item_id = data.get("id", "")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)):
        raise ItemError(source, line, "id", f"expected a string, got {item_id!r}")
    item_id = str(item_id) or default_item_id(data["query"], data["output"])
    if "@" in item_id:
        raise ItemError(source, line, "id", f"{item_id!r} contains '@', which separates item and reviewer "
                        "in feedback ids")
    signals = data.get("signals", {}) or {}
    if not isinstance(signals, dict):
        raise ItemError(source, line, "signals", f"expected an object of numbers, got {signals!r}")
    for name, value in signals.items():
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ItemError(source, line, f"signals.{name}", f"expected a finite number, got {value!r}")
    judge_total = data.get("judge_total")
    if judge_total is not None:
        if isinstance(judge_total, bool) or not isinstance(judge_total, (int, float)) or not 0.0 <= judge_total <= 1.0:
            raise ItemError(source, line, "judge_total", f"expected a number in [0, 1], got {judge_total!r}")
        judge_total = float(judge_total)
    context = data.get("context", {}) or {}
    if not isinstance(context, dict) or not all(isinstance(v, str) for v in context.values()):
        raise ItemError(source, line, "context", f"expected an object of strings, got {context!r}")
    model = data.get("model", "") or ""
    if not isinstance(model, str):
        raise ItemError(source, line, "model", f"expected a string, got {model!r}")
    retrieved_ids = _strings(data.get("retrieved_doc_ids", []), source, line, "retrieved_doc_ids")
    retrieved_texts = _strings(data.get("retrieved_texts", []), source, line, "retrieved_texts")
    if retrieved_texts and len(retrieved_texts) != len(retrieved_ids):
        raise ItemError(source, line, "retrieved_texts",
                        f"{len(retrieved_texts)} texts for {len(retrieved_ids)} retrieved_doc_ids; give one per id")
    return SampleItem(
        id=item_id,
        query=data["query"],
        output=data["output"],
        retrieved_doc_ids=retrieved_ids,
        retrieved_texts=retrieved_texts,
        gold_doc_ids=_strings(data.get("gold_doc_ids", []), source, line, "gold_doc_ids"),
        signals=tuple(sorted((str(k), float(v)) for k, v in signals.items())),
        judge_total=judge_total,
        model=model,
        context=tuple(sorted((str(k), v) for k, v in context.items())),
        reasons=_strings(data.get("reasons", []), source, line, "reasons"),
    )


def read_items(path: str | pathlib.Path) -> list[SampleItem]:
    """All items of a JSONL file; blank lines skipped; errors name the line; ids must be unique."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"items file {path} does not exist")
    items: list[SampleItem] = []
    seen: dict[str, int] = {}
    for number, data in jsonl_lines(path, ItemError):
        item = parse_item(data, str(path), number)
        if item.id in seen:
            raise ItemError(str(path), number, "id", f"{item.id!r} already used on line {seen[item.id]}")
        seen[item.id] = number
        items.append(item)
    if not items:
        raise ConfigError(f"items file {path} has no items")
    return items


def write_items(path: str | pathlib.Path, items: Iterable[SampleItem]) -> None:
    """Write items as JSONL (sorted keys), through a temporary file and a rename."""
    from calibrl.sme.store import atomic_write_text

    lines = [json.dumps(item.to_json(), sort_keys=True, ensure_ascii=False) for item in items]
    atomic_write_text(pathlib.Path(path), "".join(line + "\n" for line in lines))
