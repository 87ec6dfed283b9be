"""SME feedback files and their distillation into a rubric plus a golden hold-out set."""

import json
import os
import subprocess
import sys

import pytest

from calibrl.errors import ConfigError
from calibrl.judge_server.authoring.distill import DistillOptions, distill, is_golden, split_golden
from calibrl.judge_server.authoring.feedback import FeedbackError, FeedbackRecord, read_feedback, write_feedback
from calibrl.judge_server.rubric import dump_rubric, load_rubric, parse_rubric
from calibrl.testing import synthetic_feedback


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

def rec(grade, tags=(), notes="", n=[0]):
    n[0] += 1
    return FeedbackRecord(query=f"query {n[0]}", output=f"output {n[0]}", grade=grade, error_tags=tuple(tags),
                          notes=notes, id=f"r{n[0]}")


def small_feedback():
    return (
        [rec(g) for g in (5, 5, 4, 5)]
        + [rec(g, ["missing_entity"]) for g in (3, 2, 3)]
        + [rec(g, ["vague"]) for g in (4, 3)]  # alias of underspecified
        + [rec(1, ["invented_entity"])]
        + [rec(3, ["wrong_period"], "asked about 2024, rewrite says 2019"), rec(4, ["wrong_period"], "old year")]
        + [rec(5, ["typo"])]
    )


def test_weights_follow_frequency_times_grade_drop():
    records = small_feedback()
    result = distill(records, DistillOptions(golden_fraction=0.0))
    n = len(records)
    baseline = (5 + 5 + 4 + 5) / 4
    assert result.baseline_grade == pytest.approx(baseline)
    raw = {
        "missing_entity": 3 / n * (baseline - 8 / 3),
        "underspecified": 2 / n * (baseline - 3.5),
        "wrong_period": 2 / n * (baseline - 3.5),
    }
    total = sum(raw.values())
    weights = {c.name: c.weight for c in result.rubric.criteria}
    # The rubric stores weights rounded to 4 decimals (distill.py), so they sit within 5e-5 of the exact
    # value: abs 1e-4. Float rounding (~1e-16 here) plays no part.
    assert weights["entities"] == pytest.approx(raw["missing_entity"] / total / 2, abs=1e-4)
    assert weights["entities_llm"] == pytest.approx(raw["missing_entity"] / total / 2, abs=1e-4)
    assert weights["specificity"] == pytest.approx(raw["underspecified"] / total / 2, abs=1e-4)
    # Unknown tag: an LLM criterion only, with a generated question citing the shortest note.
    unknown = next(c for c in result.rubric.criteria if c.name == "no_wrong_period")
    assert unknown.kind == "llm" and unknown.weight == pytest.approx(raw["wrong_period"] / total, abs=1e-4)
    assert "wrong period" in unknown.question and '"old year"' in unknown.question
    # Critical tag: penalty criteria, weight from severity whatever the frequency, split over both kinds.
    penalties = {c.name: c for c in result.rubric.criteria if c.penalty}
    assert set(penalties) == {"no_invented_entities", "no_invented_entities_llm"}
    assert penalties["no_invented_entities"].weight == pytest.approx(min(1, (baseline - 1) / 4) / 2, abs=1e-4)
    assert penalties["no_invented_entities_llm"].good_answer == "no"
    # Rare tag left out and said so.
    assert "typo (seen 1 < min_count=2 times)" in result.rubric.description
    assert {s.tag: s.criteria for s in result.tags}["typo"] == ()
    # Criteria name the tags they detect (used by per-criterion precision/recall).
    assert next(c for c in result.rubric.criteria if c.name == "specificity").tags == ("underspecified",)
    assert parse_rubric(dump_rubric(result.rubric)).hash == result.rubric.hash


def test_modes_and_critical_tags():
    records = small_feedback()
    programmatic = distill(records, DistillOptions(golden_fraction=0.0, criteria_mode="programmatic"))
    assert all(c.kind == "programmatic" for c in programmatic.rubric.criteria)
    assert "wrong_period (no programmatic criterion for this tag)" in programmatic.rubric.description
    llm = distill(records, DistillOptions(golden_fraction=0.0, criteria_mode="llm"))
    assert all(c.kind == "llm" for c in llm.rubric.criteria) and llm.rubric.instructions
    critical = distill(records, DistillOptions(golden_fraction=0.0, critical_tags=("wrong_period",)))
    assert next(c for c in critical.rubric.criteria if c.name == "no_wrong_period").penalty
    with pytest.raises(ConfigError, match="no non-critical error tag with a grade cost"):
        distill([rec(5), rec(1, ["invented_entity"])], DistillOptions(golden_fraction=0.0))


