"""The search agent's error analysis: the classifier on hand-made trajectories, the
counts, the summary metrics and the paired bootstrap."""

from __future__ import annotations

import math

import pytest

from calibrl.demo import error_analysis as ea

BRIDGE, ANSWER_DOC = "roth-default-investment", "summit-redemption-fee"


def record(*found: tuple[str, ...], answer: str | None = "90 days", well_formed: bool = True,
           gold: str = "90 days", task_id: str = "q") -> ea.SearchRecord:
    from calibrl.text import exact_match, token_f1

    return ea.SearchRecord(
        task_id=task_id, question="How long is the redemption fee holding period of the Roth IRA's default fund?",
        answers=(gold,), gold_doc_ids=(BRIDGE, ANSWER_DOC), queries=tuple(f"query {i}" for i in range(len(found))),
        found=tuple(found), answer=answer, well_formed=well_formed,
        em=exact_match(answer, (gold,)) if answer else 0.0, f1=token_f1(answer, (gold,)) if answer else 0.0,
    )


@pytest.mark.parametrize("rec, category", [
    # no answer, or an answer in a broken trajectory: malformed, whatever it found
    (record((BRIDGE,), (ANSWER_DOC,), answer=None, well_formed=False), ea.MALFORMED),
    (record((BRIDGE,), (ANSWER_DOC,), well_formed=False), ea.MALFORMED),
    # the right answer counts as correct even when the documents were not found (a lucky guess)
    (record((BRIDGE, "x"), (ANSWER_DOC, "y")), ea.CORRECT),
    (record(("x",)), ea.CORRECT),
    (record(("guide-fees",), answer="the 90 days"), ea.CORRECT),  # normalised exact match drops articles
    # the answer document was read but the answer is wrong
    (record((BRIDGE, "x"), (ANSWER_DOC, "y"), answer="60 days"), ea.WRONG_ANSWER),
    (record((ANSWER_DOC,), answer="60 days"), ea.WRONG_ANSWER),  # found on the first search
    (record(("x",), (BRIDGE,), (ANSWER_DOC,), answer="60 days"), ea.WRONG_ANSWER),
    # the first search missed the bridge (and nothing found the answer document)
    (record(("x", "y"), (BRIDGE,), answer="60 days"), ea.MISSED_BRIDGE),
    (record(answer="60 days"), ea.MISSED_BRIDGE),  # answered without searching
    # bridge found, then the second search missed the answer document, or there was none
    (record((BRIDGE, "x"), ("roth-redemption-fee",), answer="60 days"), ea.MISSED_ANSWER_DOC),
    (record((BRIDGE,), answer="60 days"), ea.MISSED_ANSWER_DOC),
])
def test_each_trajectory_gets_the_category_of_its_first_failure(rec: ea.SearchRecord, category: str) -> None:
    assert ea.classify(rec) == category
    assert rec.as_dict()["category"] == category


def test_a_wrong_answer_needs_two_gold_documents_to_be_classified() -> None:
    rec = record((BRIDGE,), answer="60 days")
    one_doc = ea.SearchRecord(**{**rec.__dict__, "gold_doc_ids": (BRIDGE,)})
    with pytest.raises(ValueError, match="bridge and an answer document"):
        ea.classify(one_doc)


def test_analysis_counts_and_shares_every_category() -> None:
    records = [record((BRIDGE,), (ANSWER_DOC,)), record((BRIDGE,), (ANSWER_DOC,), answer="60 days"),
               record((BRIDGE,), answer="60 days"), record((BRIDGE,), answer="60 days"), record(answer=None,
                                                                                              well_formed=False)]
    analysis = ea.analyse(records)
    assert analysis.total == 5
    assert analysis.counts == {ea.MALFORMED: 1, ea.MISSED_BRIDGE: 0, ea.MISSED_ANSWER_DOC: 2, ea.WRONG_ANSWER: 1,
                               ea.CORRECT: 1}
    assert analysis.share(ea.MISSED_ANSWER_DOC) == pytest.approx(0.4)
    assert sum(analysis.as_dict()["shares"].values()) == pytest.approx(1.0)
    # "60 days" vs "90 days": one token of two matches, F1 0.5, three times; one exact answer
    assert analysis.mean_f1 == pytest.approx((1.0 + 3 * 0.5) / 5)


def test_summary_metrics_match_the_trainer_eval_definitions() -> None:
    records = [record((BRIDGE,), (ANSWER_DOC,)), record((BRIDGE,), answer="60 days"),
               record(answer=None, well_formed=False)]
    metrics = ea.summary_metrics(records)
    assert metrics["em"] == pytest.approx(1 / 3)
    assert metrics["f1"] == pytest.approx((1.0 + 0.5) / 3)
    assert metrics["answered"] == pytest.approx(2 / 3)
    assert metrics["well_formed"] == pytest.approx(2 / 3)
    assert metrics["searches"] == pytest.approx(1.0)
    assert metrics["gold_doc_recall"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    with pytest.raises(ValueError):
        ea.summary_metrics([])


def test_paired_bootstrap_sees_a_consistent_gain_and_not_a_coin_flip() -> None:
    base = [0.0, 0.5, 1.0, 0.0] * 30
    better = [1.0, 0.5, 1.0, 0.5] * 30  # never worse, often better
    gain = ea.paired_bootstrap(base, better, resamples=2000)
    assert gain.mean == pytest.approx(0.375)
    assert 0 < gain.low < gain.mean < gain.high
    swapped = [1.0, 0.0] * 60
    noise = ea.paired_bootstrap(swapped, swapped[1:] + swapped[:1], resamples=2000)  # as often better as worse
    assert noise.mean == pytest.approx(0.0)
    assert noise.low < 0 < noise.high
    # the same seed gives the same interval; the interval is a percentile of the resampled means
    assert ea.paired_bootstrap(base, better, resamples=2000) == gain
    assert gain.n == 120 and gain.resamples == 2000 and gain.confidence == 0.95


def test_paired_bootstrap_rejects_unpaired_input() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        ea.paired_bootstrap([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="no paired"):
        ea.paired_bootstrap([], [])
    with pytest.raises(ValueError, match="same questions"):
        ea.paired_f1([record(task_id="a")], [record(task_id="b")])


def test_identical_scores_give_a_zero_width_interval() -> None:
    same = [0.5] * 10
    diff = ea.paired_bootstrap(same, same, resamples=100)
    assert diff.mean == diff.low == diff.high == 0.0
    assert not math.isnan(diff.mean)
