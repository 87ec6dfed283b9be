"""The alarms table follows the code: every warning the trainer logs during a step is an alarm of
calibrl.trainer.alarms (from which the table of docs/concepts/training-signals.md is generated)
or one of the operational messages named here, and every catalogued alarm is still raised.

"Logged" is read from the source, without running anything: every ``log.warning(...)`` call of
trainer/ and calibrl/sme/, identified by its module and the literal text of its format string.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import pathlib

import pytest

from calibrl.trainer import alarms
from calibrl.trainer.diagnostics import HealthConfig, health_warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "trainer", ROOT / "calibrl" / "sme")

# warnings that tell what the run does, not that a signal left its band, with why they are no alarm
NOT_ALARMS = {
    ("trainer/loop.py", "SIGTERM: stopped after step %d; checkpoint %s"): "reports a requested stop",
    ("trainer/stop_signal.py", "SIGTERM received: finishing this step, then writing a checkpoint"):
        "reports a requested stop",
    ("trainer/scoring.py", "rollouts of step %d: %s; the resumed run scores them again"): "a resume's bookkeeping",
    ("trainer/rewards.py", "reward attempt %d/%d for %s failed: %s: %s"): "a retried call (reward.max_attempts)",
    ("trainer/eval.py", "%s has no %s: evaluating it with the built-in prompt"): "calibrl eval, not a training step",
    ("trainer/eval.py", "%s was trained as a %s agent with its own prompt template; evaluating it on %s tasks "
     "with that template"):
        "calibrl eval, not a training step",
    ("calibrl/sme/queue.py", "step %d: review.on_alarm=stop: the run stops after this step (checkpoint written)"):
        "the consequence of the judge_drift alarm, logged right after it",
    ("trainer/rubric_weight.py", "step %d: rubric %s scored by a new version (%s): its weight is %g again"):
        "the end of the rubric_downweighted alarm",
    ("trainer/rubric_weight.py", "step %d: drift alarm again: the rubric's weight stays %g x %g"):
        "the rubric_downweighted alarm, already raised",
}
# warnings whose text is an alarm's, made elsewhere: (module, format string) -> the alarm's name
RAISED_AS = {
    ("trainer/step_log.py", "step %d: %s"): "the band alarms (diagnostics.health_warnings)",
    ("trainer/loop.py", "step %d: %s"): "update_skipped",
    ("calibrl/sme/queue.py", "step %d: %s"): "judge_drift",
    ("calibrl/sme/queue.py", "step %d: review queue: no rollout with an output in the last %d steps"):
        "review_queue_empty",
    ("trainer/rubric_versions.py", "step %d: rubric_changed: rubric %s was scored by version %s, the step before by %s"):
        "rubric_changed",
    ("trainer/rubric_weight.py", "step %d: review.on_alarm=downweight: rubric %s weight %g -> %g from step %d until a "
     "new rubric version is served"): "rubric_downweighted",
}


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # implicit concatenation is one Constant
        left, right = _text(node.left), _text(node.right)
        return left + right if left is not None and right is not None else None
    return None


def logged_warnings(source: str) -> list[str]:
    """The format strings of every ``<logger>.warning(...)`` call of one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warning"
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger", "logging")):
            found.append(_text(node.args[0]) if node.args else None)
    return found


def warnings_in_source() -> dict[tuple[str, str | None], int]:
    found: dict[tuple[str, str | None], int] = {}
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            for text in logged_warnings(path.read_text(encoding="utf-8")):
                key = (path.relative_to(ROOT).as_posix(), text)
                found[key] = found.get(key, 0) + 1
    return found


