"""Training tasks: what a rollout is asked to do and what counts as correct.

A :class:`Task` is either a query-rewrite task (rewrite ``query`` so the index
returns ``gold_doc_ids``) or a multi-step search task (answer ``query``, a
question, with ``answers``; ``gold_doc_ids`` are its supporting passages).

Task files are JSONL, one object a line (blank lines are skipped):

- ``fmt="rewrite"``:  ``{"id", "query", "gold_doc_ids", ["answers"], ["context"]}``
  where ``context`` is a flat object of strings passed to the judge (e.g. ``domain``);
- ``fmt="search"``:   ``{"id", "question", "answers", "gold_doc_ids"}``;
- ``fmt="hotpotqa"``: the IRCoT-formatted HotpotQA dev set (``question_id``,
  ``question_text``, ``answers_objects[0].spans``, ``contexts`` whose supporting
  paragraphs' titles are the gold document ids);
- ``fmt="auto"`` picks one of the three from the first record's keys.

A bad line raises :class:`~calibrl.errors.InvalidArgument` naming ``file:line``
and the field; a missing or empty file raises :class:`~calibrl.errors.ConfigError`.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

from calibrl.errors import ConfigError, InvalidArgument

TaskKind = Literal["rewrite", "search"]
FORMATS = ("auto", "rewrite", "search", "hotpotqa")
KINDS = ("rewrite", "search")


@dataclass(frozen=True)
class Task:
    """One training or evaluation task."""

    task_id: str
    kind: TaskKind
    query: str  # the user query (rewrite) or the question (search)
    gold_doc_ids: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    context: tuple[tuple[str, str], ...] = ()  # sorted key/value pairs passed to the judge

    def context_dict(self) -> dict[str, str]:
        return dict(self.context)


def load_tasks(path: str | pathlib.Path, kind: str | None = None, fmt: str = "auto") -> list[Task]:
    """Read tasks from a JSONL file.

    ``kind`` (None, "rewrite" or "search") chooses what the records become; None
    keeps the format's own kind (rewrite files -> rewrite tasks, search and
    HotpotQA files -> search tasks). A search task needs at least one answer and a
    rewrite task at least one gold document id.
    """
    if fmt not in FORMATS:
        raise InvalidArgument("fmt", f"{fmt!r} is not one of {list(FORMATS)}")
    if kind is not None and kind not in KINDS:
        raise InvalidArgument("kind", f"{kind!r} is not one of {list(KINDS)} (or None for the format's own kind)")
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"task file {path} does not exist")

    tasks: list[Task] = []
    seen_ids: dict[str, int] = {}
    line_fmt = fmt
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(where, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise InvalidArgument(where, f"expected a JSON object, got {type(record).__name__}")
            if line_fmt == "auto":
                line_fmt = _detect_format(record, where)
            task = _PARSERS[line_fmt](record, where, kind)
            if task.task_id in seen_ids:
                raise InvalidArgument(
                    f"{where}: id", f"duplicate task id {task.task_id!r} (first at line {seen_ids[task.task_id]})"
                )
            seen_ids[task.task_id] = lineno
            tasks.append(task)
    if not tasks:
        raise ConfigError(f"task file {path} holds no tasks")
    return tasks


def split_tasks(tasks: Sequence[Task], heldout_fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """Deterministic train / held-out split.

    ``round(heldout_fraction * len(tasks))`` tasks (at least one when the fraction
    is positive and there are two or more tasks) are held out, chosen by a seeded
    shuffle; both parts keep the input order.
    """
    if not (isinstance(heldout_fraction, (int, float)) and 0.0 <= heldout_fraction < 1.0):
        raise InvalidArgument("heldout_fraction", f"{heldout_fraction!r} must be in [0, 1)")
    count = len(tasks)
    heldout_count = int(round(heldout_fraction * count))
    if heldout_fraction > 0 and heldout_count == 0 and count >= 2:
        heldout_count = 1
    heldout_count = min(heldout_count, max(count - 1, 0))
    order = list(range(count))
    random.Random(seed).shuffle(order)
    heldout_index = set(order[:heldout_count])
    train = [t for i, t in enumerate(tasks) if i not in heldout_index]
    heldout = [t for i, t in enumerate(tasks) if i in heldout_index]
    return train, heldout


# --- parsing ---------------------------------------------------------------------------------------------------------


def _detect_format(record: dict[str, Any], where: str) -> str:
    if "question_text" in record:
        return "hotpotqa"
    if "question" in record:
        return "search"
    if "query" in record:
        return "rewrite"
    raise InvalidArgument(
        where,
        f"cannot tell the task format from keys {sorted(record)}: a rewrite task has 'query', a search task "
        "'question', a HotpotQA record 'question_text' (or pass fmt=...)",
    )


def _text(record: dict[str, Any], key: str, where: str) -> str:
    if key not in record:
        raise InvalidArgument(f"{where}: {key}", "missing")
    value = record[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key == "id":
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{where}: {key}", f"must be a non-empty string, got {value!r}")
    return value.strip()


def _strings(record: dict[str, Any], key: str, where: str, required: bool) -> tuple[str, ...]:
    if key not in record:
        if required:
            raise InvalidArgument(f"{where}: {key}", "missing")
        return ()
    value = record[key]
    if isinstance(value, str) or not isinstance(value, list):
        raise InvalidArgument(f"{where}: {key}", f"must be a list of strings, got {value!r}")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise InvalidArgument(f"{where}: {key}[{i}]", f"must be a non-empty string, got {item!r}")
        items.append(item.strip())
    return tuple(dict.fromkeys(items))  # drop duplicates, keep order


def _context(record: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    value = record.get("context", {})
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: context", f"must be an object of strings, got {value!r}")
    pairs = []
    for key, item in value.items():
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise InvalidArgument(f"{where}: context.{key}", f"must be a string or a number, got {item!r}")
        pairs.append((str(key), str(item)))
    return tuple(sorted(pairs))


def _finish(task_id: str, kind: str, query: str, gold: tuple[str, ...], answers: tuple[str, ...],
            context: tuple[tuple[str, str], ...], where: str) -> Task:
    if kind == "search" and not answers:
        raise InvalidArgument(f"{where}: answers", "a search task needs at least one gold answer")
    if kind == "rewrite" and not gold:
        raise InvalidArgument(
            f"{where}: gold_doc_ids", "a rewrite task needs at least one gold document id (its retrieval target)"
        )
    return Task(task_id=task_id, kind=kind, query=query, gold_doc_ids=gold, answers=answers, context=context)  # type: ignore[arg-type]


def _parse_rewrite(record: dict[str, Any], where: str, kind: str | None) -> Task:
    return _finish(
        _text(record, "id", where),
        kind or "rewrite",
        _text(record, "query", where),
        _strings(record, "gold_doc_ids", where, required=True),
        _strings(record, "answers", where, required=False),
        _context(record, where),
        where,
    )


def _parse_search(record: dict[str, Any], where: str, kind: str | None) -> Task:
    return _finish(
        _text(record, "id", where),
        kind or "search",
        _text(record, "question", where),
        _strings(record, "gold_doc_ids", where, required=False),
        _strings(record, "answers", where, required=True),
        _context(record, where),
        where,
    )


def _parse_hotpotqa(record: dict[str, Any], where: str, kind: str | None) -> Task:
    task_id = _text(record, "question_id", where)
    question = _text(record, "question_text", where)
    answer_objects = record.get("answers_objects")
    if not isinstance(answer_objects, list) or not answer_objects or not isinstance(answer_objects[0], dict):
        raise InvalidArgument(f"{where}: answers_objects", f"must be a non-empty list of objects, got {answer_objects!r}")
    answers = _strings(answer_objects[0], "spans", f"{where}: answers_objects[0]", required=True)
    contexts = record.get("contexts")
    if not isinstance(contexts, list):
        raise InvalidArgument(f"{where}: contexts", f"must be a list of paragraphs, got {contexts!r}")
    gold: list[str] = []
    for i, paragraph in enumerate(contexts):
        if not isinstance(paragraph, dict) or not isinstance(paragraph.get("title"), str):
            raise InvalidArgument(f"{where}: contexts[{i}]", "must be an object with a string 'title'")
        if paragraph.get("is_supporting") is True:
            gold.append(paragraph["title"])
    return _finish(task_id, kind or "search", question, tuple(dict.fromkeys(gold)), answers, (), where)


_PARSERS = {"rewrite": _parse_rewrite, "search": _parse_search, "hotpotqa": _parse_hotpotqa}


def write_tasks(tasks: Iterable[Task], path: str | pathlib.Path) -> None:
    """Write tasks as JSONL in their kind's format (load_tasks reads them back unchanged)."""
    path = pathlib.Path(path)
    with path.open("w", encoding="utf-8") as out:
        for task in tasks:
            if task.kind == "rewrite":
                record: dict[str, Any] = {"id": task.task_id, "query": task.query,
                                          "gold_doc_ids": list(task.gold_doc_ids)}
                if task.answers:
                    record["answers"] = list(task.answers)
            else:
                record = {"id": task.task_id, "question": task.query, "answers": list(task.answers),
                          "gold_doc_ids": list(task.gold_doc_ids)}
            if task.context:
                record["context"] = dict(task.context)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


__all__ = ["Task", "TaskKind", "load_tasks", "split_tasks", "write_tasks"]
