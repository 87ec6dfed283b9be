"""The SME-time study: validation kappa vs number of reviews, representative vs random."""

import json

import numpy as np
import pytest

from calibrl.sme.items import SampleItem
from calibrl.studies.sme_time import StudyOptions, StudyPoint, StudyResult, plot_study, run_study, validation_kappa
from calibrl.judge_server import cli as judge_cli
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.authoring.distill import split_golden
from calibrl.judge_server.authoring.feedback import write_feedback
from calibrl.testing import SYNTHETIC_GLOSSARY, synthetic_feedback

FAST_JUDGE = JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True, cache_size=0)


def study_inputs():
    records = synthetic_feedback(200, seed=2)
    train, golden = split_golden(records, 0.3)
    pool = [SampleItem(id=r.id, query=r.query, output=r.output, retrieved_doc_ids=r.retrieved_doc_ids,
                       gold_doc_ids=r.gold_doc_ids) for r in train]
    return pool, {r.id: r for r in train}, golden


def test_kappa_of_a_budget_is_what_rubric_validate_reports(tmp_path):
    pool, answers, golden = study_inputs()
    reviews = [answers[item.id] for item in pool[:60]]
    options = StudyOptions(pass_threshold=0.6, gate="estimate", glossary=SYNTHETIC_GLOSSARY)
    outcome = validation_kappa(reviews, golden, options, FAST_JUDGE)
    kappa, passed, note = outcome.kappa, outcome.passed, outcome.note
    write_feedback(tmp_path / "reviews.jsonl", reviews)
    write_feedback(tmp_path / "golden.jsonl", golden)
    assert judge_cli.distill(["--feedback", str(tmp_path / "reviews.jsonl"), "--out", str(tmp_path / "r.yaml"),
                              "--golden-out", str(tmp_path / "unused.jsonl"), "--golden-fraction", "0",
                              "--criteria", "programmatic", "--id", "sme-study",
                              "--glossary", str(_glossary(tmp_path))]) == 0
    code = judge_cli.validate(["--rubric", str(tmp_path / "r.yaml"), "--golden", str(tmp_path / "golden.jsonl"),
                               "--judge", "programmatic", "--pass-threshold", "0.6", "embedder=hashed-ngrams"])
    record = json.loads((tmp_path / "r.yaml.validation.json").read_text())["records"][0]
    assert kappa == pytest.approx(record["kappa"], abs=1e-12) and passed == record["passed"] == (code == 0)
    assert (outcome.kappa_low, outcome.kappa_high) == (record["kappa_low"], record["kappa_high"])
    assert note == "" and outcome.pass_threshold == 0.6
    # Too few reviews to distil a rubric: no kappa, a failed gate, and the reason kept.
    outcome = validation_kappa(reviews[:1], golden, options, FAST_JUDGE)
    assert outcome.kappa is None and not outcome.passed and outcome.note


def test_auto_threshold_and_lower_bound_gate_are_what_rubric_validate_reports(tmp_path):
    """The study's default: the threshold picked on the budget's own reviews, the gate on the
    kappa interval's lower bound, as `calibrl rubric validate --pass-threshold auto --gate lower_bound`."""
    pool, answers, golden = study_inputs()
    reviews = [answers[item.id] for item in pool[:60]]
    outcome = validation_kappa(reviews, golden, StudyOptions(glossary=SYNTHETIC_GLOSSARY), FAST_JUDGE)
    write_feedback(tmp_path / "reviews.jsonl", reviews)
    write_feedback(tmp_path / "golden.jsonl", golden)
    assert judge_cli.distill(["--feedback", str(tmp_path / "reviews.jsonl"), "--out", str(tmp_path / "r.yaml"),
                              "--golden-out", str(tmp_path / "unused.jsonl"), "--golden-fraction", "0",
                              "--criteria", "programmatic", "--id", "sme-study",
                              "--glossary", str(_glossary(tmp_path))]) == 0
    code = judge_cli.validate(["--rubric", str(tmp_path / "r.yaml"), "--golden", str(tmp_path / "golden.jsonl"),
                               "--judge", "programmatic", "--pass-threshold", "auto",
                               "--feedback", str(tmp_path / "reviews.jsonl"), "--gate", "lower-bound",
                               "embedder=hashed-ngrams"])
    record = json.loads((tmp_path / "r.yaml.validation.json").read_text())["records"][0]
    assert record["pass_threshold_source"] == "auto" and record["gate"] == "lower_bound"
    assert outcome.pass_threshold == pytest.approx(record["pass_threshold"], abs=1e-12)
    assert outcome.kappa == pytest.approx(record["kappa"], abs=1e-12)
    assert (outcome.kappa_low, outcome.kappa_high) == (record["kappa_low"], record["kappa_high"])
    assert outcome.passed == record["passed"] == (code == 0)
    assert outcome.passed == (outcome.kappa_low is not None and outcome.kappa_low >= 0.6)
    # Reviews that are all one expert verdict: no threshold can be picked, a failed gate with the reason.
    one_verdict = [r for r in reviews if not r.expert_pass(4)][:20]
    outcome = validation_kappa(one_verdict, golden, StudyOptions(glossary=SYNTHETIC_GLOSSARY), FAST_JUDGE)
    assert outcome.kappa is None and not outcome.passed and "threshold" in outcome.note


