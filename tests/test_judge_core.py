"""The in-process Judge: validation gate, tenancy, input limits, aggregation and the result cache."""

import pytest

from calibrl.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from calibrl.judge_server.cache import ResultCache
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.judge_server.judge import Judge, load_llm
from calibrl.judge_server.rubric import parse_rubric
from calibrl.testing import build_tiny_causal_lm
from calibrl.api.judge import CriterionScore, JudgeItem, aggregate
from calibrl.judge_server.authoring.validation import ValidationOptions, agreement, find_record, read_records, write_record

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

PROGRAMMATIC = """\
id: rewriter
version: "1"
glossary: [expense ratio]
tenants: [team-a]
criteria:
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.6, tags: [missing_entity]}
  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.4, tags: [underspecified]}
  - {name: no_invented, kind: programmatic, scorer: invented_entities, weight: 0.5, penalty: true,
     tags: [invented_entity]}
"""
WITH_LLM = """\
id: llm-rubric
version: "1"
criteria:
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 1.0}
  - {name: intent, kind: llm, question: "Does the output keep the intent of the query?", weight: 1.0}
"""
CONFIG = JudgeConfig(embedder="hashed-ngrams")
GOOD = JudgeItem.make("VTSAX expense ratio", "What is the expense ratio of the VTSAX fund?")
DROPPED = JudgeItem.make("VTSAX expense ratio", "fund info")
INVENTED = JudgeItem.make("VTSAX expense ratio", "VTSAX expense ratio compared with VFIAX fund costs")


def unvalidated_config(**changes):
    return JudgeConfig(**{**CONFIG.__dict__, "allow_unvalidated": True, **changes})


def test_scores_aggregate_and_penalties():
    judge = Judge([parse_rubric(PROGRAMMATIC)], unvalidated_config())
    good, dropped, invented = judge.score("rewriter", [GOOD, DROPPED, INVENTED])
    assert good.by_name() == {"entities": 1.0, "specificity": 1.0, "no_invented": 1.0} and good.total == 1.0
    assert dropped.by_name()["entities"] == 0.0 and dropped.total < 0.2
    assert invented.by_name()["no_invented"] == 0.0
    assert invented.total == pytest.approx(aggregate(invented.criteria)) == pytest.approx(1.0 - 0.5)
    assert [c.name for c in good.criteria] == ["entities", "specificity", "no_invented"]
    assert good.rubric_id == "rewriter" and good.rubric_hash == judge.resolve("rewriter").hash
    assert good.model_id == "programmatic[hashed-ngrams]" == judge.model_id


def test_unvalidated_rubric_is_refused_until_a_passing_record_exists(tmp_path):
    rubric = parse_rubric(PROGRAMMATIC, str(tmp_path / "r.yaml"))
    judge = Judge([rubric], CONFIG)
    with pytest.raises(FailedPrecondition) as info:
        judge.score("rewriter", [GOOD])
    message = str(info.value)
    assert "rubric 'rewriter'" in message and rubric.hash in message and "programmatic[hashed-ngrams]" in message
    assert "no validation record" in message and "--allow-unvalidated" in message
    assert [s.validated for s in judge.statuses()] == [False]

    golden = [FeedbackRecord(i.query, i.output, grade=g, error_tags=t) for i, g, t in
              [(GOOD, 5, ()), (DROPPED, 2, ("missing_entity",)), (INVENTED, 2, ("invented_entity",))] * 4]
    scores = Judge([rubric], unvalidated_config()).score("rewriter", [r.to_item() for r in golden])
    record = agreement(rubric, judge.model_id, golden, scores, ValidationOptions(min_items=10))
    assert record.passed and record.kappa == pytest.approx(1.0)
    assert record.metrics["criteria"]["entities"]["recall"] == 1.0
    path = tmp_path / "r.yaml.validation.json"
    write_record(path, record)
    validated = Judge([rubric], CONFIG, validations=read_records(path))
    assert validated.score("rewriter", [GOOD])[0].total == 1.0
    assert validated.statuses()[0].validated
    # Bound to the model: another judge model id is still refused.
    other = Judge([rubric], JudgeConfig(), validations=read_records(path))
    with pytest.raises(FailedPrecondition, match=r"programmatic\[minilm-l6-v2\]"):
        other.score("rewriter", [GOOD])
    # A failed record refuses too, and says why.
    failed = agreement(rubric, judge.model_id, golden[:3], scores[:3], ValidationOptions(min_items=10))
    assert not failed.passed and "fewer than min_items=10" in failed.reason
    with pytest.raises(FailedPrecondition, match="its validation for this model failed"):
        Judge([rubric], CONFIG, validations=[failed]).score("rewriter", [GOOD])
    # Re-validation replaces the record of the same (hash, model id).
    assert len(write_record(path, failed)) == 1 and not read_records(path)[0].passed
    assert find_record(read_records(path), rubric.hash, "other-model") is None


def test_programmatic_backend_refuses_llm_criteria():
    judge = Judge([parse_rubric(WITH_LLM)], unvalidated_config())
    status = judge.status("llm-rubric")
    assert not status.usable and "has LLM criteria ['intent']" in status.reason
    with pytest.raises(FailedPrecondition, match="judge backend is 'programmatic'"):
        judge.score("llm-rubric", [GOOD])


