"""Round trips of the dataclass <-> protobuf translation."""

import pytest

from calibrl.errors import InvalidArgument
from calibrl.api.judge import CriterionScore, ItemScore, JudgeItem, aggregate
from calibrl.api.judge_wire import item_from_proto, item_score_from_proto, item_score_to_proto, item_to_proto
from calibrl.api.retrieval import Hit, RetrievalScore, ScoreItem, SearchMode
from calibrl.api.retrieval_wire import (
    mode_from_proto,
    mode_to_proto,
    retrieval_score_from_proto,
    retrieval_score_to_proto,
    score_item_from_proto,
    score_item_to_proto,
)


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

def test_retrieval_round_trip():
    score = RetrievalScore(
        hits=(Hit("a", "A", 1.5, 1, "text a"), Hit("b", "B", 0.5, 2, "text b")),
        hit=True, all_gold=False, recall=0.5, mrr=1.0, ndcg=0.61, first_gold_rank=1,
        is_new=(True, False), contains_answer=(False, True), is_gold=(True, False),
    )
    assert retrieval_score_from_proto(retrieval_score_to_proto(score, include_text=True)) == score
    stripped = retrieval_score_from_proto(retrieval_score_to_proto(score, include_text=False))
    assert [h.text for h in stripped.hits] == ["", ""]
    item = ScoreItem("q", ("a",), ("x",), ("b",))
    assert score_item_from_proto(score_item_to_proto(item)) == item
    for mode in SearchMode:
        assert mode_from_proto(mode_to_proto(mode), SearchMode.BM25) == mode
    assert mode_from_proto(0, SearchMode.HYBRID) == SearchMode.HYBRID
    with pytest.raises(InvalidArgument, match="mode: unknown search mode 9"):
        mode_from_proto(9, SearchMode.DENSE)


def test_judge_round_trip_and_aggregation():
    item = JudgeItem.make("q", "out", ["t1"], ["d1"], {"domain": "funds"})
    assert item_from_proto(item_to_proto(item)) == item
    criteria = (CriterionScore("intent", 0.5, 2.0), CriterionScore("entities", 1.0, 1.0),
                CriterionScore("invented", 0.5, 0.4, penalty=True))
    total = aggregate(criteria)
    assert total == pytest.approx((2 * 0.5 + 1.0) / 3 - 0.4 * 0.5)
    score = ItemScore(criteria, total, "r", "h", "m", cached=True)
    assert item_score_from_proto(item_score_to_proto(score), "r", "h", "m") == score
    assert aggregate([CriterionScore("x", 0.0, 1.0), CriterionScore("p", 0.0, 5.0, penalty=True)]) == 0.0