def _glossary(tmp_path):
    path = tmp_path / "glossary.txt"
    path.write_text("\n".join(SYNTHETIC_GLOSSARY) + "\n")
    return path


def test_study_runs_both_samplers_on_every_budget(tmp_path):
    pool, answers, golden = study_inputs()
    vectors = np.random.default_rng(0).standard_normal((len(pool), 8))
    options = StudyOptions(budgets=(2, 10, 40, 10_000), random_repeats=2, glossary=SYNTHETIC_GLOSSARY)
    lines = []
    result = run_study(pool, answers, golden, options, vectors=vectors, judge_config=FAST_JUDGE, progress=lines.append)
    assert result.budgets() == [2, 10, 40]  # a budget above the pool is left out
    for budget in (2, 10, 40):
        assert len(result.kappas("representative", budget)) == 1 and len(result.kappas("random", budget)) == 2
    assert len(lines) == 3 and lines[0].startswith("2 reviews: representative kappa")
    needed = result.reviews_needed("representative")
    rep = {p.budget: p for p in result.points if p.method == "representative"}
    assert needed is None or (rep[needed].passed and not any(rep[b].passed for b in result.budgets() if b < needed))
    for point in result.points:  # the lower-bound gate: a pass needs the whole interval above 0.6
        assert point.passed == (point.kappa_low is not None and point.kappa_low >= 0.6)
        assert point.kappa is None or point.pass_threshold is not None
    table = result.table()
    assert table.count("\n") == 1 + 3 and "| 40 |" in table
    if rep[40].kappa is not None and rep[40].kappa_low is not None:
        assert f"{rep[40].kappa:.3f} [{rep[40].kappa_low:.2f}, {rep[40].kappa_high:.2f}]" in table
    assert f"from a pool of {len(pool)}" in result.verdict()
    path = plot_study(result, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(result.to_json()))["pool_size"] == len(pool)
    with pytest.raises(ValueError, match="have no answer"):
        run_study(pool, {}, golden, options, vectors=vectors, judge_config=FAST_JUDGE)


def test_reviews_needed_follows_the_gate_decisions():
    result = StudyResult(StudyOptions(min_kappa=0.6, random_repeats=3), pool_size=100, golden_size=30)
    result.points = [
        StudyPoint("representative", 10, 0, None, False, "no criteria"),
        # a kappa above min_kappa whose interval reaches below it fails the lower-bound gate
        StudyPoint("representative", 20, 0, 0.7, False, "", 0.45, 0.88, 0.5),
        StudyPoint("representative", 30, 0, 0.8, True, "", 0.62, 0.93, 0.55),
        StudyPoint("random", 10, 0, 0.9, True, "", 0.7, 1.0, 0.5), StudyPoint("random", 10, 1, 0.2, False),
        StudyPoint("random", 10, 2, None, False, "no criteria"),  # counts as -1
        StudyPoint("random", 20, 0, 0.65, True), StudyPoint("random", 20, 1, 0.61, True),
        StudyPoint("random", 20, 2, 0.1, False),
        StudyPoint("random", 30, 0, 0.8, True), StudyPoint("random", 30, 1, 0.8, True),
        StudyPoint("random", 30, 2, 0.8, True),
    ]
    assert result.reviews_needed("representative") == 30 and result.reviews_needed("random") == 20
    assert result.summary_kappa("random", 10) == pytest.approx(0.2)
    table = result.table()
    assert "| 10 | no rubric | - | 0.200 (no rubric-0.900) | 1/3 |" in table
    assert "| 20 | 0.700 [0.45, 0.88] | 0.500 | 0.610 (0.100-0.650) | 2/3 |" in table
    assert "| 30 | 0.800 [0.62, 0.93] (pass) | 0.550 |" in table
    assert "representative sampling 30 reviews, random sampling 20 reviews" in result.verdict()
    assert "the whole 95% interval of kappa >= 0.6" in result.verdict()
