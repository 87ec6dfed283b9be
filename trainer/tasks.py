"""Training tasks: what a rollout is asked to do and what counts as correct.

A :class:`Task` is one item of a registered task kind (:mod:`calibrl.trainer.task_kinds`):
the built-in ``rewrite`` kind rewrites ``query`` so the index returns ``gold_doc_ids``;
the ``search`` kind answers ``query``, a question, with ``answers`` (``gold_doc_ids`` are
its supporting passages).

Task files are JSONL, one object a line (blank lines are skipped), in one of the record
formats the registered kinds read (:class:`~calibrl.trainer.task_kinds.RecordFormat`):
``rewrite`` and ``search`` (:mod:`calibrl.trainer.kinds` lists their keys) and
``hotpotqa`` (the IRCoT-formatted HotpotQA dev set); ``fmt="auto"`` picks the format
whose key the first record holds. The record helpers (:func:`record_text`,
:func:`record_strings`, :func:`record_context`) are what a format's parser reads fields with.

A bad line raises :class:`~calibrl.errors.InvalidArgument` naming ``file:line``
and the field; a missing or empty file raises :class:`~calibrl.errors.ConfigError`.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from calibrl.errors import ConfigError, InvalidArgument
from calibrl.trainer.task_kinds import TASK_KINDS, RecordFormat, record_formats, task_kind


@dataclass(frozen=True)
class Task:
    """One training or evaluation task."""

    task_id: str
    kind: str  # the name of a registered task kind (calibrl.trainer.task_kinds)
    query: str  # the user query (rewrite) or the question (search)
    gold_doc_ids: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    context: tuple[tuple[str, str], ...] = ()  # sorted key/value pairs passed to the judge

    def context_dict(self) -> dict[str, str]:
        return dict(self.context)


def load_tasks(path: str | pathlib.Path, kind: str | None = None, fmt: str = "auto") -> list[Task]:
    """Read tasks from a JSONL file.

    ``kind`` (None or a registered kind's name) chooses what the records become; None
    keeps the format's own kind (rewrite files -> rewrite tasks, search and HotpotQA
    files -> search tasks). Each task must have the fields its kind requires (a search
    task an answer, a rewrite task a gold document id).
    """
    formats = record_formats()
    if fmt != "auto" and fmt not in formats:
        raise InvalidArgument("fmt", f"{fmt!r} is not one of {['auto', *formats]}")
    if kind is not None and kind not in TASK_KINDS:
        raise InvalidArgument("kind", f"{kind!r} is not one of {list(TASK_KINDS)} (or None for the format's own kind)")
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"task file {path} does not exist")

    tasks: list[Task] = []
    seen_ids: dict[str, int] = {}
    line_format = None if fmt == "auto" else formats[fmt]
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
            if line_format is None:
                line_format = _detect_format(record, where, formats)
            task = _checked(line_format.parse(record, where), kind, where)
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


def _detect_format(record: Mapping[str, object], where: str, formats: dict[str, RecordFormat]) -> RecordFormat:
    """The format whose key ``record`` holds; when several do, the one registered last (the
    more specific: a HotpotQA record's ``question_text`` over a search record's ``question``)."""
    for candidate in reversed(formats.values()):
        if candidate.key in record:
            return candidate
    known = ", ".join(f"a {f.name} record {f.key!r}" for f in formats.values())
    raise InvalidArgument(
        where, f"cannot tell the task format from keys {sorted(record)}: {known} (or pass fmt=...)"
    )


def _checked(task: Task, kind: str | None, where: str) -> Task:
    """``task`` as a ``kind`` task (None keeps its format's kind), with the fields its kind requires."""
    if kind is not None and kind != task.kind:
        task = replace(task, kind=kind)
    for name, why in task_kind(task.kind).required.items():
        if not getattr(task, name):
            raise InvalidArgument(f"{where}: {name}", why)
    return task


def record_text(record: Mapping[str, object], key: str, where: str) -> str:
    """The non-empty string ``record[key]``, stripped (a numeric ``id`` is read as text)."""
    if key not in record:
        raise InvalidArgument(f"{where}: {key}", "missing")
    value = record[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key == "id":
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{where}: {key}", f"must be a non-empty string, got {value!r}")
    return value.strip()


def record_strings(record: Mapping[str, object], key: str, where: str, required: bool) -> tuple[str, ...]:
    """The list of non-empty strings ``record[key]``, stripped, duplicates dropped (order kept);
    () when an optional key is absent."""
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
    return tuple(dict.fromkeys(items))


def record_context(record: Mapping[str, object], where: str) -> tuple[tuple[str, str], ...]:
    """The optional flat ``context`` object of strings (numbers read as text), as sorted pairs."""
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


def with_context(record: dict[str, object], task: Task) -> dict[str, object]:
    """``record`` with the task's ``context`` object added when it has one (what a record writer keeps)."""
    if task.context:
        record["context"] = task.context_dict()
    return record


def write_tasks(tasks: Iterable[Task], path: str | pathlib.Path) -> None:
    """Write tasks as JSONL, each in its kind's own format (load_tasks reads them back unchanged)."""
    path = pathlib.Path(path)
    with path.open("w", encoding="utf-8") as out:
        for task in tasks:
            kind = task_kind(task.kind)
            if kind.write_record is None:
                raise InvalidArgument(f"task {task.task_id!r}", f"task kind {kind.name!r} has no record writer")
            out.write(json.dumps(kind.write_record(task), ensure_ascii=False) + "\n")


__all__ = ["Task", "load_tasks", "record_context", "record_strings", "record_text", "split_tasks", "with_context",
           "write_tasks"]
