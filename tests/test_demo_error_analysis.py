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


def _records(scores: list[float], phrasings: int = 1) -> list[ea.SearchRecord]:
    """One record per score whose answer F1 is that score (1.0, 0.5 or 0.0), task ids
    ``q<question>-<phrasing>`` with ``phrasings`` consecutive records per question."""
    answers = {1.0: "90 days", 0.5: "90", 0.0: "none"}
    return [record(BRIDGE, ANSWER_DOC, answer=answers[s], gold="90 days", task_id=f"q{i // phrasings}-{i % phrasings}")
            for i, s in enumerate(scores)]


def test_paired_gain_sees_a_consistent_gain_and_not_a_coin_flip() -> None:
    base = _records([0.0, 0.5, 1.0, 0.0] * 30)
    better = _records([1.0, 0.5, 1.0, 0.5] * 30)  # never worse, often better
    assert [r.f1 for r in base[:4]] == [0.0, pytest.approx(2 / 3), 1.0, 0.0]  # "90" vs "90 days": F1 2/3
    gain = ea.paired_gain(base, better, resamples=2000)
    assert gain.estimate == pytest.approx(math.fsum(b.f1 - a.f1 for a, b in zip(base, better)) / 120)
    assert 0 < gain.low < gain.estimate < gain.high
    swapped = _records([1.0, 0.0] * 60)
    shifted = _records([0.0, 1.0] * 60)
    noise = ea.paired_gain(swapped, shifted, resamples=2000)  # as often better as worse
    assert noise.estimate == pytest.approx(0.0)
    assert noise.low < 0 < noise.high
    assert ea.paired_gain(base, better, resamples=2000) == gain  # seeded
    assert gain.units == 120 and gain.confidence == 0.95


