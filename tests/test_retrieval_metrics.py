"""Pure parts of the retrieval service: metrics, fusion, BM25 top-k, signals, input rules, config.
No model, no index: these run in well under a second."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrl.config import load_config
from calibrl.errors import ConfigError, InvalidArgument, ResourceExhausted
from calibrl.retrieval_server import metrics
from calibrl.retrieval_server.config import RetrievalServerConfig
from calibrl.retrieval_server.fusion import reciprocal_rank_fusion
from calibrl.retrieval_server.limits import RetrievalLimits, check_score, check_search, parse_mode
from calibrl.retrieval_server.signals import score_hits
from calibrl.retrieval_server.sparse import top_positive
from calibrl.api.retrieval import Hit, ScoreItem, SearchMode

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

RANKED = ["a", "b", "c", "d", "e"]


def test_metrics_on_a_hand_computed_ranking():
    gold = {"c", "e", "z"}  # z is never retrieved
    assert metrics.first_gold_rank(RANKED, gold) == 3
    assert metrics.first_gold_rank(RANKED, gold, k=2) == 0
    assert not metrics.hit_at_k(RANKED, gold, 2) and metrics.hit_at_k(RANKED, gold, 3)
    assert metrics.recall_at_k(RANKED, gold, 3) == pytest.approx(1 / 3)
    assert metrics.recall_at_k(RANKED, gold, 5) == pytest.approx(2 / 3)
    assert not metrics.all_gold_at_k(RANKED, gold, 5)
    assert metrics.all_gold_at_k(RANKED, {"c", "e"}, 5) and not metrics.all_gold_at_k(RANKED, {"c", "e"}, 4)
    assert metrics.reciprocal_rank(RANKED, gold, 5) == pytest.approx(1 / 3)
    # DCG = 1/log2(4) + 1/log2(6); ideal (3 gold within k=5) = 1 + 1/log2(3) + 1/log2(4)
    expected = (0.5 + 1 / math.log2(6)) / (1 + 1 / math.log2(3) + 0.5)
    assert metrics.ndcg_at_k(RANKED, gold, 5) == pytest.approx(expected)
    # A hand-computed value printed to 5 decimals: abs 1e-5 is its rounding.
    assert metrics.ndcg_at_k(RANKED, gold, 5) == pytest.approx(0.41618, abs=1e-5)
    assert metrics.ndcg_at_k(RANKED, gold, 2) == 0.0
    # ideal list at k=1 needs one gold only
    assert metrics.ndcg_at_k(["c", "a"], gold, 1) == pytest.approx(1.0)
    assert metrics.ndcg_at_k(["c", "e"], {"c", "e"}, 2) == pytest.approx(1.0)


def test_metrics_without_gold_are_zero_and_duplicates_count_once():
    for k in (1, 5):
        assert metrics.recall_at_k(RANKED, [], k) == 0.0
        assert metrics.ndcg_at_k(RANKED, [], k) == 0.0
        assert metrics.reciprocal_rank(RANKED, [], k) == 0.0
        assert not metrics.all_gold_at_k(RANKED, [], k)
    assert metrics.recall_at_k(["c"], ["c", "c", "e"], 1) == pytest.approx(0.5)
    assert metrics.ndcg_at_k(["c", "c"], ["c"], 2) == pytest.approx(1.0)


def test_new_and_gold_flags():
    assert metrics.new_flags(["a", "b", "a", "c"], seen_ids=["c"]) == [True, True, False, False]
    assert metrics.gold_flags(["a", "b", "c"], {"c", "q"}) == [False, False, True]


def _ndcg_reference(ranked, gold, k):
    rel = [1.0 if d in gold else 0.0 for d in ranked[:k]]
    dcg = sum(r / math.log2(i + 2) for i, r in enumerate(rel))
    ideal = sorted([1.0] * len(gold) + [0.0] * k, reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    return dcg / idcg if idcg else 0.0


@settings(max_examples=200, deadline=None)
@given(
    ranked=st.lists(st.integers(0, 20), unique=True, max_size=15).map(lambda xs: [str(x) for x in xs]),
    gold=st.sets(st.integers(0, 20), max_size=5).map(lambda xs: {str(x) for x in xs}),
    k=st.integers(1, 15),
)
def test_metric_properties(ranked, gold, k):
    ndcg = metrics.ndcg_at_k(ranked, gold, k)
    assert ndcg == pytest.approx(_ndcg_reference(ranked, gold, k))
    assert 0.0 <= ndcg <= 1.0 + 1e-12  # DCG / IDCG of equal float64 sums may round 1 ulp above 1
    assert metrics.hit_at_k(ranked, gold, k) == (metrics.first_gold_rank(ranked, gold, k) > 0)
    assert metrics.recall_at_k(ranked, gold, k) <= metrics.recall_at_k(ranked, gold, k + 1)
    assert metrics.all_gold_at_k(ranked, gold, k) == (bool(gold) and metrics.recall_at_k(ranked, gold, k) == 1.0)
    rr = metrics.reciprocal_rank(ranked, gold, k)
    assert rr == (1 / metrics.first_gold_rank(ranked, gold, k) if rr else 0.0)


def test_reciprocal_rank_fusion_hand_computed():
    fused = reciprocal_rank_fusion([[1, 2, 3], [3, 1, 4]], top_k=10)
    assert [doc for doc, _ in fused] == [1, 3, 2, 4]
    scores = dict(fused)
    assert scores[1] == pytest.approx(1 / 61 + 1 / 62)
    assert scores[3] == pytest.approx(1 / 63 + 1 / 61)
    assert scores[4] == pytest.approx(1 / 63)
    assert [doc for doc, _ in reciprocal_rank_fusion([[1, 2, 3], [3, 1, 4]], top_k=2)] == [1, 3]
    # a tie in score and best rank goes to the lower index, whatever the input order
    assert [doc for doc, _ in reciprocal_rank_fusion([[7, 2], [2, 7]], top_k=2)] == [2, 7]
    assert reciprocal_rank_fusion([[], []], top_k=3) == []


def test_top_positive_drops_zero_scores_and_breaks_ties_by_index():
    scores = np.array([0.0, 3.0, 1.0, 3.0, 0.0, 2.0], dtype=np.float32)
    assert top_positive(scores, 2) == [(1, 3.0), (3, 3.0)]
    assert [i for i, _ in top_positive(scores, 10)] == [1, 3, 5, 2]
    assert top_positive(np.zeros(4, dtype=np.float32), 3) == []
    rng = np.random.default_rng(0)
    many = rng.integers(0, 5, size=500).astype(np.float32)
    expected = sorted((i for i in range(500) if many[i] > 0), key=lambda i: (-many[i], i))[:37]
    assert [i for i, _ in top_positive(many, 37)] == expected


def _hit(doc_id, rank, text):
    return Hit(doc_id=doc_id, title=doc_id.title(), score=1.0 / rank, rank=rank, text=text)


def test_score_hits_signals():
    hits = [_hit("a", 1, "nothing here"), _hit("gold1", 2, "The answer is Paris."), _hit("b", 3, "x"),
            _hit("gold2", 4, "y")]
    item = ScoreItem("q", gold_doc_ids=("gold1", "gold2"), gold_answers=("paris",), seen_doc_ids=("gold1",))
    score = score_hits(item, hits, top_k=3)
    assert score.doc_ids == ["a", "gold1", "b"]
    assert score.hit and not score.all_gold
    assert score.recall == pytest.approx(0.5)
    assert score.mrr == pytest.approx(0.5) and score.first_gold_rank == 2
    assert score.ndcg == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)))
    assert score.is_new == (True, False, True)
    assert score.is_gold == (False, True, False)
    assert score.contains_answer == (False, True, False)
    assert all(h.text == "" for h in score.hits)
    assert score_hits(item, hits, 3, include_text=True).hits[1].text == "The answer is Paris."
    # the answer is also looked for in the title
    titled = score_hits(ScoreItem("q", gold_answers=("Gold2",)), hits, 4)
    assert titled.contains_answer == (False, False, False, True)
    assert titled.recall == 0.0 and not titled.hit and titled.first_gold_rank == 0


LIMITS = RetrievalLimits(max_top_k=100, max_batch_size=4, max_query_chars=50, max_ids_per_item=3)


@pytest.mark.parametrize(
    "queries, top_k, error, needles",
    [
        ([], 5, InvalidArgument, ["queries", "empty batch"]),
        (["ok", "  "], 5, InvalidArgument, ["queries[1]", "empty query"]),
        (["ok"], 0, InvalidArgument, ["top_k", "1..100"]),
        (["ok"], 101, InvalidArgument, ["top_k", "1..100", "101"]),
        (["q"] * 5, 5, ResourceExhausted, ["queries", "5", "max_batch_size=4"]),
        (["ok", "x" * 51], 5, ResourceExhausted, ["queries[1]", "51 characters", "max_query_chars=50"]),
    ],
)
def test_search_rules_name_the_field_and_the_limit(queries, top_k, error, needles):
    with pytest.raises(error) as caught:
        check_search(queries, top_k, LIMITS)
    for needle in needles:
        assert needle in str(caught.value)


def test_score_rules_and_modes():
    good = ScoreItem("q", gold_doc_ids=("a",))
    check_score([good], 3, LIMITS)
    with pytest.raises(ResourceExhausted, match=r"items\[1\]\.seen_doc_ids: 4 entries, limit max_ids_per_item=3"):
        check_score([good, ScoreItem("q", seen_doc_ids=("a", "b", "c", "d"))], 3, LIMITS)
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.query: empty query"):
        check_score([ScoreItem("")], 3, LIMITS)
    with pytest.raises(InvalidArgument, match="items: empty batch"):
        check_score([], 3, LIMITS)
    assert parse_mode(None, SearchMode.BM25) is SearchMode.BM25
    assert parse_mode("Dense", SearchMode.BM25) is SearchMode.DENSE
    assert parse_mode(SearchMode.HYBRID, SearchMode.BM25) is SearchMode.HYBRID
    with pytest.raises(InvalidArgument) as caught:
        parse_mode("sparse", SearchMode.BM25)
    assert caught.value.field == "mode" and "hybrid" in str(caught.value)


def test_config_loads_overrides_and_rejects_bad_values(tmp_path):
    path = tmp_path / "retrieval.yaml"
    path.write_text("index_dir: /data/index\ndefault_mode: bm25\nserving:\n  port: 6000\n")
    config = load_config(RetrievalServerConfig, path, ["max_top_k=20", "serving.port=0"])
    assert config.default_mode is SearchMode.BM25
    assert config.max_top_k == 20 and config.serving.port == 0
    assert config.limits() == RetrievalLimits(max_top_k=20)
    with pytest.raises(ConfigError, match="index_dir: required"):
        load_config(RetrievalServerConfig, None, [])
    with pytest.raises(ConfigError, match="max_top_k=0"):
        load_config(RetrievalServerConfig, None, ["index_dir=x", "max_top_k=0"])
    with pytest.raises(ConfigError, match="batch_max_queue_items=10 < max_batch_size=256"):
        load_config(RetrievalServerConfig, None, ["index_dir=x", "batch_max_queue_items=10"])
    with pytest.raises(ConfigError, match="default_mode"):
        load_config(RetrievalServerConfig, None, ["index_dir=x", "default_mode=sparse"])
    with pytest.raises(ConfigError, match="did you mean 'max_top_k'"):
        load_config(RetrievalServerConfig, None, ["index_dir=x", "max_topk=3"])
