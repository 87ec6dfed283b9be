"""Reference pages generated from the code at every `mkdocs build`, so they cannot drift.

Each page is built from the one source of truth of its facts:

- reference/cli.md     the argparse parser of every `calibrl` command (calibrl.cli.COMMANDS)
- reference/config.md  the typed config dataclasses (fields declared with calibrl.config.option)
- reference/grpc.md    the comments of proto/calibrl/v1/*.proto
- reference/errors.md  the exception tree of calibrl.errors and its gRPC status mapping
- reference/limits.md  every request limit of both servers (config fields named max_* / batch_*)
- reference/server-metrics.md  the OpenTelemetry instruments declared in calibrl/telemetry.py
- results/benchmarks.md the benchmark tables of benchmarks/README.md, with their commands and machines
- reference/metrics.md the trainer's step metrics (calibrl.trainer.metrics_catalog, checked against the
                       trainer's source by tests/test_metrics_catalog.py)
- results/demo-plots/*.png the demo page's figures, drawn from results/demo/results.json
- the alarms table of concepts/training-signals.md (the `<!-- generated: trainer-alarms -->` line):
                       calibrl.trainer.alarms, the list the trainer raises its warnings from

The functions return Markdown text; tests/test_docs.py calls them directly too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import os
import pathlib
import re
import typing
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED_NOTE = ("<!-- generated at build time by docs/hooks/reference.py from {source}; "
                  "edit the source, not this page -->\n\n")

# ---------------------------------------------------------------- helpers


def _cell(text: Any) -> str:
    """One Markdown table cell: no newlines, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# ---------------------------------------------------------------- CLI


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def command_parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    """The argparse parser a `calibrl` command builds, taken as it parses (nothing runs)."""
    from calibrl.cli import COMMANDS

    module_name, func_name = COMMANDS[words][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    saved_env = dict(os.environ)
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        func([])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
        os.environ.clear()
        os.environ.update(saved_env)
    raise RuntimeError(f"calibrl {' '.join(words)} built no argument parser")


def _action_row(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(_code(s) for s in action.option_strings)
        if action.nargs != 0:
            names += " " + _code(action.metavar or action.dest.upper())
    else:
        names = _code(action.metavar or action.dest)
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        default = ""
    else:
        default = _default_text(action.default)
    extra = []
    if action.choices:
        extra.append("one of " + ", ".join(_code(c) for c in action.choices))
    if action.nargs in ("*", "+", "append") or isinstance(action, argparse._AppendAction):
        extra.append("repeatable")
    if action.required and action.nargs not in ("*", "?"):
        extra.append("required")
    help_text = (action.help or "").replace("%%", "%")
    if "%(default)" in help_text:
        help_text = help_text.replace("%(default)s", str(action.default))
    meaning = "; ".join([help_text, *extra]) if help_text else "; ".join(extra)
    return f"| {names} | {default} | {_cell(meaning)} |"


def cli_reference() -> str:
    from calibrl.cli import COMMANDS

    lines = [GENERATED_NOTE.format(source="the argument parsers of calibrl.cli.COMMANDS"),
             "# Command line\n",
             "`calibrl --help` lists the commands; `calibrl <command> --help` prints what this page shows. "
             "Commands that serve or train also take `key=value` config overrides: see "
             "[Configuration](config.md).\n",
             "| command | what it does |", "| --- | --- |"]
    for words, (_, summary) in COMMANDS.items():
        anchor = "calibrl-" + "-".join(words)
        lines.append(f"| [`calibrl {' '.join(words)}`](#{anchor}) | {_cell(summary)} |")
    for words, (_, summary) in COMMANDS.items():
        parser = command_parser(words)
        lines += ["", f"## calibrl {' '.join(words)}", "", summary, ""]
        if parser.description and parser.description.strip() != summary:
            lines += [parser.description.strip().replace("%%", "%"), ""]
        lines += ["```text", parser.format_usage().strip(), "```", "",
                  "| option | default | meaning |", "| --- | --- | --- |"]
        lines += [_action_row(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        if parser.epilog and "config keys" not in parser.epilog:
            lines += ["", "```text", parser.epilog.strip(), "```"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- config


def _type_text(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(repr(m.value) for m in hint)
    name = getattr(hint, "__name__", None)
    if name and not typing.get_args(hint):
        return name
    return str(hint).replace("typing.", "")


def _default_text(default: Any) -> str:
    if isinstance(default, enum.Enum):
        default = default.value
    if default == "":
        return '`""`'
    return _code(default)


def config_rows(cls: type, prefix: str = "", defaults: Any = None) -> list[str]:
    """Table rows `| key | type | default | doc |` for every field of a config dataclass,
    nested sections and tagged-union variants included."""
    rows: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "required"
        doc = f.metadata.get("doc", "")
        if dataclasses.is_dataclass(hint):
            nested = default if dataclasses.is_dataclass(default) else None
            rows += config_rows(hint, f"{prefix}{f.name}.", nested)
            continue
        variants = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if variants:
            for variant in variants:
                tag = typing.get_args(typing.get_type_hints(variant)["type"])[0]
                rows.append(f"| `{prefix}{f.name}` ({_code('type: ' + tag)}) | {variant.__name__} | "
                            f"{'default' if isinstance(default, variant) else ''} | "
                            f"{_cell(doc + ' ' + (variant.__doc__ or '').strip())} |")
                rows += config_rows(variant, f"{prefix}{f.name}.", default if isinstance(default, variant) else None)
            continue
        rows.append(f"| `{prefix}{f.name}` | {_cell(_type_text(hint))} | {_default_text(default)} | {_cell(doc)} |")
    return rows


CONFIGS = (
    ("Trainer: `calibrl train`", "calibrl.trainer.config:TrainConfig",
     "`calibrl train --config FILE key=value ...`; `calibrl train --print-config` prints the same fields."),
    ("Retrieval server: `calibrl serve retrieval`", "calibrl.retrieval_server.config:RetrievalServerConfig",
     "`calibrl serve retrieval --config FILE key=value ...`; `serving.*` is shared with the judge server."),
    ("Judge server: `calibrl serve judge`", "calibrl.judge_server.config:JudgeServerConfig",
     "`calibrl serve judge --config FILE key=value ...`; `judge.*` is also the in-process `JudgeConfig`."),
)


def _load(target: str) -> Any:
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


def config_reference() -> str:
    lines = [GENERATED_NOTE.format(source="the config dataclasses (calibrl.config.option)"),
             "# Configuration\n",
             "Each process reads one typed config: a YAML file (`--config FILE`) plus dotted `key=value` "
             "overrides on the command line (values read as YAML: `optimizer.lr=1e-5`, "
             "`report_to=[wandb,mlflow]`). An unknown key is refused with the closest valid name; a bad value "
             "with the value and the fix. A section that is a tagged union (`advantage`) picks its variant by "
             "`type`.\n"]
    for title, target, how in CONFIGS:
        cls = _load(target)
        lines += [f"## {title}", "", f"{how} Class: `{target.replace(':', '.')}`.", "",
                  "| key | type | default | meaning |", "| --- | --- | --- | --- |", *config_rows(cls), ""]
    return "\n".join(lines)


def refusal_texts() -> str:
    """The text of every refusal the servers raise (string parts of each `raise ResourceExhausted(...)`
    and `raise InvalidArgument(...)`): a config field named there is a limit that can refuse a request."""
    texts = []
    for folder in ("retrieval_server", "judge_server", "calibrl"):
        for path in sorted((ROOT / folder).glob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if path.name == "limits.py":  # the retrieval server's request rules: every name in it refuses
                texts += [c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            for node in ast.walk(tree):
                if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and getattr(node.exc.func, "id", "") in ("ResourceExhausted", "InvalidArgument")):
                    texts += [c.value for c in ast.walk(node.exc)
                              if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return "\n".join(texts)


def limits_reference() -> str:
    """Every request limit of both servers: the config fields their refusal messages name."""
    refusals = refusal_texts()
    lines = [GENERATED_NOTE.format(source="the server config dataclasses and the servers' refusal messages"),
             "# Limits\n",
             "Every setting of a server that can refuse a request, with its default. A request over a limit is "
             "refused before any work with `RESOURCE_EXHAUSTED` (sizes, full queue) or `INVALID_ARGUMENT` (a "
             "value outside its range), and the message names the field and the limit, e.g. "
             "`top_k: must be in 1..100 (max_top_k), got 0`. `GetIndexInfo` reports the retrieval server's "
             "limits at run time. Per-tenant request size and rate limits live in the API-keys file "
             "([TLS, API keys and tenants](../guides/security.md)).\n"]
    for title, target, _ in CONFIGS[1:]:
        cls = _load(target)
        rows = []
        for row in config_rows(cls):
            key = row.split("`")[1]
            leaf = key.rsplit(".", 1)[-1]
            named = re.search(rf"(?<![\w.]){re.escape(leaf)}(?!\w)", refusals)
            queue_bound = "RESOURCE_EXHAUSTED" in row
            if leaf.startswith(("max_", "batch_max_")) and (named or queue_bound or key.startswith("serving.")):
                rows.append(row)
        lines += [f"## {title}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- gRPC


_DECL = re.compile(r"^\s*(service|rpc|message|enum)\s+(\w+)|^\s*(repeated\s+|optional\s+)?([\w.]+)\s+(\w+)\s*=\s*(\d+)")


def parse_proto(text: str) -> dict[str, Any]:
    """The documented declarations of one .proto file: header comment, services with their rpcs,
    messages and enums with their fields, each with the comment lines right above it."""
    header: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines) and lines[i].startswith("//"):
        header.append(lines[i][2:].removeprefix(" "))
        i += 1
    blocks: list[dict[str, Any]] = []
    stack: list[dict[str, Any]] = []
    comment: list[str] = []
    for line in lines[i:]:
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped[2:].strip())
            continue
        match = _DECL.match(line)
        if match and match.group(1):
            kind, name = match.group(1), match.group(2)
            if kind == "rpc":
                rpc = re.search(r"rpc\s+\w+\s*\((stream\s+)?([\w.]+)\)\s*returns\s*\((stream\s+)?([\w.]+)\)", line)
                stack[-1]["members"].append({"name": name, "type": f"{rpc.group(2)} → {rpc.group(4)}" if rpc else "",
                                             "number": "", "doc": " ".join(comment)})
            else:
                block = {"kind": kind, "name": name, "doc": " ".join(comment), "members": [],
                         "parent": stack[-1]["name"] if stack else ""}
                blocks.append(block)
                if "{" in line and "}" not in line:
                    stack.append(block)
        elif match and stack:
            label = (match.group(3) or "").strip()
            stack[-1]["members"].append({"name": match.group(5), "type": f"{label} {match.group(4)}".strip(),
                                         "number": match.group(6), "doc": " ".join(comment)})
        elif re.match(r"^\s*(\w+)\s*=\s*(\d+)\s*;", line) and stack:
            name, number = re.match(r"^\s*(\w+)\s*=\s*(\d+)", line).groups()
            stack[-1]["members"].append({"name": name, "type": "", "number": number, "doc": " ".join(comment)})
        if stripped.startswith("}") and stack:
            stack.pop()
        if stripped and not stripped.startswith("//"):
            comment = []
    return {"header": header, "blocks": blocks}


def grpc_reference() -> str:
    lines = [GENERATED_NOTE.format(source="the comments of proto/calibrl/v1/*.proto"),
             "# gRPC API (`calibrl.v1`)\n",
             "The wire contract of both services. Any gRPC client works: the servers also serve reflection "
             "(`grpcurl -plaintext 127.0.0.1:50051 list`) and the standard health service. Python stubs ship "
             "in `calibrl.v1` (`retrieval_pb2`, `judge_pb2`, and their `_grpc` modules).\n"]
    for path in sorted((ROOT / "proto" / "calibrl" / "v1").glob("*.proto")):
        parsed = parse_proto(path.read_text(encoding="utf-8"))
        lines += [f"## {path.name}", "", "```text", *parsed["header"], "```", ""]
        for block in parsed["blocks"]:
            qualified = f"{block['parent']}.{block['name']}" if block["parent"] else block["name"]
            lines += [f"### {block['kind']} {qualified}", ""]
            if block["doc"]:
                lines += [block["doc"], ""]
            if not block["members"]:
                continue
            if block["kind"] == "service":
                lines += ["| rpc | request → response | meaning |", "| --- | --- | --- |"]
                lines += [f"| `{m['name']}` | {_cell(m['type'])} | {_cell(m['doc'])} |" for m in block["members"]]
            elif block["kind"] == "enum":
                lines += ["| value | number | meaning |", "| --- | --- | --- |"]
                lines += [f"| `{m['name']}` | {m['number']} | {_cell(m['doc'])} |" for m in block["members"]]
            else:
                lines += ["| field | type | number | meaning |", "| --- | --- | --- | --- |"]
                lines += [f"| `{m['name']}` | `{m['type']}` | {m['number']} | {_cell(m['doc'])} |"
                          for m in block["members"]]
            lines.append("")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- errors


def errors_reference() -> str:
    import calibrl.errors as errors

    doc = errors.__doc__ or ""
    start = doc.rfind("\n", 0, doc.index("CalibrlError\n")) + 1 if "CalibrlError\n" in doc else len(doc)
    tree = doc[start:].rstrip()
    lines = [GENERATED_NOTE.format(source="calibrl/errors.py"),
             "# Errors and status codes\n",
             "Every error calibrl raises on purpose is a `calibrl.errors.CalibrlError` (also importable as "
             "`from calibrl import CalibrlError`). Servers answer each with one gRPC status code; clients "
             "(`GrpcRetrievalClient`, `GrpcJudgeClient`) raise the same class back. Anything else becomes "
             "`INTERNAL`. Messages name the field and the limit, e.g. "
             "`top_k: must be in 1..100 (max_top_k), got 0`.\n",
             "```text", textwrap_dedent(tree), "```", "",
             "| exception | gRPC status | when |", "| --- | --- | --- |"]
    import grpc

    table = errors._status_table()
    for name in dir(errors):
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, errors.CalibrlError):
            code = next((c.name for k, c in table.items() if issubclass(cls, k)), None)
            if cls is errors.CalibrlError:
                code = grpc.StatusCode.INTERNAL.name + " (when not a subclass)"
            status = _code(code) if code else "local only, never on the wire"
            lines.append(f"| `{name}` | {status} | {_cell((cls.__doc__ or '').strip())} |")
    return "\n".join(lines) + "\n"


def textwrap_dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)


# ---------------------------------------------------------------- server metrics


def instruments() -> list[tuple[str, str, str]]:
    """(kind, OpenTelemetry name, description) of every instrument the servers create: the
    `meter.create_*("name", description=...)` calls of calibrl/telemetry.py and the
    `observe_gauge("name", callback, "description")` calls anywhere in calibrl/."""
    found = []
    for path in sorted((ROOT / "calibrl").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith("calibrl.")):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            description = next((k.value.value for k in node.keywords
                                if k.arg == "description" and isinstance(k.value, ast.Constant)), "")
            if name.startswith("create_"):
                found.append((name.removeprefix("create_"), node.args[0].value, description))
            elif name == "observe_gauge":
                if len(node.args) > 2 and isinstance(node.args[2], ast.Constant):
                    description = node.args[2].value
                found.append(("observable gauge", node.args[0].value, description))
    return found


def server_metrics_reference() -> str:
    lines = [GENERATED_NOTE.format(source="the instruments of calibrl/telemetry.py"),
             "# Server metrics\n",
             "With `serving.telemetry.enabled=true` both servers record these OpenTelemetry instruments; "
             "they are exported over OTLP (`serving.telemetry.otlp_endpoint`) and/or served for Prometheus "
             "(`serving.telemetry.prometheus_port`; names there use `_` for `.`, with a unit suffix and "
             "`_total` for counters). See [Telemetry and Prometheus](../guides/telemetry.md).\n",
             "| instrument | kind | what |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {kind.replace('_', ' ')} | {_cell(description)} |" for kind, name, description in instruments()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- trainer metrics


def trainer_metrics_reference() -> str:
    from calibrl.trainer.metrics_catalog import EVAL, SECTIONS

    lines = [GENERATED_NOTE.format(source="calibrl/trainer/metrics_catalog.py"),
             "# Trainer metrics\n",
             "Every step, `calibrl train` appends one JSON object to `<output_dir>/metrics.jsonl` and sends "
             "the same scalars to the trackers of `report_to` ([Experiment tracking](../guides/tracking.md)). "
             "Names follow TRL's where TRL has one. A metric that is undefined for a step is absent, never "
             "logged as 0. `<component>` and `<name>` stand for any name. What to do when a warning fires: "
             "[What the trainer logs](../concepts/training-signals.md).\n"]
    for section in (*SECTIONS, None):
        title, metrics = ("Held-out evaluation", (EVAL,)) if section is None else (section.title, section.metrics)
        lines += [f"## {title}", "", "| metric | meaning |", "| --- | --- |"]
        lines += [f"| {', '.join(_code(n) for n in m.names)} | {_cell(m.meaning)} |" for m in metrics]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- trainer alarms

ALARMS_MARKER = "<!-- generated: trainer-alarms -->"


def trainer_alarms_table() -> str:
    """The table of every alarm of calibrl.trainer.alarms: when it fires (with the default of its
    threshold), what it means, what to try."""
    from calibrl.trainer.alarms import ALARMS
    from calibrl.trainer.diagnostics import HealthConfig

    defaults = HealthConfig()
    lines = [GENERATED_NOTE.format(source="calibrl/trainer/alarms.py").rstrip(), "",
             "| alarm | fires when | what it means | what to try |", "| --- | --- | --- | --- |"]
    for alarm in ALARMS:
        lines.append(f"| `{alarm.name}` | {_cell(alarm.when(defaults))} | {_cell(alarm.meaning)} | {_cell(alarm.action)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- benchmarks

BENCHMARKS = ROOT / "benchmarks" / "README.md"
# sections of benchmarks/README.md kept off the site (none: measurements of replaced designs live in
# benchmarks/HISTORY.md)
BENCHMARKS_NOT_SHOWN: tuple[str, ...] = ()
# a block that tells measurement history (which run, which code, which working session) stays off the
# site: user docs speak about the product as it is (history belongs in benchmarks/HISTORY.md)
HISTORY = re.compile(r"\bsessions?\b|\bearlier\b|\bfirst run\b|\bcode before\b|\bbefore (?:the|this)\b"
                     r"|\(default before|\bold held-out\b|\bpreviously\b|\bissues? \d+"
                     r"|\b(?:commit|code at) [0-9a-f]{7}", re.I)
SCRATCH_PATH = re.compile(r"/tmp/[\w.-]+(?:/[\w.-]+)*")
_LINK = re.compile(r"\[([^\]]+)\]\((?!https?://)[^)]+\)")


def _blocks(lines: list[str]) -> list[list[str]]:
    """A Markdown text cut into blocks: blank-line separated, a fenced block whole."""
    blocks: list[list[str]] = []
    current: list[str] = []
    fence = False
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        if not line.strip() and not fence:
            if current:
                blocks.append(current)
            current = []
            continue
        current.append(line)
    if current:
        blocks.append(current)
    return blocks


def benchmark_sections(text: str) -> list[tuple[str, list[list[str]]]]:
    """(name, blocks) of every `## ` section of benchmarks/README.md, named by the
    `<!-- section:NAME -->` marker it lies in, or by its heading where it has none."""
    sections: list[tuple[str, list[str]]] = []
    marker = ""
    for line in text.splitlines():
        opened = re.fullmatch(r"<!-- section:([\w-]+) -->", line.strip())
        if opened:
            marker = opened.group(1)
            continue
        if re.fullmatch(r"<!-- /section:[\w-]+ -->", line.strip()):
            marker = ""
            continue
        if line.startswith("## "):
            sections.append((marker or line[3:].strip(), [line]))
        elif sections:
            sections[-1][1].append(line)
    return [(name, _blocks(lines)) for name, lines in sections]


def _is_paragraph(block: list[str]) -> bool:
    return not block[0].startswith(("|", "#", "```", "<!--", "- ", "* ", "1. "))


def benchmark_units(text: str) -> list[tuple[str, list[list[str]]]]:
    """What the site shows of benchmarks/README.md: per shown section, its blocks in order.

    A table is shown with the commands above it (every fenced block since the previous table)
    and its caption (the last paragraph above it), when neither the caption nor the table tells
    measurement history; a `Machine:` paragraph goes with the next table shown. Headings are
    kept above what is shown under them."""
    shown = []
    for name, blocks in benchmark_sections(text):
        if name in BENCHMARKS_NOT_SHOWN:
            continue
        out: list[list[str]] = []
        headings: list[list[str]] = []
        pending: list[list[str]] = []
        machine: list[str] | None = None  # the section's machine, shown with its next table
        for block in blocks:
            if block[0].startswith("#"):
                level = len(block[0]) - len(block[0].lstrip("#"))
                headings = [h for h in headings if len(h[0]) - len(h[0].lstrip("#")) < level] + [block]
                pending = []
            elif block[0].startswith("|"):
                # the caption: the paragraph above the table, with only commands between them
                before = [b for b in pending if not b[0].startswith("```")]
                caption = before[-1] if before and _is_paragraph(before[-1]) else None
                unit_text = "\n".join((caption or []) + block)
                if not HISTORY.search(unit_text):
                    out += headings
                    headings = []
                    if machine is not None and machine not in pending and not HISTORY.search("\n".join(machine)):
                        out.append(machine)
                    out += [b for b in pending if (b[0].startswith("```") or b is caption or b is machine)
                            and not HISTORY.search("\n".join(b))]
                    out.append(block)
                    machine = None
                pending = []
            else:
                pending.append(block)
                if block[0].startswith("Machine:"):
                    machine = block
        if out:
            shown.append((name, out))
    return shown


def benchmark_tables(text: str) -> list[list[str]]:
    """The tables of benchmarks/README.md that the site shows."""
    return [b for _, blocks in benchmark_units(text) for b in blocks if b[0].startswith("|")]


def _site_text(lines: list[str]) -> str:
    text = "\n".join(lines)
    if lines[0].startswith("```"):  # the measuring commands: shown, not run by the docs tests
        text = re.sub(r"^```\w*", "```text", text, count=1)
    return _LINK.sub(r"\1", SCRATCH_PATH.sub("<dir>", text))


def benchmarks_page() -> str:
    """The benchmark tables of benchmarks/README.md (benchmark_units), each under its section with
    the commands that measured it and the machine, as the benchmarks README has them (scratch
    folders read `<dir>`, links to repository files plain text)."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    lines = [GENERATED_NOTE.format(source="benchmarks/README.md").rstrip(),
             "# Benchmarks",
             "Speed and behaviour of the services and the trainer, measured by the scripts under `benchmarks/` "
             "of the repository on CPU machines shared with other jobs: compare figures as ratios within one "
             "table (its rows ran back to back), not across tables. Each table comes with the commands that "
             "measured it (not run by the documentation tests: each takes minutes to hours) and the machine; "
             "a table whose machine line names a record is rendered from the JSON record the script wrote "
             "(`--record`, under `benchmarks/records/`). `benchmarks/README.md` discusses every figure. The demo and the search-agent study have "
             "their own pages: [Demo](demo.md), [Search-agent study](study.md)."]
    for _, blocks in benchmark_units(text):
        lines += [_site_text(b) for b in blocks]
    return "\n\n".join(lines) + "\n"


# ---------------------------------------------------------------- mkdocs hook

PAGES = {
    "reference/cli.md": cli_reference,
    "reference/config.md": config_reference,
    "reference/grpc.md": grpc_reference,
    "reference/errors.md": errors_reference,
    "reference/limits.md": limits_reference,
    "reference/server-metrics.md": server_metrics_reference,
    "reference/metrics.md": trainer_metrics_reference,
    "results/benchmarks.md": benchmarks_page,
}


def _first(function: Any) -> Any:
    """Run this hook's event before the plugins' (mkdocstrings reads its paths in its own on_config)."""
    try:
        from mkdocs.plugins import event_priority
    except ImportError:  # imported outside mkdocs (tests/test_docs.py)
        return function
    return event_priority(100)(function)


@_first
def on_config(config: Any) -> Any:
    """mkdocstrings reads source statically (griffe), but trainer/, judge_server/ and
    retrieval_server/ install as calibrl.trainer, ... (package-dir): give it a folder where the
    package has that shape, made of symlinks to the real files."""
    import atexit
    import shutil
    import tempfile

    shadow = pathlib.Path(tempfile.mkdtemp(prefix="calibrl-docs-src-"))
    atexit.register(shutil.rmtree, shadow, True)
    package = shadow / "calibrl"
    package.mkdir()
    for entry in (ROOT / "calibrl").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in ("trainer", "judge_server", "retrieval_server"):
        (package / name).symlink_to(ROOT / name)
    handlers = config["plugins"]["mkdocstrings"].config["handlers"]
    handlers.setdefault("python", {})["paths"] = [str(shadow)]
    return config


SKIP_MARKER = re.compile(r"^<!--\s*skip:\s*(.+?)\s*-->[ \t]*$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the alarms table (ALARMS_MARKER) from calibrl.trainer.alarms, and show why a snippet
    is not run by the docs tests: the `<!-- skip: reason -->` line before
    its fence (which tests/test_docs.py reads) gets a visible note above it."""
    if ALARMS_MARKER in markdown:
        markdown = markdown.replace(ALARMS_MARKER, trainer_alarms_table())
    return SKIP_MARKER.sub(lambda m: f'!!! note "Not run by the documentation tests"\n    {m.group(1)}\n\n{m.group(0)}',
                           markdown)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, build in PAGES.items():
        files.append(File.generated(config, uri, content=build()))
    for uri, content in demo_plot_files().items():
        files.append(File.generated(config, uri, content=content))
    return files


def demo_plot_files() -> dict[str, bytes]:
    """The demo page's figures (the `demo-plots` block of results/demo.md), drawn from
    results/demo/results.json with the demo report's plot code: site path -> PNG bytes."""
    import json
    import tempfile

    from calibrl.demo.results_tables import DEMO_PLOTS_DIR, DEMO_RESULTS, demo_plots

    if not DEMO_RESULTS.exists():
        return {}
    demo = json.loads(DEMO_RESULTS.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as scratch:
        return {f"{DEMO_PLOTS_DIR}/{path.name}": path.read_bytes() for _, path in demo_plots(demo, pathlib.Path(scratch))}