def test_every_logged_warning_is_an_alarm_or_named_as_none():
    found = warnings_in_source()
    assert len(found) >= 10, sorted(found)  # the scan sees the trainer's warnings at all
    unknown = [key for key in found if key not in NOT_ALARMS and key not in RAISED_AS]
    assert not unknown, ("warnings logged in the trainer that are neither an alarm of calibrl/trainer/alarms.py "
                         f"(so the docs' alarms table lacks them) nor named in NOT_ALARMS: {unknown}")
    stale = [key for key in (*NOT_ALARMS, *RAISED_AS) if key not in found]
    assert not stale, f"named warnings no source logs any more (reworded or moved?): {stale}"
    names = {a.name for a in alarms.ALARMS}
    assert {v for v in RAISED_AS.values() if not v.startswith("the band")} <= names


def test_the_scan_catches_a_new_warning():
    source = 'def f(log, x):\n    log.warning("step %d: loss went " "up", x)\n    log.info("fine")\n'
    assert logged_warnings(source) == ["step %d: loss went up"]


def test_every_band_alarm_is_raised_by_health_warnings_and_names_its_threshold():
    fields = {f.name for f in dataclasses.fields(HealthConfig)}
    bands = HealthConfig()
    for alarm in alarms.BAND_ALARMS:
        assert alarm.field in fields, alarm
        threshold = getattr(bands, alarm.field)
        outside = threshold * 2 + 1 if alarm.fires_when == "above" else threshold / 2
        inside = threshold / 2 if alarm.fires_when == "above" else threshold * 2 + 1
        # the threshold itself is inside the band
        for value, fires in ((outside, True), (inside, False), (threshold, False)):
            raised = [w for w in health_warnings({alarm.metric: value}, bands) if w.startswith(alarm.metric + "=")]
            assert bool(raised) == fires, (alarm.name, value, raised)
        assert str(threshold) in alarm.warning(outside, bands, {})
    grad = next(a for a in alarms.BAND_ALARMS if a.metric == "grad_norm")
    assert grad.fires(math.nan, bands) and grad.fires(math.inf, bands)


def test_alarms_raised_elsewhere_still_write_their_words():
    def source(module_name: str) -> str:
        module = importlib.util.find_spec(module_name)
        assert module is not None and module.origin, module_name
        return pathlib.Path(module.origin).read_text(encoding="utf-8")

    for alarm in alarms.REVIEW_ALARMS:
        assert alarm.starts_with and alarm.starts_with in source(alarm.raised_by), (alarm.name, alarm.starts_with)
    # the loop logs the skipped update with the catalogue's text
    assert "SKIPPED_UPDATE.warning(" in source(alarms.SKIPPED_UPDATE.raised_by)
    assert alarms.SKIPPED_UPDATE.warning(math.nan, None, {}) == "grad_norm=nan is not finite: update skipped, " \
                                                                 "weights unchanged"


def test_every_alarm_is_documented_and_watches_a_catalogued_metric():
    from calibrl.trainer.metrics_catalog import documented

    assert len({a.name for a in alarms.ALARMS}) == len(alarms.ALARMS)
    for alarm in alarms.ALARMS:
        assert alarm.meaning and alarm.action and alarm.when(), alarm.name
        assert documented(alarm.metric), (alarm.name, alarm.metric)


def test_the_docs_alarm_table_is_generated_from_the_catalogue():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (ROOT / "docs" / "concepts" / "training-signals.md").read_text(encoding="utf-8")
    assert page.count(hook.ALARMS_MARKER) == 1
    assert "| warning |" not in page and "| alarm |" not in page  # no hand-written table beside it
    rendered = hook.on_page_markdown(page, None, None, None)
    rows = [line for line in rendered.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [a.name for a in alarms.ALARMS]
    assert "(default `0.6`)" in rows[0] and "(default `1e+09`)" in rows[2] and "`health.max_frac_reward_zero_std`" in rows[0]


@pytest.mark.parametrize("value, expected", [(0.9, 1), (0.6, 0)])
def test_health_warnings_keep_their_band(value, expected):
    assert len(health_warnings({"frac_reward_zero_std": value}, HealthConfig())) == expected