def test_tenancy_and_lookup_errors():
    judge = Judge([parse_rubric(PROGRAMMATIC), parse_rubric(WITH_LLM)], unvalidated_config())
    assert [s.rubric.id for s in judge.statuses()] == ["llm-rubric", "rewriter"]
    assert [s.rubric.id for s in judge.statuses("team-a")] == ["rewriter"]
    assert judge.statuses("team-b") == []
    assert judge.score("rewriter", [GOOD], tenant="team-a")[0].total == 1.0
    with pytest.raises(NotFound, match="rubric 'rewriter' not found"):
        judge.score("rewriter", [GOOD], tenant="team-b")
    with pytest.raises(NotFound, match="rubric 'nope' not found"):
        judge.score("nope", [GOOD])
    with pytest.raises(InvalidArgument, match="rubric_id: empty"):
        judge.score("", [GOOD])
    with pytest.raises(InvalidArgument, match=r"rubric_hash: 'abc' does not match the served rubric 'rewriter'"):
        judge.score("rewriter", [GOOD], rubric_hash="abc")
    assert judge.score("rewriter", [GOOD], rubric_hash=judge.resolve("rewriter").hash)


def test_input_limits_name_field_and_limit():
    judge = Judge([parse_rubric(PROGRAMMATIC)], unvalidated_config(max_batch_size=3, max_text_chars=50,
                                                                  max_retrieved=2))
    cases = [
        ([], InvalidArgument, "items: empty batch"),
        ([GOOD] * 4, ResourceExhausted, "items: 4 items in one request, limit max_batch_size=3"),
        ([GOOD, JudgeItem.make("q", "  ")], InvalidArgument, r"items\[1\].output: empty"),
        ([JudgeItem.make("", "o")], InvalidArgument, r"items\[0\].query: empty"),
        ([JudgeItem.make("q", "x" * 51)], ResourceExhausted, r"items\[0\].output: 51 characters, limit max_text_chars=50"),
        ([JudgeItem.make("q", "o", ["a", "b", "c"])], ResourceExhausted,
         r"items\[0\].retrieved_texts: 3 entries, limit max_retrieved=2"),
        ([JudgeItem.make("q", "o", ["a" * 60])], ResourceExhausted, r"items\[0\].retrieved_texts\[0\]: 60 characters"),
    ]
    for items, error, message in cases:
        with pytest.raises(error, match=message):
            judge.score("rewriter", items)


def test_cache_answers_identical_items_identically(tmp_path):
    rubric = parse_rubric(PROGRAMMATIC)
    db = tmp_path / "cache.sqlite"
    judge = Judge([rubric], unvalidated_config(cache_path=str(db)))
    first = judge.score("rewriter", [GOOD, DROPPED, GOOD])
    assert [s.cached for s in first] == [False, False, False]
    assert judge.cache.stats.misses == 3 and len(judge.cache) == 2  # duplicates computed once
    again = judge.score("rewriter", [DROPPED, GOOD])
    assert [s.cached for s in again] == [True, True]
    assert (again[0].criteria, again[0].total) == (first[1].criteria, first[1].total)
    judge.close()
    # The SQLite file answers a new judge (e.g. after a restart).
    restarted = Judge([rubric], unvalidated_config(cache_path=str(db), cache_size=1))
    assert restarted.score("rewriter", [GOOD])[0].cached and restarted.cache.stats.disk_hits == 1
    # A different rubric hash is a different key.
    changed = parse_rubric(PROGRAMMATIC.replace("weight: 0.4", "weight: 0.3"))
    assert not Judge([changed], unvalidated_config(cache_path=str(db))).score("rewriter", [GOOD])[0].cached
    no_cache = Judge([rubric], unvalidated_config(cache_size=0))
    assert not any(s.cached for s in no_cache.score("rewriter", [GOOD]) + no_cache.score("rewriter", [GOOD]))


def test_lru_evicts_oldest():
    cache = ResultCache(max_items=2)
    from calibrl.api.judge import ItemScore

    score = ItemScore((CriterionScore("a", 0.5, 1.0),), 0.5)
    for key in ("k1", "k2", "k3"):
        cache.put(key, score)
    assert cache.get("k1", "r", "h", "m") is None
    assert cache.get("k3", "r", "h", "m").total == 0.5 and len(cache) == 2


def test_llm_rubric_with_tiny_transformers_judge(tmp_path):
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = build_tiny_causal_lm(tmp_path / "judge", seed=4)
        config = unvalidated_config(backend=f"transformers:{folder}", device="cpu")
        judge = Judge([parse_rubric(WITH_LLM), parse_rubric(PROGRAMMATIC)], config, llm=load_llm(config))
        assert judge.model_id.startswith("transformers:judge@") and judge.model_id.endswith("[hashed-ngrams]")
        scores = judge.score("llm-rubric", [GOOD, DROPPED])
        for score in scores:
            intent = score.by_name()["intent"]
            assert 0.0 < intent < 1.0
            assert score.total == pytest.approx((score.by_name()["entities"] + intent) / 2)
        assert scores[0].by_name()["intent"] != scores[1].by_name()["intent"]
        assert judge.score("rewriter", [GOOD])[0].total == 1.0  # programmatic rubrics work with any backend
    finally:
        torch.set_num_threads(threads)


def test_huge_identifiers_are_cut_in_error_messages():
    judge = Judge([parse_rubric(PROGRAMMATIC)], unvalidated_config())
    with pytest.raises(NotFound) as info:
        judge.score("x" * 20_000, [GOOD])
    assert len(str(info.value)) < 300 and "(20000 characters)" in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        judge.score("rewriter", [GOOD], rubric_hash="f" * 20_000)
    assert len(str(info.value)) < 400 and "(20000 characters)" in str(info.value)
