"""The demo's LLM judge (calibrl/demo/judge_model.py): built from nothing on the demo
domain, fine-tuned on the training reviews only, validated on the golden set, and found
validated by a judge configured the way the demo serves it; plus the report's judge part
(calibrl/demo/judge_report.py) on hand-made runs."""

from __future__ import annotations

import pathlib

import pytest

from tests.conftest import torch_threads_one

from calibrl.demo import cli as demo_cli
from calibrl.demo import judge_report as jr
from calibrl.demo.report import RunResult

torch = pytest.importorskip("torch")

one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)

# No trained figure is pinned here: whether a judge passes its gate is a result of the run (the
# demo reports it either way); the tests check that the decision follows the kappa interval.


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.demo.judge_model import LLM_RUBRIC_ID, JudgeModelSettings, build_and_validate_judge, distill_llm_rubric

    out = tmp_path_factory.mktemp("demo-judge")
    domain = generate_domain(0)
    files = write_domain(domain, out / "data")
    rubrics = out / "rubrics"
    _, golden = demo_cli.distill_rubric(files.sme_feedback, domain.glossary_terms(), rubrics / "demo-rewriter.yaml",
                                        out / "golden.jsonl")
    rubric_path = rubrics / f"{LLM_RUBRIC_ID}.yaml"
    rubric = distill_llm_rubric(files.sme_feedback, domain.glossary_terms(), rubric_path)
    settings = JudgeModelSettings(warm_steps=demo_cli.QUICK.judge_warm_steps, epochs=demo_cli.QUICK.judge_epochs)
    judge = build_and_validate_judge(domain, files.sme_feedback, rubric, rubric_path, golden, out / "golden.jsonl",
                                     out / "judge_model", settings, pass_threshold=demo_cli.PASS_THRESHOLD,
                                     gate=demo_cli.GATE, progress=False)
    return out, rubric, rubric_path, golden, judge


def test_llm_rubric_asks_one_question_per_sme_tag(built):
    _, rubric, _, _, _ = built
    assert rubric.criteria and all(c.kind == "llm" and c.scale == "yes_no" for c in rubric.criteria)
    assert {t for c in rubric.criteria for t in c.tags} == {"underspecified", "missing_entity", "missed_intent",
                                                            "invented_entity"}


def test_golden_reviews_are_never_trained_on(built):
    from calibrl.judge_server.authoring.distill import text_key

    _, _, _, golden, judge = built
    trained = {r.record_hash for r in judge.training.train}
    assert trained and not trained & {r.record_hash for r in golden}
    assert not {text_key(r) for r in judge.training.train} & {text_key(r) for r in golden}  # nor a golden text
    assert len(judge.training.train) + len(golden) == 300  # every review is one or the other


def test_the_judges_gate_follows_its_kappa_interval_and_a_threshold_picked_off_the_golden_set(built):
    _, _, _, golden, judge = built
    record = judge.validation
    assert record.n_items == len(golden) and record.gate == demo_cli.GATE == "lower_bound"
    assert record.pass_threshold_source == "auto"
    selection = record.metrics["threshold_selection"]
    assert selection["threshold"] == record.pass_threshold and selection["n_items"] == len(judge.training.train)
    assert record.kappa_low <= record.kappa <= record.kappa_high
    assert record.passed == (record.kappa_low >= record.min_kappa)
    assert record.kappa_text() in record.reason and "95% bootstrap interval" in record.reason


def test_the_served_judge_finds_the_validation_record(built):
    """A judge configured as `calibrl serve judge` is in the demo (same SPEC and prompt
    options) serves the LLM rubric as validated, and the programmatic rubric beside it."""
    from calibrl.demo.judge_model import judge_config
    from calibrl.judge_server.judge import Judge

    out, rubric, rubric_path, golden, judge = built
    programmatic = demo_cli.validate_rubric(*_programmatic(out), out / "rubrics" / "demo-rewriter.yaml",
                                            out / "data" / "sme_feedback.jsonl")
    served = Judge.from_config(judge_config(judge.spec, allow_unvalidated=True), rubric_path.parent)
    assert served.model_id == judge.model_id == judge.validation.model_id
    # a rubric is served as validated exactly when its record passed the gate
    assert served.status(rubric.id).validated == judge.validation.passed
    assert served.status("demo-rewriter").validated == programmatic.passed
    scores = served.score(rubric.id, [r.to_item() for r in golden[:4]])
    assert all(0.0 <= s.total <= 1.0 and s.model_id == judge.model_id for s in scores)


def _programmatic(out: pathlib.Path):
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.rubric import load_rubric

    return load_rubric(out / "rubrics" / "demo-rewriter.yaml"), read_feedback(out / "golden.jsonl")


# --- the report's judge part ----------------------------------------------------------------------------------------


