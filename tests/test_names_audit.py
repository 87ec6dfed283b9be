"""The same names for the same things in `--help`, error messages and alarms: every config key
(`rollout.group_size`, or any `a.b=value` a text tells the user to set), trainer metric (`rewards/judge_retrieval_disagreement`) and `--flag`
that a help text, a refusal or a logged warning names is one the code defines.

The texts are read without running anything: the help, description and epilog of every
`calibrl` command's parser (taken as docs/hooks/reference.py takes them), the string parts of
every `raise ...(...)` and every `log.warning/error/info(...)` of the package, and the texts
of calibrl.trainer.alarms. A renamed key, metric or flag fails here until every text follows;
tests/test_docs.py holds README.md and docs/ to the same names.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ("calibrl", "trainer", "judge_server", "retrieval_server")
# `section.key` (a dotted config key: its first part a config section) and `prefix/name` (a metric)
KEY = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)(?![\w(/-])")
# `a.b=value`: a config override whatever its first part (a message telling the user what to set)
OVERRIDE = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)=")
METRIC = re.compile(r"(?<![\w./-])([a-z_]+(?:/[a-z_@0-9<>]+)+)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)")
FILE_NAME = re.compile(r".*\.(?:py|pt|proto|jsonl|json|yaml|yml|md|txt|safetensors|png)$")
# flags of other programs that calibrl's messages tell the user to pass, with the program
OTHER_PROGRAMS_FLAGS = {"--nproc_per_node": "torchrun", "--ulimit": "docker run / podman run"}
LOGGERS = ("log", "logger", "logging")


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


@pytest.fixture(scope="module")
def names():
    """(config keys, config sections, every flag of every calibrl parser, help texts)."""
    from calibrl.cli import COMMANDS

    hook = _hook()
    keys = {row.split("`")[1] for row in hook.config_reference().splitlines() if row.startswith("| `")}
    flags: set[str] = set()
    helps: list[tuple[str, str]] = []
    for words in COMMANDS:
        parser = hook.command_parser(words)
        where = "calibrl " + " ".join(words)
        helps.append((f"{where} (description, epilog)", f"{parser.description or ''} {parser.epilog or ''}"))
        for action in parser._actions:
            flags.update(action.option_strings)
            if action.help:
                helps.append((f"{where} {'/'.join(action.option_strings) or action.dest}", action.help))
    return keys, {k.split(".")[0] for k in keys if "." in k}, flags, helps


def message_texts() -> list[tuple[str, str]]:
    """(where, text) of the string parts of every raise and logged message of the package."""
    texts = []
    for folder in PACKAGE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    target = node.exc
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in ("warning", "error", "info", "exception")
                      and isinstance(node.func.value, ast.Name) and node.func.value.id in LOGGERS):
                    target = node
                else:
                    continue
                where = f"{path.relative_to(ROOT).as_posix()}:{node.lineno}"
                texts += [(where, c.value) for c in ast.walk(target)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return texts


def alarm_texts() -> list[tuple[str, str]]:
    from calibrl.trainer.alarms import ALARMS

    return [(f"alarm {a.name}", " ".join((a.meaning, a.action, a.message, a.condition))) for a in ALARMS]


def problems_in(texts, keys, sections, flags) -> list[str]:
    from calibrl.trainer.metrics_catalog import all_metrics, documented

    prefixes = {n.split("/")[0] for m in all_metrics() for n in m.names if "/" in n}
    problems = []
    for where, text in texts:
        overrides = set(OVERRIDE.findall(text))
        for key in KEY.findall(text):
            if ((key.split(".")[0] in sections or key in overrides) and not FILE_NAME.fullmatch(key) and key not in keys
                    and not any(k.startswith(key + ".") for k in keys)):
                problems.append(f"{where}: `{key}` is no config key | {text[:90]!r}")
        for metric in METRIC.findall(text):
            if metric.split("/")[0] in prefixes and not FILE_NAME.fullmatch(metric) and not documented(metric):
                problems.append(f"{where}: `{metric}` is no trainer metric | {text[:90]!r}")
        for flag in FLAG.findall(text):
            if flag not in flags and flag not in OTHER_PROGRAMS_FLAGS:
                problems.append(f"{where}: `{flag}` is no flag of any calibrl command | {text[:90]!r}")
    return problems


def test_help_texts_name_real_config_keys_metrics_and_flags(names):
    keys, sections, flags, helps = names
    assert len(helps) >= 100 and len(flags) >= 100  # the walk sees every parser
    problems = problems_in(helps, keys, sections, flags)
    assert not problems, "\n".join(problems)


def test_error_messages_and_alarms_name_real_config_keys_metrics_and_flags(names):
    keys, sections, flags, _ = names
    texts = message_texts() + alarm_texts()
    assert len(texts) >= 300, len(texts)
    problems = problems_in(texts, keys, sections, flags)
    assert not problems, "\n".join(problems)


def test_the_audit_catches_a_renamed_key_metric_and_flag(names):
    keys, sections, flags, _ = names
    texts = [("x", "use a denser reward (retrieval.kind=dense) or rollout.group_size=16"),
             ("y", "watch rewards/judge_disagreement and kl"),
             ("z", "resume with --resume-from DIR, or --resume DIR")]
    problems = problems_in(texts, keys, sections, flags)
    assert len(problems) == 3, problems
    assert "`retrieval.kind`" in problems[0]  # no config section is named `retrieval`: an override all the same
    assert "`rewards/judge_disagreement`" in problems[1] and "`--resume-from`" in problems[2]


def _config_sections() -> dict[type, str]:
    """Every config dataclass of the three processes that sits in a section, with its key prefix."""
    import dataclasses
    import typing

    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.retrieval_server.config import RetrievalServerConfig
    from calibrl.trainer.config import TrainConfig

    found: dict[type, str] = {}

    def walk(cls: type, prefix: str) -> None:
        if cls in found:
            return
        found[cls] = prefix
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for hint in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(hint):
                    walk(hint, f"{prefix}{f.name}.")

    for root in (TrainConfig, RetrievalServerConfig, JudgeServerConfig):
        walk(root, "")
    return {cls: prefix for cls, prefix in found.items() if prefix}


def bare_fields(cls: type) -> list[str]:
    """`field=` of the class's own fields, without their section, in the class's refusals."""
    import dataclasses
    import inspect
    import textwrap

    fields = {f.name for f in dataclasses.fields(cls)}
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for c in ast.walk(node.exc):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    found += [m for m in re.findall(r"(?<![\w.])([a-z_][a-z_0-9]*)(?==)", c.value) if m in fields]
    return found


def test_a_section_s_refusals_name_its_keys_with_the_section():
    """`reward.w_rubric=0.3`, the key a user writes, not `w_rubric=0.3`."""
    sections = _config_sections()
    assert len(sections) >= 10
    problems = [f"{cls.__module__}.{cls.__name__}: `{name}=` should read `{prefix}{name}=`"
                for cls, prefix in sections.items() for name in bare_fields(cls)]
    assert not problems, "\n".join(problems)
