"""The trainer reads as its data flows: a short loop, short functions, no estimator
named in the loop, no task kind branched on by name outside its registry."""

from __future__ import annotations

import ast
import pathlib

TRAINER = pathlib.Path(__file__).resolve().parent.parent / "trainer"
MAX_LOOP_LINES = 300
MAX_FUNCTION_LINES = 80


def _functions(path: pathlib.Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _string_constants(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_loop_module_is_short():
    lines = len((TRAINER / "loop.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LOOP_LINES, f"trainer/loop.py has {lines} lines; split a stage out (limit {MAX_LOOP_LINES})"


def test_no_trainer_function_is_long():
    long = [f"{path.name}:{name} ({length} lines)" for path in sorted(TRAINER.rglob("*.py"))
            for name, length in _functions(path) if length > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checker_sees_a_long_function(tmp_path):
    """The line count is real: a long function is reported."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    source = tmp_path / "long.py"
    source.write_text(f"def long():\n{body}\n", encoding="utf-8")
    assert _functions(source) == [("long", MAX_FUNCTION_LINES + 2)]


def test_the_loop_names_no_estimator_and_no_task_kind():
    from calibrl.trainer.advantages import ADVANTAGE_ESTIMATORS
    from calibrl.trainer.task_kinds import TASK_KINDS

    for module in ("loop.py", "sampling.py", "scoring.py", "training_batch.py", "update.py", "pipeline.py"):
        named = _string_constants(TRAINER / module) & (set(ADVANTAGE_ESTIMATORS) | set(TASK_KINDS))
        assert not named, f"trainer/{module} names {sorted(named)}; go through the registries"


# The modules that may name a built-in kind: the kinds' own packages, and the search agent's text
# format (whose <search> action shares the name). calibrl/demo/ is a user of the kinds with its own
# rewrite and search examples, outside the library.
KIND_DEFINITIONS = {"trainer/kinds/__init__.py", "trainer/kinds/rewrite.py", "trainer/search_format.py"}


def test_only_the_kind_definitions_name_a_task_kind():
    from calibrl.trainer.task_kinds import TASK_KINDS

    root = TRAINER.parent
    modules = [*TRAINER.rglob("*.py"), *(p for p in (root / "calibrl").rglob("*.py") if "demo" not in p.parts)]
    named = {str(path.relative_to(root)): sorted(_string_constants(path) & set(TASK_KINDS)) for path in modules}
    branching = {module: kinds for module, kinds in named.items()
                 if kinds and module not in KIND_DEFINITIONS and not module.startswith("trainer/kinds/search/")}
    assert not branching, f"these modules name task kinds; use the kind's properties instead: {branching}"
    # the check sees the names where they are
    assert named["trainer/kinds/rewrite.py"] == ["rewrite"] and "search" in named["trainer/kinds/search/__init__.py"]
