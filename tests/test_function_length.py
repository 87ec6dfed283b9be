"""No function of the library is longer than a screen: the trainer, both servers, the core and
the embedded demo (``calibrl/``, less the generated wire code). A function
that is only a data table (its body one literal: a dict, list, tuple or set, after the
docstring) may be longer; it reads as a table, not as steps."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("trainer", "judge_server", "retrieval_server", "calibrl")
SKIPPED = (ROOT / "calibrl" / "v1",)  # the generated protobuf code
MAX_FUNCTION_LINES = 80
_LITERALS = (ast.Dict, ast.List, ast.Tuple, ast.Set)


def _is_data_table(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return len(body) == 1 and isinstance(getattr(body[0], "value", None), _LITERALS)


def long_functions(paths: list[pathlib.Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:function (lines)`` of every function over ``limit`` lines that is not a data table."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_data_table(node):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:"
                                 f"{node.name} ({length} lines)")
    return found


def library_files() -> list[pathlib.Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")
                  if not any(path.is_relative_to(skipped) for skipped in SKIPPED))


def test_no_library_function_is_long():
    files = library_files()
    assert any(p.match("trainer/loop.py") for p in files) and any(p.match("judge_server/judge.py") for p in files)
    assert any(p.match("calibrl/demo/cli.py") for p in files)
    long = long_functions(files)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


def test_the_check_sees_a_long_function_and_spares_a_table(tmp_path):
    steps = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    table = "\n".join(f"        {i!r}: {i}," for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "long.py"
    source.write_text(f"def steps():\n{steps}\n\n\ndef table():\n    \"\"\"A table.\"\"\"\n    return {{\n{table}\n    }}\n",
                      encoding="utf-8")
    assert long_functions([source]) == [f"long.py:steps ({MAX_FUNCTION_LINES + 1} lines)"]
