"""The opt-in living-rubric demo (calibrl.demo.living_rubric): its experts share nothing with the
judge or with any candidate version, the exploit's onset rule reads a hand-made record, a candidate
that rewards what the experts reward beats version 1 on hand-made grades, and a quick run goes end to
end against a real judge server, its report and figures made from the records."""

from __future__ import annotations

import ast
import dataclasses
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
    weak = living_rubric.weak_rubric("r", generate_domain(6).glossary_terms())
    rubrics = [parse_rubric(weak)] + [parse_rubric(text) for _, text in living_rubric.candidate_versions(weak)]
    for criterion in (c for rubric in rubrics for c in rubric.criteria):  # no scorer, name or parameter of a rubric
        assert criterion.scorer not in SOURCE and criterion.name not in SOURCE
        numbers = [v for v in criterion.params.values() if isinstance(v, (int, float))]  # the rubric's own
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


def test_the_candidates_are_the_judges_scorers_one_or_two_equally_weighted_never_version_1():
    from calibrl.judge_server import programmatic

    # every scorer that reads a rewrite and its query alone, at its registered defaults
    search_step_or_compliance = {"revealed_entity", "repeated_query", "compliance_leak"}
    assert sorted(c["scorer"] for c in living_rubric.CANDIDATE_CRITERIA.values()) == sorted(
        set(programmatic.SCORERS) - search_step_or_compliance)
    assert not [c for c in living_rubric.CANDIDATE_CRITERIA.values() if "params" in c]
    glossary = generate_domain(6).glossary_terms()
    weak = living_rubric.weak_rubric("r", glossary)
    candidates = living_rubric.candidate_versions(weak)
    pool = set(living_rubric.CANDIDATE_CRITERIA)
    assert len(candidates) == len(pool) + len(pool) * (len(pool) - 1) // 2
    for names, text in candidates:
        rubric = parse_rubric(text)
        assert rubric.id == "r" and rubric.version == "2" and [c.name for c in rubric.criteria] == list(names)
        assert {c.weight for c in rubric.criteria} == {round(1 / len(names), 4)}
        assert "stuffing_pays" not in names and sorted(rubric.glossary) == sorted(glossary)  # the glossary is kept
    # a version already made of one candidate set is not offered again
    assert not [n for n, _ in living_rubric.candidate_versions(candidates[0][1]) if n == candidates[0][0]]


def test_the_validation_pairs_are_training_pairs_set_aside_by_hash():
    domain = generate_domain(6)
    splits = living_rubric.task_splits(domain)
    pairs = {name: {(t.entity_key, t.aspect_key) for t in tasks} for name, tasks in splits.items()}
    assert pairs["train"] and pairs["validation"] and pairs["heldout"]
    assert not (pairs["train"] & pairs["validation"]) and not (pairs["heldout"] & (pairs["train"] | pairs["validation"]))
    assert len(splits["train"]) + len(splits["validation"]) == len(domain.tasks("train"))
    assert splits["heldout"] == domain.tasks("heldout")
    assert all(living_rubric.is_validation_pair(*p) for p in pairs["validation"])
    # the share of pairs set aside is near VALIDATION_FRACTION (a hash, not a count)
    share = len(pairs["validation"]) / (len(pairs["train"]) + len(pairs["validation"]))
    assert abs(share - living_rubric.VALIDATION_FRACTION) < 0.15


def test_the_exploit_onset_is_read_from_the_step_lengths():
    def metrics(lengths):
        return [{"step": i + 1, "completions/mean_length": v} for i, v in enumerate(lengths)]

    # baseline: steps 1-4 average 8.0, threshold 10.0; a one-step spike at 6 is not an onset
    lengths = [8, 7, 9, 8, 9, 12, 9, 11, 11.5, 13, 9]
    onset = living_rubric.exploit_onset(metrics(lengths), baseline_steps=4, rise=1.25, sustain=3)
    assert onset["baseline_length"] == 8.0 and onset["threshold"] == 10.0 and onset["step"] == 8
    assert living_rubric.exploit_onset(metrics(lengths), 4, rise=1.25, sustain=4)["step"] is None
    assert living_rubric.exploit_onset(metrics([8] * 10), 4)["step"] is None


def _grade(query, output, grade, n):
    from calibrl.judge_server.authoring.feedback import FeedbackRecord

    return FeedbackRecord(query, output, grade=grade, id=f"s{n}-t{n}-0@expert")


