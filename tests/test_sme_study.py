"""The SME-time study: validation kappa vs number of reviews, representative vs random."""

import json

import numpy as np
import pytest

from calibrl.sme.items import SampleItem
from calibrl.sme.study import StudyOptions, StudyPoint, StudyResult, plot_study, run_study, validation_kappa
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
    options = StudyOptions(pass_threshold=0.6, glossary=SYNTHETIC_GLOSSARY)
    kappa, passed, note = validation_kappa(reviews, golden, options, FAST_JUDGE)
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
    assert note == ""
    # Too few reviews to distil a rubric: no kappa, a failed gate, and the reason kept.
    kappa, passed, note = validation_kappa(reviews[:1], golden, options, FAST_JUDGE)
    assert kappa is None and not passed and note


def _glossary(tmp_path):
    path = tmp_path / "glossary.txt"
    path.write_text("\n".join(SYNTHETIC_GLOSSARY) + "\n")
    return path


def test_study_runs_both_samplers_on_every_budget(tmp_path):
    pool, answers, golden = study_inputs()
    vectors = np.random.default_rng(0).standard_normal((len(pool), 8))
    options = StudyOptions(budgets=(2, 10, 40, 10_000), random_repeats=2, pass_threshold=0.6,
                           glossary=SYNTHETIC_GLOSSARY)
    lines = []
    result = run_study(pool, answers, golden, options, vectors=vectors, judge_config=FAST_JUDGE, progress=lines.append)
    assert result.budgets() == [2, 10, 40]  # a budget above the pool is left out
    for budget in (2, 10, 40):
        assert len(result.kappas("representative", budget)) == 1 and len(result.kappas("random", budget)) == 2
    assert len(lines) == 3 and lines[0].startswith("2 reviews: representative kappa")
    needed = result.reviews_needed("representative")
    assert needed is None or (result.summary_kappa("representative", needed) >= 0.6
                              and all(result.summary_kappa("representative", b) < 0.6
                                      for b in result.budgets() if b < needed))
    table = result.table()
    assert table.count("\n") == 1 + 3 and "| 40 |" in table
    assert f"from a pool of {len(pool)}" in result.verdict()
    path = plot_study(result, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(result.to_json()))["pool_size"] == len(pool)
    with pytest.raises(ValueError, match="have no answer"):
        run_study(pool, {}, golden, options, vectors=vectors, judge_config=FAST_JUDGE)


def test_reviews_needed_uses_the_median_of_random_draws():
    result = StudyResult(StudyOptions(min_kappa=0.6, random_repeats=3), pool_size=100, golden_size=30)
    result.points = [
        StudyPoint("representative", 10, 0, None, False, "no criteria"),
        StudyPoint("representative", 20, 0, 0.7, True),
        StudyPoint("random", 10, 0, 0.9, True), StudyPoint("random", 10, 1, 0.2, False),
        StudyPoint("random", 10, 2, None, False, "no criteria"),  # counts as -1
        StudyPoint("random", 20, 0, 0.65, True), StudyPoint("random", 20, 1, 0.61, True),
        StudyPoint("random", 20, 2, 0.1, False),
    ]
    assert result.reviews_needed("representative") == 20 and result.reviews_needed("random") == 20
    assert result.summary_kappa("random", 10) == pytest.approx(0.2)
    assert "| 10 | no rubric | 0.200 (no rubric-0.900) | 1/3 |" in result.table()
    assert "representative sampling 20 reviews, random sampling 20 reviews" in result.verdict()
