"""Rubrics: the YAML file format, its checks, and its content hash.

A rubric file::

    id: query-rewriter            # letters, digits, . _ -
    version: "3"
    description: Rewrites of fund questions, distilled from 120 SME grades.
    instructions: ...             # optional preamble of every LLM judge prompt
    glossary: [VTSAX, expense ratio]   # optional domain terms (entity criteria)
    glossary_file: glossary.txt   # optional, relative to this file, one term a line
    tenants: [team-a]             # optional; see Rubric.visible_to
    criteria:
      - name: intent
        kind: programmatic        # or llm
        scorer: intent_similarity # programmatic: a scorer of calibrl.judge_server.programmatic
        params: {floor: 0.3}      # its parameters (defaults filled in)
        weight: 0.4
        severity: 1.6             # SME grade cost the weight came from
        penalty: false            # true: a critical penalty (see types.aggregate)
        tags: [missed_intent]     # SME error tags this criterion detects
      - name: intent_llm
        kind: llm
        question: Does the rewrite keep the intent of the user's query?
        scale: yes_no             # or likert_1_5
        good_answer: "yes"        # yes_no only: which answer means "criterion met"
        weight: 0.2

A malformed file fails at load with :class:`RubricError` naming the file, the line
and the field. The rubric's identity is :attr:`Rubric.hash`: the SHA-256 of a
canonical JSON serialisation of everything that decides scores (id, version,
description, instructions, the resolved glossary, the criteria with defaults filled
in). ``tenants`` is access control, not judging content, so it is left out of the
hash: granting a team access does not invalidate a validation record.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import pathlib
import re
from dataclasses import dataclass, field
from typing import Literal

import yaml

from calibrl.errors import ConfigError
from calibrl.json_types import JsonObject, JsonValue
from calibrl.judge_server import programmatic

CriterionKind = Literal["llm", "programmatic"]
Scale = Literal["yes_no", "likert_1_5"]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class RubricError(ConfigError):
    """A rubric file is malformed. ``str()`` reads ``file:line: field: problem``."""

    def __init__(self, source: str, line: int | None, field: str, problem: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        self.problem = problem
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {field}: {problem}")


@dataclass(frozen=True)
class Criterion:
    """One rubric criterion; scores in [0, 1], 1 = met (for a penalty: no violation)."""

    name: str
    kind: CriterionKind
    weight: float
    severity: float = 0.0
    penalty: bool = False
    question: str = ""
    scale: Scale = "yes_no"
    good_answer: Literal["yes", "no"] = "yes"
    scorer: str = ""
    params: dict[str, JsonValue] = field(default_factory=dict, hash=False, compare=True)
    tags: tuple[str, ...] = ()

    def canonical(self) -> JsonObject:
        data: JsonObject = {
            "name": self.name,
            "kind": self.kind,
            "weight": float(self.weight),
            "severity": float(self.severity),
            "penalty": self.penalty,
            "tags": list(self.tags),
        }
        if self.kind == "llm":
            data.update(question=self.question, scale=self.scale)
            if self.scale == "yes_no":
                data["good_answer"] = self.good_answer
            if self.params:
                data["params"] = self.params
        else:
            data.update(scorer=self.scorer, params=programmatic.full_params(self.scorer, self.params))
        return data


@dataclass(frozen=True)
class Rubric:
    id: str
    version: str
    description: str
    criteria: tuple[Criterion, ...]
    instructions: str = ""
    glossary: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    source_path: str = ""
    source_yaml: str = ""

    def canonical(self) -> JsonObject:
        """Everything that decides scores, defaults filled in (the hashed content)."""
        return {
            "id": self.id,
            "version": self.version,
            "description": self.description,
            "instructions": self.instructions,
            "glossary": list(self.glossary),
            "criteria": [c.canonical() for c in self.criteria],
        }

    @functools.cached_property
    def hash(self) -> str:
        return content_hash(self.canonical())

    @property
    def llm_criteria(self) -> tuple[Criterion, ...]:
        return tuple(c for c in self.criteria if c.kind == "llm")

    def visible_to(self, tenant: str | None) -> bool:
        """``tenant`` None means no authentication is configured: everything is visible.
        Otherwise a rubric is visible to the tenants it lists ("*" = every tenant); a
        rubric that lists none belongs to no tenant and is hidden from all of them."""
        if tenant is None:
            return True
        return tenant in self.tenants or "*" in self.tenants


def content_hash(data: JsonValue) -> str:
    """SHA-256 of the canonical JSON of ``data`` (sorted keys, no spaces, UTF-8)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- loading