def test_a_candidate_beats_version_1_on_graded_stuffing():
    """The exploit by hand: rewrites that pile catalogue words (version 1 pays) fail with the
    experts, rewrites that restate the request pass. Some candidate must agree better."""
    piles = ["Harbor Bond Index Fund Granite Value Fund risk rating benchmark minimum initial investment expense ratio",
             "Falcon Technology Fund Summit Equity Income Fund redemption fee holding period expense ratio minimum",
             "Evergreen Growth Fund Tidewater Treasury Fund Oakridge Dividend Fund benchmark index risk rating fee"]
    requests = [("Oakridge Dividend Fund expense ratio", "expense ratio of Oakridge Dividend Fund"),
                ("Granite Value Fund redemption fee", "Granite Value Fund redemption fee"),
                ("Tidewater Treasury Fund minimum investment", "Tidewater Treasury Fund minimum investment")]
    records = []
    for n, (query, good) in enumerate(requests * 3):
        records.append(_grade(query, good, 5, 2 * n))
        records.append(_grade(query, piles[n % 3], 1, 2 * n + 1))
    settings = living_rubric.LivingSettings()
    weak = living_rubric.weak_rubric("r", generate_domain(6).glossary_terms())
    v1 = living_rubric.rubric_kappa(weak, records, settings)
    kappas = {names: living_rubric.rubric_kappa(text, records, settings)
              for names, text in living_rubric.candidate_versions(weak)}
    assert v1 is not None and v1 <= 0.0 < max(k for k in kappas.values() if k is not None)
    assert living_rubric.rollout_step(records[-1].id) == 17


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
            assert (fix["step"] + 1, [fix["hash"]]) in [(e["step"], e["versions"]) for e in changed]
            assert fix["kappa_after"] > (fix["kappa_before"] if fix["kappa_before"] is not None else -1.0)
            assert fix["kappa_after"] >= living_rubric.QUICK.min_kappa  # only a version that passes the gate
    for fix in results["runs"]["corrected"]["published"]:  # the best candidate of every attempt is the one named
        kappas = [c["kappa"] for c in fix["candidates"] if c["kappa"] is not None]
        if kappas:
            assert fix["best_kappa"] == max(kappas)
            assert fix["published"] == (fix["best_kappa"] >= living_rubric.QUICK.min_kappa and fix["best_kappa"] > (
                fix["kappa_before"] if fix["kappa_before"] is not None else -1.0))
    attempts = [f for f in results["runs"]["corrected"]["published"] if "best_text" in f]
    chosen = [f for f in attempts if f["published"]] or attempts[:1]
    assert len(results["check"]) == 2 * len(chosen)  # each version checked in both runs
    for fix, pair in zip(chosen, zip(results["check"][::2], results["check"][1::2])):
        assert {c["run"] for c in pair} == {"uncorrected", "corrected"}
        for check in pair:  # on the grades its choice did not read
            assert check["after_step"] == fix["chosen_on"]["last_rollout_step"]
            assert check["published"] == fix["published"] and check["criteria"] == fix["best_criteria"]
    for name, run in results["runs"].items():  # the onset, recomputed from the records the report quotes
        assert run["onset"] == living_rubric.exploit_onset(living_rubric.run_records(out, name)["metrics"],
                                                           living_rubric.QUICK.review_every)
    assert not any(e["event"] == "rubric_changed" for e in living_rubric.run_records(out, "uncorrected")["events"])

    # each comparison is paired over the same tasks, and the report quotes the records
    splits = living_rubric.task_splits(generate_domain(6))  # the default seed
    assert results["validation"]["tasks"] == [t.task_id for t in splits["validation"]]
    assert results["heldout"]["tasks"] == [t.task_id for t in splits["heldout"]][: living_rubric.QUICK.heldout_limit]
    report = (out / "report.md").read_text()
    for key in ("validation", "heldout"):
        evaluation = results[key]
        assert len({len(h) for h in evaluation["hits"].values()} | {len(evaluation["tasks"])}) == 1
        difference = [a - b for a, b in zip(evaluation["hits"]["corrected"], evaluation["hits"]["uncorrected"])]
        assert evaluation["difference"]["estimate"] == pytest.approx(sum(difference) / len(difference), abs=1e-12)
        assert evaluation["difference"]["low"] <= evaluation["difference"]["estimate"] <= evaluation["difference"]["high"]
        for name, hits in evaluation["hits"].items():
            assert f"- {name}: {sum(hits) / len(hits):.3f}" in report
    assert "![training.png](training.png)" in report
    # version 1 checked on the experts' grades of the base policy's rewrites of every training task
    agreement = results["base_agreement"]
    assert agreement["items"] == len(splits["train"]) and 0 <= agreement["expert_pass"] <= agreement["items"]
    assert f"rewrites of the {agreement['items']} training tasks ({agreement['expert_pass']} passed)" in report
    # a run that does not read the test split says so, and draws the validation tasks only
    results["heldout"] = None
    (out / "results.json").write_text(json.dumps(results), encoding="utf-8")
    living_rubric.write_figures(out)
    assert "Not read in this run (`--validation-only`)" in living_rubric.report_markdown(out, [])
    assert living_rubric.main(["--quick", "--out", str(out)]) == 2  # never overwrites a folder
    assert "is not empty" in capsys.readouterr().err


def test_the_kept_report_is_the_one_its_records_make():
    """results/living-rubric holds a full run's records and report (docs/concepts/rubric-lifecycle.md
    points there): the report is regenerated from the records, word for word."""
    kept = pathlib.Path(__file__).resolve().parents[1] / "results" / "living-rubric"
    report = (kept / "report.md").read_text(encoding="utf-8")
    assert living_rubric.report_markdown(kept, ["training.png", "heldout.png"]) == report
    results = json.loads((kept / "results.json").read_text(encoding="utf-8"))
    assert results["settings"] == dataclasses.asdict(living_rubric.LivingSettings())  # the defaults made it
    for name, run in results["runs"].items():
        assert run["onset"] == living_rubric.exploit_onset(living_rubric.run_records(kept, name)["metrics"],
                                                           results["settings"]["review_every"])