def test_by_question_resamples_whole_questions_and_is_wider() -> None:
    """Six phrasings of each question score alike: resampling phrasings one by one
    overstates the evidence; resampling whole questions gives the honest, wider interval."""
    import random

    rng = random.Random(1)
    per_question = [rng.choice((0.0, 0.0, 1.0, 1.0, 1.0)) for _ in range(20)]
    base = _records([0.0] * 120, phrasings=6)
    other = _records([per_question[i // 6] for i in range(120)], phrasings=6)
    loose = ea.paired_gain(base, other, resamples=4000)
    honest = ea.paired_gain(base, other, resamples=4000, by_question=True)
    assert loose.estimate == pytest.approx(honest.estimate)
    assert honest.high - honest.low > 1.8 * (loose.high - loose.low)
    assert ea.question_of("ms-roth-expense-ratio-3") == "ms-roth-expense-ratio"


def test_question_of_on_the_demo_domain_task_ids() -> None:
    """On the generated domain's ids (plan keys hold a hyphen: ``ms-abernathy-logistics-inception-4``)
    ``question_of`` groups a training question's phrasings and no two held-out tasks, so the
    by-question interval on the held-out set (one phrasing per question) is the per-task one."""
    from calibrl.demo.domain import generate_domain

    domain = generate_domain(0)
    for task in domain.multistep_tasks:
        assert ea.question_of(task.task_id) == task.task_id[: task.task_id.rindex("-")]
        assert task.task_id.rsplit("-", 1)[1].isdigit()
    by_question: dict[str, set[str]] = {}
    for task in domain.multistep("train"):
        by_question.setdefault(ea.question_of(task.task_id), set()).add(task.gold_doc_ids[1])
    assert all(len(docs) == 1 for docs in by_question.values())  # one question, one answer document
    heldout = domain.multistep("heldout")
    assert len({ea.question_of(t.task_id) for t in heldout}) == len(heldout) >= 100
    import random

    rng = random.Random(0)
    base = [record(task_id=t.task_id, answer=rng.choice(("90 days", "90", None))) for t in heldout]
    other = [record(task_id=t.task_id, answer=rng.choice(("90 days", "90", None))) for t in heldout]
    assert ea.paired_gain(base, other, resamples=2000, by_question=True) == ea.paired_gain(base, other, resamples=2000)


def test_paired_em_counts_exact_answers_only() -> None:
    """Verbose -> exact: the value alone instead of the quoted phrase gains a whole point of
    EM but only part of one of F1 (the phrase already had partial F1)."""
    base = [record(task_id=f"q{i}-0", answer="a holding period of 90 days", gold="90 days") for i in range(40)]
    exact = [record(task_id=f"q{i}-0", answer="90 days" if i % 2 else "a holding period of 90 days",
                    gold="90 days") for i in range(40)]
    em = ea.paired_gain(base, exact, metric="em", resamples=2000)
    f1 = ea.paired_gain(base, exact, resamples=2000)
    assert em.estimate == pytest.approx(0.5) and 0 < em.low < em.high < 1
    assert 0 < f1.estimate < em.estimate
    with pytest.raises(ValueError, match="metric='hit'"):
        ea.paired_gain(base, exact, metric="hit")
    results = ea.analysis_results({"base_agent": base, "trained": exact}, {"trained": "trained agent"},
                                  resamples=500)
    assert ea.comparison(results, "trained", "base_agent", "em")["estimate"] == pytest.approx(0.5)
    assert any(line.startswith("- trained agent beats base_agent: +50.0 points of exact match")
               for line in ea.analysis_markdown(results))


def test_paired_gain_rejects_unpaired_input() -> None:
    with pytest.raises(ValueError, match="same questions"):
        ea.paired_gain([record(task_id="a")], [record(task_id="b")])
    from calibrl.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="empty"):
        ea.paired_gain([], [])


def test_identical_scores_give_a_zero_width_interval() -> None:
    same = _records([0.5] * 10)
    diff = ea.paired_gain(same, same, resamples=100)
    assert diff.estimate == diff.low == diff.high == 0.0

# --------------------------------------------------------------------------- shortcuts: constants and read-out

ASPECTS = ("redemption_fee", "risk_rating", "expense_ratio")


def aspect_record(n: int, aspect: str, answer: str | None, gold: str, found: tuple[tuple[str, ...], ...] = ()):
    from calibrl.text import exact_match, token_f1

    return ea.SearchRecord(
        task_id=f"ms-a{n}-{aspect}-0", question="q", answers=(gold,),
        gold_doc_ids=(f"acct{n % 7}-default-investment", f"fund{n}-{aspect.replace('_', '-')}"),
        queries=tuple("q" for _ in found), found=found, answer=answer, well_formed=answer is not None,
        em=exact_match(answer, (gold,)) if answer else 0.0, f1=token_f1(answer, (gold,)) if answer else 0.0)


def test_aspect_of_reads_the_answer_document_and_refuses_unknown_ones() -> None:
    assert ea.aspect_of("summit-redemption-fee", ASPECTS) == "redemption_fee"
    assert ea.aspect_of("x-risk-rating", ("rating", "risk_rating")) == "risk_rating"  # the longest key wins
    with pytest.raises(ValueError, match="none of the aspects"):
        ea.aspect_of("summit-benchmark", ASPECTS)


def test_best_constant_is_the_most_frequent_training_answer_per_aspect() -> None:
    from types import SimpleNamespace

    def task(aspect: str, answer: str) -> SimpleNamespace:
        return SimpleNamespace(gold_doc_ids=("b", f"f-{aspect.replace('_', '-')}"), answers=(answer,))

    train = ([task("redemption_fee", "90 days")] * 3 + [task("redemption_fee", "30 days")] * 2
             + [task("risk_rating", "2"), task("risk_rating", "1")])  # a tie goes to the first in sorted order
    constants = ea.best_constant_answers(train, ASPECTS)
    assert constants == {"redemption_fee": "90 days", "risk_rating": "1"}
    heldout = [aspect_record(i, "redemption_fee", None, ("30 days", "90 days")[i % 2]) for i in range(10)]
    heldout += [aspect_record(10, "expense_ratio", None, "0.41%")]  # an aspect never trained: no answer
    baseline = ea.constant_records(heldout, constants, ASPECTS)
    assert [r.answer for r in baseline[:2]] == ["90 days", "90 days"] and baseline[-1].answer is None
    assert [r.em for r in baseline[:4]] == [0.0, 1.0, 0.0, 1.0] and baseline[0].f1 == pytest.approx(0.5)
    assert all(r.queries == () for r in baseline)


def test_modal_answer_share_detects_an_agent_that_answers_a_constant() -> None:
    golds = ["30 days", "60 days", "90 days", "180 days"]
    constant = [aspect_record(i, "redemption_fee", "90 days", golds[i % 4]) for i in range(20)]
    varied = [aspect_record(i, "redemption_fee", golds[i % 4], golds[i % 4]) for i in range(20)]
    assert ea.modal_answer_shares(constant, ASPECTS)["redemption_fee"] == {
        "questions": 20, "modal_answer": "90 days", "share": 1.0}
    assert ea.modal_answer_shares(varied, ASPECTS)["redemption_fee"]["share"] == pytest.approx(0.25)


def test_readout_counts_reading_the_found_document_and_grounded_answers() -> None:
    passages = {"fund0-risk-rating": "The Summit fund has a risk rating of 4 on the 1 to 5 scale.",
                "fund1-risk-rating": "The Alder fund has a risk rating of 2.", "acct0-default-investment": "..."}
    records = [
        # found the answer document and read it
        aspect_record(0, "risk_rating", "4", "4", found=(("acct0-default-investment",), ("fund0-risk-rating",))),
        # found it, answered a constant: not read out
        aspect_record(0, "risk_rating", "2", "4", found=(("fund0-risk-rating",),)),
        # correct without retrieving any passage that states the value: a lucky constant, not grounded
        aspect_record(1, "risk_rating", "2", "2", found=(("acct0-default-investment",),)),
        # never found the document
        aspect_record(1, "risk_rating", "3", "2", found=()),
    ]
    figures = ea.readout(records, passages)
    assert figures["found_answer_doc"] == 2 and figures["readout_rate"] == pytest.approx(0.5)
    assert figures["correct"] == 2 and figures["grounded_share"] == pytest.approx(0.5)
    assert ea.readout([records[-1]], passages)["readout_rate"] is None


def test_analysis_compares_every_arm_with_the_base_and_the_best_constant_by_bridge_cluster() -> None:
    golds = ["30 days", "60 days", "90 days", "180 days"]
    base = [aspect_record(i, "redemption_fee", "a holding period of 90 days", golds[i % 4]) for i in range(80)]
    constant_arm = [aspect_record(i, "redemption_fee", "90 days", golds[i % 4]) for i in range(80)]
    reader = [aspect_record(i, "redemption_fee", golds[i % 4], golds[i % 4]) for i in range(80)]
    results = ea.analysis_results({"base_agent": base, "constant_arm": constant_arm, "reader": reader}, {},
                                  constants={"redemption_fee": "90 days"}, aspects=ASPECTS, passages={},
                                  resamples=1000)
    assert results["bridge_clusters"] == 7 and results["constant"]["em"] == pytest.approx(0.25)
    # the arm that answers the constant beats the verbose base, but not the best constant itself
    assert ea.comparison(results, "constant_arm", "base_agent", "em")["low"] > 0
    vs_constant = ea.comparison(results, "constant_arm", ea.BEST_CONSTANT, "em")
    assert (vs_constant["estimate"], vs_constant["low"], vs_constant["high"]) == (0.0, 0.0, 0.0)
    assert ea.comparison(results, "reader", ea.BEST_CONSTANT, "f1")["low"] > 0
    assert ea.comparison(results, "reader", "constant_arm", "f1")["low"] > 0
    assert results["modal_answers"]["constant_arm"]["redemption_fee"]["share"] == 1.0
    text = "\n".join(ea.analysis_markdown(results))
    assert "constant_arm and best constant answer per aspect (no search) are indistinguishable" in text
    assert "| redemption_fee | 90 days | 80 | 25.0% |" in text
