"""A benchmark's record: what one run of a script measured, as JSON, so the tables of
benchmarks/README.md (and the site's Benchmarks page) are rendered from it, never typed.

A script that takes ``--record PATH`` calls :func:`write_record` with its tables; the record
holds the command as run, the date, the machine (CPU model, cores, load, library versions)
and each table's header and rows exactly as the script printed them. A README block

    <!-- BEGIN generated: bench-NAME -->
    <!-- END generated: bench-NAME -->

shows ``benchmarks/records/NAME.json`` (``python scripts/render_results.py`` fills it;
calibrl.demo.results_tables renders it and tests/test_results_tables.py checks it).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
import time
from typing import Any, Sequence

RECORDS = pathlib.Path(__file__).resolve().parent / "records"


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The machine in one line: CPU model, cores, GPU, float kernels, load average."""
    gpu, kernels = "no GPU", "unknown"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
        from calibrl import kernels as calibrl_kernels

        kernels = calibrl_kernels.describe()
    except ImportError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):  # at the end: the 5- and 15-minute figures cover the run
        load = ", load average {:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min) at the end".format(*os.getloadavg())
    return (f"{platform.system()} {platform.machine()}, {_cpu_model()}, {os.cpu_count()} CPU cores, {gpu}, "
            f"float kernels {kernels}{load}")


def _wall_s() -> float | None:
    """Seconds since this process started (psutil), None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    return round(time.time() - psutil.Process().create_time(), 1)


def versions(*names: str) -> dict[str, str]:
    """Installed versions of the named distributions (those a table depends on)."""
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """One table of a record: a title saying what was measured, the header, the rows as printed."""
    return {"title": title, "header": list(header), "rows": [[str(cell) for cell in row] for row in rows]}


def print_tables(tables: Sequence[dict[str, Any]]) -> None:
    """Print record tables as Markdown, each under its title (what a script shows as it writes them)."""
    for item in tables:
        print(f"\n{item['title']}:\n")
        print("| " + " | ".join(item["header"]) + " |")
        print("|" + " --- |" * len(item["header"]))
        for row in item["rows"]:
            print("| " + " | ".join(str(c) for c in row) + " |")


def verdict(met: bool) -> str:
    """A target's verdict, as every record's notes word it."""
    return "met" if met else "not met"


def cell(value: Any) -> str:
    """A figure as a table shows it: a dict of counts as "KEY n, ...", None as "-"."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in sorted(value.items())) or "-"
    return "-" if value is None else str(value)


def rows_table(title: str, rows: Sequence[dict[str, Any]], drop: Sequence[str] = ()) -> dict[str, Any]:
    """A table of the rows a script printed as dicts: one column per key, in first-seen order."""
    header = list(dict.fromkeys(key for row in rows for key in row if key not in drop))
    return table(title, header, [[cell(row.get(key)) for key in header] for row in rows])


def tables_from_markdown(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The tables of a script's printed Markdown: each table with the paragraph above it as its title."""
    tables, title, rows = [], "", []
    for line in [*lines, ""]:
        line = line.strip()
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
            continue
        if rows:
            header, body = rows[0], [r for r in rows[1:] if not all(set(c) <= set("-: ") for c in r)]
            tables.append(table(title.rstrip(":"), header, body))
            rows, title = [], ""
        if line:
            title = f"{title} {line}".strip()
    return tables


def retable(path: str | pathlib.Path, tables: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> None:
    """Render an existing record's tables anew from the same measurement (a script's layout changed):
    its command, date, machine and timings stay as measured."""
    path = pathlib.Path(path)
    record = json.loads(path.read_text(encoding="utf-8"))
    record["tables"] = list(tables)
    record.pop("notes", None)
    if notes:
        record["notes"] = list(notes)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def write_record(path: str | pathlib.Path, tables: Sequence[dict[str, Any]], *, libraries: Sequence[str] = (),
                 notes: Sequence[str] = (), argv: Sequence[str] | None = None) -> pathlib.Path:
    """Write the record of this run to ``path`` (its command is the script's own command line);
    ``notes``: lines the script printed with its tables (a verdict computed from them)."""
    argv = list(sys.argv if argv is None else argv)
    script = pathlib.Path(argv[0]).resolve()
    try:
        shown = script.relative_to(RECORDS.parent.parent).as_posix()
    except ValueError:
        shown = script.name
    record = {
        "command": shlex.join(["python", shown, *argv[1:]]),
        "measured": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": versions(*libraries),
        "wall_s": _wall_s(),
        "cpu_s": round(time.process_time(), 1),
        "tables": list(tables),
        **({"notes": list(notes)} if notes else {}),
    }
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"record written to {path}")
    return path