def _node_lines(node: yaml.Node, path: tuple = (), lines: dict | None = None) -> dict[tuple, int]:
    """Map every path (keys and indices) of a composed YAML document to its 1-based line."""
    lines = {} if lines is None else lines
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            lines[path + (key,)] = key_node.start_mark.line + 1
            _node_lines(value_node, path + (key,), lines)
            lines[path + (key,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, child in enumerate(node.value):
            _node_lines(child, path + (index,), lines)
    return lines


def _field_name(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


class _Checker:
    def __init__(self, source: str, lines: dict[tuple, int]) -> None:
        self.source = source
        self.lines = lines

    def fail(self, path: tuple, problem: str) -> RubricError:
        probe = path
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return RubricError(self.source, self.lines.get(probe), _field_name(path), problem)

    def mapping(self, value: object, path: tuple, allowed: set[str], required: set[str]) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(allowed)}"
                raise self.fail(path + (key,), f"unknown key{hint}")
        for key in sorted(required - set(value)):
            raise self.fail(path, f"missing required key {key!r}")
        return value

    def string(self, value: object, path: tuple, *, pattern: re.Pattern | None = None, empty: bool = True) -> str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {value!r}")
        if not empty and not value.strip():
            raise self.fail(path, "must not be empty")
        if pattern is not None and not pattern.match(value):
            raise self.fail(path, f"{value!r} must match {pattern.pattern}")
        return value

    def number(self, value: object, path: tuple, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {value!r}")
        if not low <= value <= high or value != value:
            raise self.fail(path, f"must be in [{low}, {high}], got {value!r}")
        return float(value)

    def strings(self, value: object, path: tuple) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list of strings, got {value!r}")
        return tuple(self.string(v, path + (i,), empty=False) for i, v in enumerate(value))

    def boolean(self, value: object, path: tuple) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {value!r}")
        return value

    def choice(self, value: object, path: tuple, options: tuple[str, ...]) -> str:
        if isinstance(value, bool) and "yes" in options:
            value = "yes" if value else "no"  # YAML 1.1 reads an unquoted yes/no as a boolean
        if value not in options:
            raise self.fail(path, f"{value!r} is not one of {list(options)}")
        return value


_RUBRIC_KEYS = {"id", "version", "description", "instructions", "glossary", "glossary_file", "tenants", "criteria"}
_CRITERION_KEYS = {
    "name", "kind", "weight", "severity", "penalty", "question", "scale", "good_answer", "scorer", "params", "tags",
}


def _criterion(check: _Checker, raw: object, path: tuple) -> Criterion:
    data = check.mapping(raw, path, _CRITERION_KEYS, {"name", "kind", "weight"})
    name = check.string(data["name"], path + ("name",), pattern=_NAME)
    kind = check.choice(data["kind"], path + ("kind",), ("llm", "programmatic"))
    weight = check.number(data["weight"], path + ("weight",), 0.0, 1e6)
    severity = check.number(data.get("severity", 0.0), path + ("severity",), 0.0, 1e6)
    penalty = check.boolean(data.get("penalty", False), path + ("penalty",))
    tags = check.strings(data.get("tags", []), path + ("tags",))
    params = data.get("params", {}) or {}
    if not isinstance(params, dict):
        raise check.fail(path + ("params",), f"expected a mapping, got {params!r}")
    if kind == "llm":
        for key in ("scorer",):
            if key in data:
                raise check.fail(path + (key,), "only programmatic criteria name a scorer")
        if "question" not in data:
            raise check.fail(path, "an llm criterion needs a 'question'")
        question = check.string(data["question"], path + ("question",), empty=False)
        scale = check.choice(data.get("scale", "yes_no"), path + ("scale",), ("yes_no", "likert_1_5"))
        good = check.choice(data.get("good_answer", "yes"), path + ("good_answer",), ("yes", "no"))
        if scale != "yes_no" and "good_answer" in data:
            raise check.fail(path + ("good_answer",), "only yes_no questions have a good_answer")
        return Criterion(name, "llm", weight, severity, penalty, question=question, scale=scale,
                         good_answer=good, params=dict(params), tags=tags)
    for key in ("question", "scale", "good_answer"):
        if key in data:
            raise check.fail(path + (key,), "only llm criteria have a question, scale or good_answer")
    if "scorer" not in data:
        raise check.fail(path, f"a programmatic criterion needs a 'scorer' (one of {sorted(programmatic.SCORERS)})")
    scorer = check.string(data["scorer"], path + ("scorer",))
    if scorer not in programmatic.SCORERS:
        close = difflib.get_close_matches(scorer, sorted(programmatic.SCORERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise check.fail(path + ("scorer",), f"unknown scorer {scorer!r}{hint} (known: {sorted(programmatic.SCORERS)})")
    problem = programmatic.check_params(scorer, params)
    if problem:
        raise check.fail(path + ("params",), problem)
    return Criterion(name, "programmatic", weight, severity, penalty, scorer=scorer, params=dict(params), tags=tags)


def parse_rubric(text: str, source: str = "<rubric>", base_dir: pathlib.Path | None = None) -> Rubric:
    """Parse and check rubric YAML ``text``; errors name ``source``, the line and the field."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        raise RubricError(source, line, "(syntax)", f"not valid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise RubricError(source, None, "(syntax)", f"not valid YAML: {exc}") from None
    if node is None:
        raise RubricError(source, 1, "(top level)", "the file is empty")
    check = _Checker(source, _node_lines(node))
    data = check.mapping(data, (), _RUBRIC_KEYS, {"id", "version", "criteria"})
    rubric_id = check.string(data["id"], ("id",), pattern=_ID)
    version = check.string(data["version"], ("version",), empty=False)
    description = check.string(data.get("description", ""), ("description",))
    instructions = check.string(data.get("instructions", ""), ("instructions",))
    glossary = list(check.strings(data.get("glossary", []), ("glossary",)))
    if "glossary_file" in data:
        rel = check.string(data["glossary_file"], ("glossary_file",), empty=False)
        glossary_path = (base_dir or pathlib.Path(".")) / rel
        if not glossary_path.is_file():
            raise check.fail(("glossary_file",), f"file {glossary_path} does not exist")
        glossary.extend(line.strip() for line in glossary_path.read_text().splitlines()
                        if line.strip() and not line.lstrip().startswith("#"))
    glossary = sorted(set(glossary), key=lambda term: (term.lower(), term))
    tenants = check.strings(data.get("tenants", []), ("tenants",))
    raw_criteria = data["criteria"]
    if not isinstance(raw_criteria, list) or not raw_criteria:
        raise check.fail(("criteria",), "expected a non-empty list of criteria")
    criteria = tuple(_criterion(check, raw, ("criteria", i)) for i, raw in enumerate(raw_criteria))
    seen: set[str] = set()
    for i, criterion in enumerate(criteria):
        if criterion.name in seen:
            raise check.fail(("criteria", i, "name"), f"duplicate criterion name {criterion.name!r}")
        seen.add(criterion.name)
    if not any(c.weight > 0 for c in criteria if not c.penalty):
        raise check.fail(("criteria",), "at least one non-penalty criterion needs a weight > 0")
    for i, criterion in enumerate(criteria):
        if criterion.penalty and criterion.weight > 1.0:
            raise check.fail(("criteria", i, "weight"),
                             f"a penalty weight is the share of the total a full violation removes: "
                             f"must be <= 1, got {criterion.weight}")
    return Rubric(
        id=rubric_id, version=version, description=description, criteria=criteria,
        instructions=instructions, glossary=tuple(glossary), tenants=tenants,
        source_path=source, source_yaml=text,
    )


def load_rubric(path: str | pathlib.Path) -> Rubric:
    """Load and check one rubric file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"rubric file {path} does not exist")
    return parse_rubric(path.read_text(encoding="utf-8"), str(path), path.parent)


def rubric_files(directory: str | pathlib.Path) -> list[pathlib.Path]:
    """The rubric files of a folder (``*.yaml``, ``*.yml``), sorted."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"rubrics folder {directory} does not exist")
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml"))


def load_rubric_dir(directory: str | pathlib.Path) -> list[Rubric]:
    """Every rubric of a folder; two files with the same id are an error."""
    rubrics: list[Rubric] = []
    by_id: dict[str, str] = {}
    for path in rubric_files(directory):
        rubric = load_rubric(path)
        if rubric.id in by_id:
            raise ConfigError(f"{path}: rubric id {rubric.id!r} is already used by {by_id[rubric.id]}")
        by_id[rubric.id] = str(path)
        rubrics.append(rubric)
    return rubrics


def dump_rubric(rubric: Rubric) -> str:
    """Deterministic YAML of a rubric (the format :func:`parse_rubric` reads)."""
    data: JsonObject = {"id": rubric.id, "version": rubric.version, "description": rubric.description}
    if rubric.instructions:
        data["instructions"] = rubric.instructions
    if rubric.glossary:
        data["glossary"] = list(rubric.glossary)
    if rubric.tenants:
        data["tenants"] = list(rubric.tenants)
    data["criteria"] = [_criterion_yaml(c) for c in rubric.criteria]
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100, default_flow_style=False)


def _criterion_yaml(criterion: Criterion) -> JsonObject:
    data: JsonObject = {"name": criterion.name, "kind": criterion.kind}
    if criterion.kind == "llm":
        data["question"] = criterion.question
        data["scale"] = criterion.scale
        if criterion.scale == "yes_no":
            data["good_answer"] = criterion.good_answer
    else:
        data["scorer"] = criterion.scorer
    if criterion.params:
        data["params"] = dict(criterion.params)
    data.update(weight=criterion.weight, severity=criterion.severity, penalty=criterion.penalty,
                tags=list(criterion.tags))
    return data


def with_fields(rubric: Rubric, **changes: object) -> Rubric:
    """A copy of ``rubric`` with some fields replaced."""
    return dataclasses.replace(rubric, **changes)