def _steps(n: int, **series: float) -> list[dict]:
    return [{"step": s, **{k: v for k, v in series.items()}} for s in range(1, n + 1)]


def test_dynamic_sampling_lines_compare_the_three_arms_by_their_intervals():
    from calibrl.demo.rewrite_analysis import rewrite_results

    binary = RunResult("binary", "binary", "rewrite", {"hit": 0.25}, steps=_steps(3))
    dynamic = RunResult("binary_ds", "binary+ds", "rewrite", {"hit": 0.30},
                        steps=_steps(3, **{"sampling/kept_groups": 6.0, "sampling/extra_rollouts": 32.0}))
    dense = RunResult("dense", "dense", "rewrite", {"hit": 0.45}, steps=_steps(3))
    clusters = [i // 5 for i in range(100)]
    hits = {"binary": [float(i % 20 < 5) for i in range(100)],
            "binary_ds": [float(i % 20 < 6) for i in range(100)],  # +5 points, every cluster alike
            "dense": [float(i % 20 < 6) if (i // 5) % 2 else float(i % 20 < 10) for i in range(100)]}
    lines = jr.dynamic_sampling_lines(binary, dynamic, dense, 1, rewrite_results(hits, clusters, resamples=1000))
    assert "kept 6.0 groups" in lines[0] and "drew 32.0 extra rollouts" in lines[0]
    assert lines[1].startswith("binary+ds beats binary: +5.0 points of hit@1")
    assert lines[2].startswith("dense") and "binary+ds" in lines[2] and len(lines) == 3
    assert jr.dynamic_sampling_lines(binary, None, dense, 1) == []
    # without task-by-task records no comparison is worded at all
    assert len(jr.dynamic_sampling_lines(binary, dynamic, dense, 1)) == 1


def test_disagreement_plot_and_lines(tmp_path):
    values = [0.1, 0.4, 0.2, 0.5]
    dense = RunResult("dense", "dense", "rewrite", {"hit": 0.4},
                      steps=[{"step": s + 1, jr.DISAGREEMENT_KEY: v} for s, v in enumerate(values)])
    path = jr.plot_disagreement([dense], 0.3, tmp_path / "d.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    (line,) = jr.disagreement_lines([dense], 0.3)
    assert "30.0% of rewrites on average (last step 50.0%)" in line and "2 of 4 steps" in line
    assert jr.plot_disagreement([RunResult("binary", "b", "rewrite", {}, steps=_steps(2))], 0.3,
                                tmp_path / "none.png") is None


def test_server_section_lists_every_served_rubric():
    stats = {"llm": jr.RubricServerStats(calls=4, batches=2, batch_items=30, cache_hits=2, cache_misses=30)}
    lines = jr.server_section(stats, {"llm": "LLM judge x", "steps": "programmatic criteria"}, {"llm": ["dense"]})
    assert "| llm | LLM judge x | dense | 4 | 2 | 15.0 | 0 | 0 | 2 | 30 |" in lines
    assert "| steps | programmatic criteria | none in this run | 0 | 0 | - | 0 | 0 | 0 | 0 |" in lines


def test_validation_section_states_each_kappa_with_its_interval_and_the_gates_decision():
    from calibrl.demo.experts import PairKappa
    from calibrl.judge_server.authoring.validation import ValidationRecord

    def record(kappa, low, high, passed, reason):
        return ValidationRecord(rubric_id="r", rubric_hash="h", model_id="m", passed=passed, kappa=kappa,
                                min_kappa=0.6, pass_threshold=0.42, n_items=81, golden_sha256="g", reason=reason,
                                pass_threshold_source="auto", kappa_low=low, kappa_high=high, gate="lower_bound")

    records = {"programmatic judge": record(0.448, 0.25, 0.63, False, "kappa 0.448 [0.25, 0.63]: its 95% ..."),
               "LLM judge": record(0.9, 0.81, 0.96, True, "kappa 0.900 [0.81, 0.96]: the whole 95% ...")}
    panel = [PairKappa("a", "b", 0.88, 0.82, 0.93, 300, 210)]
    text = "\n".join(jr.validation_section(records, 0.6, panel))
    assert "| 0.420 (auto) | 0.448 [0.25, 0.63] |" in text and "FAILED (interval's low end vs 0.6)" in text
    assert "| 0.900 [0.81, 0.96] |" in text and "passed (interval's low end vs 0.6)" in text
    assert "the whole 95% bootstrap interval of Cohen's kappa on pass/fail >= 0.6" in text
    assert "- programmatic judge: gate FAILED: kappa 0.448 [0.25, 0.63]" in text
    assert "a vs b 0.880 [0.82, 0.93]" in text
    rows = jr.validation_rows(records)
    assert [(r["kappa_low"], r["kappa_high"], r["gate"]) for r in rows] == [(0.25, 0.63, "lower_bound"),
                                                                           (0.81, 0.96, "lower_bound")]
