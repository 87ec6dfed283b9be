"""The trainer-metrics reference follows the code: every metric name the trainer's source
emits is in calibrl.trainer.metrics_catalog (from which docs/reference/metrics.md is
generated), and every catalogued name is still emitted somewhere (a rename fails both ways).

"Emitted" is read from the source, without running anything: the string keys of a dict
literal that holds at least one metric name (a `/`-separated name such as
``clip_ratio/low_mean``, or a catalogued one) or is assigned to ``metrics``; the keys stored into
a mapping named ``metrics``; `/`-separated names a ``for`` loop walks. An f-string's fields read
as ``<name>``. A task kind's evaluation columns (``TaskKind.metric_names``) are logged as
``eval/<name>``, so they count as that. The runs that the docs tests train
check the same catalog against the names actually logged (tests/test_docs.py).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from calibrl.trainer import metrics_catalog as catalog

ROOT = pathlib.Path(__file__).resolve().parent.parent
# where step metrics are made: the trainer (task kinds included) and the experts' review queue
EMITTERS = (ROOT / "trainer", ROOT / "calibrl" / "sme")
SLASHED = re.compile(r"[a-z][a-z0-9_@]*(?:/(?:[a-z0-9_@]+|<name>))+")
# keys of records that are not step metrics, written next to some (heldout.jsonl, eval reports)
NOT_STEP_METRICS = {"step", "error", "metrics"}
STORE_TARGETS = {"metrics", "out"}
# emitted inside the trainer and dropped before logging, with where
NOT_LOGGED = {"policy_loss": "trainer/update.py keeps it out of the step's metrics (it logs `loss`)"}


def _catalogued_literals() -> set[str]:
    # `step` leads every record the trainer writes, metrics or not: it marks no dict as metrics
    return {n for m in catalog.all_metrics() for n in m.names if not catalog.PLACEHOLDER.search(n)} - {"step"}


def key_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<name>" for v in node.values)
    return None


def emitted_names(source: str) -> set[str]:
    """The metric names one module's source emits (see the module docstring)."""
    names: set[str] = set()
    known = _catalogued_literals()
    tree = ast.parse(source)
    assigned_to_metrics = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                           and any(isinstance(t, ast.Name) and t.id == "metrics" for t in node.targets)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = [k for k in (key_text(k) for k in node.keys if k is not None) if k is not None]
            if id(node) in assigned_to_metrics or any(SLASHED.fullmatch(k) or k in known for k in keys):
                names.update(k for k in keys if k not in NOT_STEP_METRICS)
        elif isinstance(node, ast.For):
            names.update(t for t in (key_text(c) for c in ast.walk(node.iter)) if t and SLASHED.fullmatch(t))
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in STORE_TARGETS):
            key = key_text(node.slice)
            if key is not None and (SLASHED.fullmatch(key) or node.value.id == "metrics"):
                names.add(key)
    return names


def eval_columns() -> set[str]:
    import calibrl.trainer.kinds  # noqa: F401  (registers the built-in task kinds)
    from calibrl.trainer.task_kinds import TASK_KINDS

    return {name for kind in TASK_KINDS.values() for name in kind.metric_names}


def emitted() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    columns = eval_columns()
    for folder in EMITTERS:
        for path in sorted(folder.rglob("*.py")):
            if path.name == "metrics_catalog.py":
                continue
            for name in emitted_names(path.read_text(encoding="utf-8")):
                if name in NOT_LOGGED:
                    continue
                name = "eval/<name>" if name in columns else name
                found.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return found


def catalogued() -> list[str]:
    return [n for m in catalog.all_metrics() for n in m.names]


def covers(a: str, b: str) -> bool:
    """Whether names a and b (either with placeholders) can be the same metric."""
    return bool(catalog.name_pattern(a).fullmatch(b) or catalog.name_pattern(b).fullmatch(a)
                or catalog.PLACEHOLDER.sub("<>", a) == catalog.PLACEHOLDER.sub("<>", b))


def test_every_emitted_metric_is_catalogued():
    found = emitted()
    assert len(found) >= 40, sorted(found)  # the scan sees the trainer's metrics at all
    missing = {name: where for name, where in found.items() if not any(covers(c, name) for c in catalogued())}
    assert not missing, ("metrics the trainer emits that calibrl/trainer/metrics_catalog.py does not list "
                         f"(so docs/reference/metrics.md lacks them): {missing}")


def test_every_catalogued_metric_is_emitted():
    found = emitted()
    # `step` is the record's own key (diagnostics.RunLog)
    implicit = {"step"}
    stale = [name for name in catalogued() if name not in implicit and not any(covers(name, e) for e in found)]
    assert not stale, f"catalogued metrics no source emits any more (renamed or removed?): {stale}"


def test_the_scan_catches_an_added_and_a_renamed_metric():
    source = '''
def f(x):
    metrics = {"loss": x, "clip_ratio/low_mean": x}
    metrics["grad_norm_clipped"] = x
    out = {f"rewards/{x}/p90": x}
    return metrics, out
'''
    names = emitted_names(source)
    assert names == {"loss", "clip_ratio/low_mean", "grad_norm_clipped", "rewards/<name>/p90"}
    # a metric added to a dict of known names, without any `/`
    assert emitted_names('def g(x):\n    return {"loss": x, "loss_scale": x}\n') == {"loss", "loss_scale"}
    assert not any(covers(c, "grad_norm_clipped") for c in catalogued())
    assert not any(covers(c, "rewards/<name>/p90") for c in catalogued())
    assert any(covers(c, "clip_ratio/low_mean") for c in catalogued())


@pytest.mark.parametrize("name", ["health/warnings", "drift/kappa_low", "rewards/rubric/mean", "eval/hit@5"])
def test_documented_names(name):
    assert catalog.documented(name)


def test_undocumented_names():
    for name in ("rewards/rubric/median", "health", "drift/kappa_mid", "rewards/a/b/mean"):
        assert not catalog.documented(name), name
