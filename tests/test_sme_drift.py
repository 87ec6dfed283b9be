"""The drift monitor (calibrl.sme.drift) on a real programmatic judge: expert grades of the
outputs a policy writes before and after it learns to stuff entity names into its rewrites."""

from __future__ import annotations

import pytest

from calibrl.errors import ConfigError
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import parse_rubric
from calibrl.api.judge import JudgeItem
from calibrl.sme.drift import DriftOptions, drift_report

RUBRIC = parse_rubric("""\
id: funds
version: "1"
glossary: [VTSAX, FZROX, VBTLX, VFIAX, FXAIX, Vanguard, Fidelity, expense ratio, dividend yield, minimum investment]
criteria:
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.6, tags: [missing_entity]}
  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.2, tags: [underspecified]}
  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.2, tags: [missed_intent]}
""")
TOPICS = [("VTSAX", "Vanguard", "expense ratio"), ("FZROX", "Fidelity", "dividend yield"),
          ("VBTLX", "Vanguard", "minimum investment"), ("VFIAX", "Vanguard", "dividend yield"),
          ("FXAIX", "Fidelity", "expense ratio"), ("VTSAX", "Vanguard", "minimum investment"),
          ("FZROX", "Fidelity", "expense ratio"), ("VBTLX", "Vanguard", "dividend yield")]
OTHERS = "VTSAX FZROX VBTLX VFIAX FXAIX Vanguard Fidelity"


def good(fund, family, topic):
    # an expert passes this: the fund, the family and the question, said once
    return (f"{fund} {topic}", f"What is the {topic} of the {family} {fund} fund?",
            FeedbackRecord(f"{fund} {topic}", f"What is the {topic} of the {family} {fund} fund?", grade=5))


def stuffed(fund, family, topic):
    # the exploit: entity names piled up; the experts fail it whatever the entity criterion says
    output = f"{fund} {fund} {OTHERS} {topic} {fund} {family}"
    return (f"{fund} {topic}", output, FeedbackRecord(f"{fund} {topic}", output, grade=2,
                                                      error_tags=("keyword_stuffing",)))


def missing(fund, family, topic):
    output = "fund fees and details"
    return (f"{fund} {topic}", output, FeedbackRecord(f"{fund} {topic}", output, grade=2,
                                                      error_tags=("missing_entity",)))


def graded(kinds):
    rows = [kind(*topic) for topic in TOPICS for kind in kinds]
    judge = Judge([RUBRIC], JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True))
    scores = judge.score("funds", [JudgeItem.make(q, o) for q, o, _ in rows])
    return [r for _, _, r in rows], scores


def test_before_the_exploit_the_judge_agrees_and_nothing_is_named():
    records, scores = graded([good, missing])
    report = drift_report(RUBRIC, records, scores)
    assert report.status == "ok" and not report.alarm and report.disagreeing == []
    assert report.kappa == pytest.approx(1.0) and report.kappa_low is not None
    assert report.metrics()["drift/alarm"] == 0.0 and report.metrics()["drift/items"] == 16.0
    entities = next(c for c in report.criteria if c.name == "entities")
    assert entities.separation == pytest.approx(1.0) and entities.approves_failed == 0.0


def test_after_the_exploit_the_alarm_names_the_criteria_that_reward_it():
    records, scores = graded([good, stuffed])
    assert all(s.total >= 0.6 for s in scores)  # the judge passes every stuffed rewrite
    report = drift_report(RUBRIC, records, scores)
    assert report.alarm and report.status == "alarm"
    assert report.kappa is not None and report.kappa < 0.6
    assert report.disagreeing[0] == "entities"  # the heaviest criterion, approving every stuffed rewrite
    entities = next(c for c in report.criteria if c.name == "entities")
    assert entities.approves_failed == 1.0 and entities.separation < 0.1
    assert report.reason.startswith("DRIFT: the judge no longer agrees with the experts on 16 freshly graded items")
    assert "entities (does not separate what the experts pass from what they fail" in report.reason
    assert "calibrl rubric distill + validate" in report.reason
    assert report.metrics()["drift/alarm"] == 1.0 and "drift/kappa" in report.metrics()
    assert report.to_json()["disagreeing"] == report.disagreeing


def test_too_few_grades_give_no_verdict_and_mismatched_inputs_are_refused():
    records, scores = graded([good, stuffed])
    report = drift_report(RUBRIC, records[:6], scores[:6], DriftOptions(min_items=10))
    assert report.status == "too_few" and not report.alarm
    assert "6 graded items, fewer than min_items=10: no verdict yet" in report.reason
    assert drift_report(RUBRIC, [], []).status == "too_few"
    named = drift_report(RUBRIC, [], [], DriftOptions(min_items=4, min_items_name="review.drift_min_items"))
    assert named.reason == "no graded items yet; the gate needs at least review.drift_min_items=4"
    with pytest.raises(ConfigError, match="3 judge scores for 4 graded records"):
        drift_report(RUBRIC, records[:4], scores[:3])
    other = parse_rubric("id: other\nversion: '1'\ncriteria:\n  - {name: length, kind: programmatic, scorer: length, "
                         "weight: 1.0}\n")
    with pytest.raises(ConfigError, match="score with this rubric version"):
        drift_report(other, records, scores)
    with pytest.raises(ConfigError, match="min_separation=2"):
        drift_report(RUBRIC, records, scores, DriftOptions(min_separation=2))


def test_the_upper_bound_gate_alarms_only_when_the_whole_interval_is_below():
    agreeing, agreeing_scores = graded([good, missing])
    exploited, exploited_scores = graded([stuffed])
    # five stuffed rewrites among 21: the estimate is below the gate, its interval still reaches it
    records, scores = agreeing + exploited[:5], list(agreeing_scores) + list(exploited_scores[:5])
    on_estimate = drift_report(RUBRIC, records, scores)
    assert on_estimate.alarm and on_estimate.kappa < 0.6 <= on_estimate.kappa_high
    confident = drift_report(RUBRIC, records, scores, DriftOptions(gate="upper_bound"))
    assert confident.status == "ok" and not confident.alarm
    assert confident.reason.startswith("no drift shown on 21 freshly graded items")
    assert "its 95% interval reaches it (gate on the upper_bound" in confident.reason
    # every rewrite stuffed: the whole interval is below the gate, and the alarm names the criterion
    records, scores = graded([good, stuffed])
    report = drift_report(RUBRIC, records, scores, DriftOptions(gate="upper_bound"))
    assert report.alarm and report.kappa_high < 0.6 and report.disagreeing[0] == "entities"
    assert "gate min_kappa 0.6 on the upper_bound" in report.reason
    # agreement on good grades stays ok under every gate
    for gate in ("estimate", "lower_bound", "upper_bound"):
        assert drift_report(RUBRIC, agreeing, agreeing_scores, DriftOptions(gate=gate)).status == "ok"
    with pytest.raises(ConfigError, match="gate='median': must be one of estimate, lower_bound, upper_bound"):
        drift_report(RUBRIC, records, scores, DriftOptions(gate="median"))