def test_verdict_only_records_use_scale_extremes():
    records = [FeedbackRecord("q1", "o1", verdict="pass"), FeedbackRecord("q2", "o2", verdict="fail",
               error_tags=("missing_entity",)), FeedbackRecord("q3", "o3", verdict="fail", error_tags=("missing_entity",))]
    result = distill(records, DistillOptions(golden_fraction=0.0))
    stats = {s.tag: s for s in result.tags}
    assert stats["missing_entity"].severity == pytest.approx(4.0)
    assert records[0].expert_pass() and not records[1].expert_pass()
    assert FeedbackRecord("q", "o", grade=3).expert_pass(pass_grade=3)


def test_golden_split_is_per_record_and_stable():
    records = synthetic_feedback(200, seed=3)
    train, golden = split_golden(records, 0.3)
    assert 40 <= len(golden) <= 80 and len(train) + len(golden) == 200
    # Adding records never moves existing ones between the sets.
    more_train, more_golden = split_golden(records + synthetic_feedback(50, seed=9), 0.3)
    assert set(r.id for r in golden) <= set(r.id for r in more_golden)
    assert set(r.id for r in train) <= set(r.id for r in more_train)
    assert all(is_golden(r, 0.3) for r in golden)


def test_feedback_errors_name_file_line_and_field(tmp_path):
    good = {"query": "q", "output": "o", "grade": 4}
    cases = [
        ("{not json", "(json)", "not valid JSON"),
        (json.dumps({**good, "grade": 7}), "grade", "must be an integer 1..5, got 7"),
        (json.dumps({"query": "q", "grade": 3}), "output", "required"),
        (json.dumps({**good, "verdict": "maybe"}), "verdict", "must be 'pass' or 'fail'"),
        (json.dumps({"query": "q", "output": "o"}), "grade", "needs a grade"),
        (json.dumps({**good, "eror_tags": []}), "eror_tags", "unknown field"),
        (json.dumps({**good, "error_tags": "missing"}), "error_tags", "expected a list of strings"),
    ]
    for bad, field, problem in cases:
        path = tmp_path / "f.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + bad + "\n")
        with pytest.raises(FeedbackError) as info:
            read_feedback(path)
        assert (info.value.line, info.value.field) == (3, field)
        assert problem in str(info.value) and str(info.value).startswith(f"{path}:3: {field}:")
    path.write_text(json.dumps({**good, "error_tags": ["Missing Entity", "missing-entity", "PII leak"]}) + "\n")
    assert read_feedback(path)[0].error_tags == ("missing_entity", "pii_leak")


def _run_distill(feedback, out, golden, seed):
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    return subprocess.run(
        [sys.executable, "-m", "calibrl", "rubric", "distill", "--feedback", str(feedback), "--out", str(out),
         "--golden-out", str(golden), "--id", "funds"],
        capture_output=True, text=True, env=env, timeout=120,
    )


def test_distill_cli_is_byte_for_byte_deterministic(tmp_path):
    feedback = tmp_path / "feedback.jsonl"
    write_feedback(feedback, synthetic_feedback(240))
    outputs = []
    for run, seed in enumerate((1, 2)):
        out, golden = tmp_path / f"r{run}.yaml", tmp_path / f"new-folder-{run}" / f"g{run}.jsonl"
        done = _run_distill(feedback, out, golden, seed)
        assert done.returncode == 0, done.stderr
        outputs.append((out.read_bytes(), golden.read_bytes()))
    assert outputs[0] == outputs[1]
    rubric = load_rubric(tmp_path / "r0.yaml")
    assert rubric.id == "funds" and f"hash {rubric.hash}" in done.stdout
    golden_records = read_feedback(tmp_path / "new-folder-0" / "g0.jsonl")
    assert golden_records and all(is_golden(r, 0.3) for r in golden_records)
    assert {c.name for c in rubric.criteria} >= {"entities", "intent", "specificity", "no_invented_entities",
                                                 "no_compliance_leak", "no_wrong_time_period"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "output": "o", "grade": 9}\n')
    done = _run_distill(bad, tmp_path / "x.yaml", tmp_path / "y.jsonl", 0)
    assert done.returncode == 2 and f"{bad}:1: grade: must be an integer 1..5" in done.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_reviews_of_one_text_land_on_one_side_of_the_golden_split():
    """Two reviews of the same (query, output) text, graded apart, are both golden or both
    trained on: a golden text never reaches training."""
    import dataclasses

    from calibrl.judge_server.authoring.distill import text_key

    records = synthetic_feedback(200, seed=3)
    again = [dataclasses.replace(r, id=f"again-{n}", grade=6 - (r.grade or 3), output=f"  {r.output.upper()} ",
                                 notes="another expert") for n, r in enumerate(records)]
    train, golden = split_golden(records + again, 0.3)
    assert {text_key(r) for r in train}.isdisjoint({text_key(r) for r in golden})
    assert len(golden) == 2 * len(split_golden(records, 0.3)[1])  # each golden text's second review joined it
