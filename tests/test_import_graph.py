"""The package's import graph, read from the source with ``ast``: the trainer talks to the
services only through the core (``calibrl.api``, its clients) and imports a server package only
where it runs one in-process; no module of the trainer or of the judge imports itself back
through others; the judge's serving half never imports its authoring half.

An import is counted wherever it is written (module level or inside a function), except under
``if TYPE_CHECKING:`` (annotations only, never run)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# source folder -> the package it is installed as (pyproject's package-dir)
FOLDERS = {"trainer": "calibrl.trainer", "judge_server": "calibrl.judge_server",
           "retrieval_server": "calibrl.retrieval_server", "calibrl": "calibrl"}
SERVERS = ("calibrl.judge_server", "calibrl.retrieval_server")
# The trainer modules that run a service in-process, and the CLI that builds them.
MAY_IMPORT_SERVERS = {"calibrl.trainer.inprocess", "calibrl.trainer.cli"}
# The judge's command line serves both halves (`calibrl serve judge`, `calibrl rubric ...`).
JUDGE_ENTRY_POINTS = {"calibrl.judge_server.cli"}


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The calibrl modules ``module`` imports at run time (resolved to a known module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.add(resolve(full if full in known else base))
            elif isinstance(child, ast.Import):
                found.update(resolve(alias.name) for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard("")
    found.discard(module)
    return {name for name in found if name.startswith("calibrl")}


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {module: _imports(module, path, set(modules)) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """The import cycles among the modules under ``prefix`` (Tarjan's strongly connected components)."""
    nodes = {m: {t for t in targets if t.startswith(prefix)} for m, targets in graph.items() if m.startswith(prefix)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in nodes[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in nodes:
        if node not in index:
            connect(node)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_trainer_imports_a_server_only_where_it_runs_one(graph):
    reaching = {module: sorted(t for t in targets if t.startswith(SERVERS))
                for module, targets in graph.items()
                if module.startswith("calibrl.trainer") and module not in MAY_IMPORT_SERVERS}
    reaching = {module: targets for module, targets in reaching.items() if targets}
    assert not reaching, f"trainer modules importing server code (use calibrl.api and the clients): {reaching}"
    assert any(t.startswith(SERVERS) for t in graph["calibrl.trainer.cli"])  # the check sees the imports


@pytest.mark.parametrize("package", ["calibrl.trainer", "calibrl.judge_server", "calibrl.retrieval_server"])
def test_no_import_cycles(graph, package):
    assert cycles(graph, package) == []


def test_the_judges_serving_half_does_not_import_its_authoring_half(graph):
    serving = {module: sorted(t for t in targets if t.startswith("calibrl.judge_server.authoring"))
               for module, targets in graph.items()
               if module.startswith("calibrl.judge_server") and not module.startswith("calibrl.judge_server.authoring")
               and module not in JUDGE_ENTRY_POINTS}
    assert {module: targets for module, targets in serving.items() if targets} == {}


def test_the_checks_see_a_cycle_and_a_reach_into_a_server(tmp_path):
    """The graph is real: a planted cycle and a planted server import are found."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "trainer" / "a.py").write_text("from calibrl.trainer import b\n")
    (tmp_path / "trainer" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from calibrl.judge_server import judge\n"
        "def f():\n    from calibrl.trainer.a import x\n")
    (tmp_path / "trainer" / "c.py").write_text("import calibrl.judge_server.judge\n")
    (tmp_path / "judge_server" / "judge.py").write_text("")
    planted = import_graph(tmp_path)
    assert cycles(planted, "calibrl.trainer") == [["calibrl.trainer.a", "calibrl.trainer.b"]]
    assert planted["calibrl.trainer.b"] == {"calibrl.trainer.a"}  # the TYPE_CHECKING import is not counted
    assert planted["calibrl.trainer.c"] == {"calibrl.judge_server.judge"}


# ----------------------------------------------------------------------------- function-level imports

# Where a function-level import is checked: the trainer and the core's wire types.
LAZY_CHECKED = ("trainer", "calibrl/api")
# Third-party modules a function may import without a comment, and why they are never imported at load.
LAZY_THIRD_PARTY = {
    "torch": "heavy (seconds): `--help`, config loading and the CPU-light paths never import it",
    "numpy": "comes with torch; imported where tensors become arrays",
    "transformers": "heavy; only the policy, the tokenizer and the engines need it",
    "peft": "optional (LoRA runs only)",
    "vllm": "optional GPU-only engine; the CPU install never has it",
    "safetensors": "only checkpoint saving and loading needs it",
    "datasets": "optional (the TRL adapter only)",
    "tqdm": "only a progress bar on a terminal needs it",
}


def function_level_imports(root: pathlib.Path = ROOT, folders: tuple[str, ...] = LAZY_CHECKED) -> list[str]:
    """``path:line module`` of every import inside a function (``if TYPE_CHECKING:`` blocks aside) that
    neither names a module of :data:`LAZY_THIRD_PARTY` nor carries its reason: a comment on its line,
    or on the line above it or above the block of imports it starts or belongs to."""
    unexplained = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()

            def has_reason(node: ast.stmt, block_start: int) -> bool:
                own = lines[node.lineno - 1 : node.end_lineno]
                above = lines[block_start - 2].strip() if block_start >= 2 else ""
                return any("#" in line for line in own) or above.startswith("#")

            def visit(node: ast.AST, in_function: bool) -> None:
                block_start, previous_end = 0, -1
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.If) and _is_type_checking(child.test):
                        continue
                    if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                        block_start = block_start if child.lineno == previous_end + 1 else child.lineno
                        previous_end = child.end_lineno or child.lineno
                        names = [child.module or ""] if isinstance(child, ast.ImportFrom) else [
                            alias.name for alias in child.names]
                        third_party = child.level == 0 if isinstance(child, ast.ImportFrom) else True
                        if third_party and all(name.split(".")[0] in LAZY_THIRD_PARTY for name in names):
                            continue
                        if not has_reason(child, block_start):
                            unexplained.append(f"{path.relative_to(root)}:{child.lineno} {', '.join(names)}")
                    visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

            visit(ast.parse("\n".join(lines)), False)
    return unexplained


def test_every_function_level_import_says_why_it_is_not_at_module_level():
    unexplained = function_level_imports()
    assert unexplained == [], (
        "function-level imports without a reason: move them to the module's imports, or say on the line above "
        "why not (an import cycle, a heavy or optional dependency, CLI start-up): " + "; ".join(unexplained))


def test_the_function_level_import_check_sees_an_unexplained_one(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "m.py").write_text(
        "def f():\n    import torch\n    import json\n\n"
        "def g():\n    # lazy: policy imports transformers\n    from calibrl.trainer.policy import a\n"
        "    from calibrl.trainer.policy import b\n\n"
        "def h():\n    x = 1\n    from calibrl.trainer.losses import c  # lazy: losses imports torch\n"
        "    from calibrl.trainer import tasks\n")
    found = function_level_imports(tmp_path, ("trainer",))
    assert found == ["trainer/m.py:3 json", "trainer/m.py:13 calibrl.trainer"]
