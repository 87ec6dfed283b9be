"""The opt-in living-rubric demo (calibrl.demo.living_rubric): its experts share nothing with the
judge, its next rubric version is derived from the alarm, and a quick run goes end to end against a
real judge server, its report and figures made from the records."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

from calibrl.demo import fresh_grades, living_rubric
from calibrl.demo.domain import generate_domain
from calibrl.judge_server.rubric import parse_rubric
from calibrl.sme.items import SampleItem

SOURCE = pathlib.Path(fresh_grades.__file__).read_text(encoding="utf-8")


def test_the_experts_import_no_judge_code_and_share_no_rule_with_the_rubric():
    top_level = [node for node in ast.parse(SOURCE).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in top_level]
    assert not [m for m in modules if "judge_server" in (m or "")], modules
    rubric = parse_rubric(living_rubric.weak_rubric("r"))
    for criterion in rubric.criteria:  # no scorer, criterion name or parameter of the judge's rubric
        assert criterion.scorer not in SOURCE and criterion.name not in SOURCE
        numbers = [v for v in criterion.canonical().get("params", {}).values() if isinstance(v, (int, float))]
        for value in numbers:
            assert not re.search(rf"(?<![\w.]){re.escape(str(value))}(?![\w.])", SOURCE), value
        assert str(criterion.weight) not in SOURCE


def test_the_experts_grade_by_the_rank_of_the_passage_they_find():
    assert [fresh_grades.grade_of_rank(r) for r in (1, 2, 3, 6, 7, None)] == [5, 4, 3, 3, 1, 1]
    domain = generate_domain(0)
    passage = domain.passages[0]
    grader = fresh_grades.FreshGrader(domain.passages)
    found = SampleItem(id="a", query="q", output=f"{passage.title} {passage.text}", gold_doc_ids=(passage.doc_id,))
    lost = SampleItem(id="b", query="q", output="zzqx wvvk", gold_doc_ids=(passage.doc_id,))
    assert grader.grade(found) == (5, ())
    assert grader.grade(lost) == (1, (fresh_grades.NOT_FOUND_TAG,))
    (record,) = grader.feedback([lost])
    assert record.id == "b@expert" and record.grade == 1


def test_the_next_version_drops_what_the_alarm_named():
    weak = living_rubric.weak_rubric("r")
    fixed = parse_rubric(living_rubric.without_criteria(weak, ["stuffing_pays"]))
    assert [c.name for c in fixed.criteria] == ["keeps_entities"] and fixed.version == "2"
    assert fixed.hash != parse_rubric(weak).hash
    assert living_rubric.without_criteria(weak, ["nothing-of-it"]) is None
    assert living_rubric.without_criteria(weak, ["stuffing_pays", "keeps_entities"]) is None
    assert [d for d, _ in living_rubric.candidate_fixes(weak, ["stuffing_pays"])] == [("stuffing_pays",)]
    # an alarm that names no criterion: each one dropped in turn
    assert [d for d, _ in living_rubric.candidate_fixes(weak, [])] == [("stuffing_pays",), ("keeps_entities",)]


def test_a_quick_run_goes_end_to_end_from_records(tmp_path, capsys):
    out = tmp_path / "living"
    assert living_rubric.main(["--quick", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG" and (out / "heldout.png").stat().st_size > 0

    # both runs trained every step; the drift check reached a verdict from the fresh grades
    for name in ("uncorrected", "corrected"):
        records = living_rubric.run_records(out, name)
        assert [m["step"] for m in records["metrics"]] == list(range(1, living_rubric.QUICK.steps + 1))
        assert any(d.get("kappa") is not None for d in records["drift"])
    corrected = living_rubric.run_records(out, "corrected")
    events = [(e["step"], e["event"]) for e in corrected["events"]]
    alarm_steps = [d["step"] for d in corrected["drift"] if d["alarm"]]
    if alarm_steps:  # the alarm lowered the weight from the next step
        assert (alarm_steps[0], "rubric_downweighted") in events
        scale = {m["step"]: m["rubric/weight_scale"] for m in corrected["metrics"]}
        assert scale[alarm_steps[0]] == 1.0
        fixed_at = [f["step"] for f in results["runs"]["corrected"]["published"] if f["published"]]
        if alarm_steps[0] < living_rubric.QUICK.steps:
            if fixed_at[:1] == alarm_steps[:1]:  # a new version at once: the next step is scored by it, at full weight
                assert scale[alarm_steps[0] + 1] == 1.0 and (alarm_steps[0] + 1, "rubric_weight_restored") in events
            else:
                assert scale[alarm_steps[0] + 1] == living_rubric.QUICK.downweight_factor
    for fix in results["runs"]["corrected"]["published"]:
        if fix["published"] and fix["step"] < living_rubric.QUICK.steps:  # the next step was scored by it
            changed = [e for e in corrected["events"] if e["event"] == "rubric_changed"]
            assert changed[0]["step"] == fix["step"] + 1 and changed[0]["versions"] == [fix["hash"]]
            assert fix["kappa_after"] > fix["kappa_before"]
    assert not any(e["event"] == "rubric_changed" for e in living_rubric.run_records(out, "uncorrected")["events"])

    # the held-out comparison is paired over the same tasks, and the report quotes the records
    heldout = results["heldout"]
    assert len({len(h) for h in heldout["hits"].values()} | {len(heldout["tasks"])}) == 1
    difference = [a - b for a, b in zip(heldout["hits"]["corrected"], heldout["hits"]["uncorrected"])]
    assert heldout["difference"]["estimate"] == pytest.approx(sum(difference) / len(difference), abs=1e-12)
    assert heldout["difference"]["low"] <= heldout["difference"]["estimate"] <= heldout["difference"]["high"]
    report = (out / "report.md").read_text()
    for name, hits in heldout["hits"].items():
        assert f"- {name}: {sum(hits) / len(hits):.3f}" in report
    assert "![training.png](training.png)" in report
    assert living_rubric.main(["--quick", "--out", str(out)]) == 2  # never overwrites a folder
    assert "is not empty" in capsys.readouterr().err
