"""A score is a pure function of its inputs (issue 10): (index, query, parameters) for
retrieval, (rubric hash, judge model id, item) for the judge. Bitwise the same alone,
in any batch composition (seeded random ones), under concurrent callers of one real
gRPC server, after that server restarts, and on another replica (a second server
process on loopback). Floats are compared by their bits (``float.hex`` / raw bytes),
never with a tolerance.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import pytest

from tests.conftest import torch_threads_one

from calibrl.embedding import HashedNgramEmbedder, SentenceEmbedder
from calibrl.v1 import judge_pb2, judge_pb2_grpc
from calibrl.v1 import retrieval_pb2 as rpb
from calibrl.v1 import retrieval_pb2_grpc as rpb_grpc
from calibrl.api import judge_wire
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric_dir
from calibrl.judge_server.server import start as start_judge
from calibrl.testing import build_tiny_causal_lm
from calibrl.api.judge import JudgeItem
from calibrl.api import retrieval_wire
from calibrl.retrieval_server.dense import FaissSearcher, TorchSearcher, build_faiss_index
from calibrl.testing import build_test_index, start_test_server
from calibrl.api.retrieval import ScoreItem, SearchMode

torch = pytest.importorskip("torch")

# Texts of very different token lengths, so that any padding inside a batch would show.
TEXTS = [
    "Mozart", "Who composed The Magic Flute?", "highest mountain in the Himalayas",
    "Which antibiotic did Alexander Fleming discover in 1928, and what did it change in medicine?",
    "iron tower in Paris", "river in Africa flowing north into the Mediterranean Sea",
    "What is the expense ratio of the Vanguard Total Stock Market Index Fund (VTSAX)?",
    "green pigment " * 40, "programming language by Guido van Rossum", "pancreas hormone",
]


def compositions(pool: list, seed: int, count: int = 6) -> list[list]:
    """Seeded random batches over ``pool``: random sizes, order and repeats."""
    rng = random.Random(seed)
    batches = [[pool[0]], list(pool), list(reversed(pool))]
    for _ in range(count):
        batches.append([rng.choice(pool) for _ in range(rng.randint(2, 2 * len(pool)))])
    return batches


def bits(value: float) -> str:
    return float(value).hex()


one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


# ---------------------------------------------------------------------------------- library level

ENCODER_BACKENDS = ["torch", pytest.param("onnx", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("onnxruntime") is None, reason="onnxruntime is not installed"))]


@pytest.mark.parametrize("backend", ENCODER_BACKENDS)
def test_sentence_embedding_is_the_same_alone_and_in_any_batch(backend):
    embedder = SentenceEmbedder(None, device="cpu", backend=backend, cache_size=0)  # every vector computed
    alone = {text: embedder.encode([text])[0].tobytes() for text in TEXTS}
    for seed, batch in enumerate(compositions(TEXTS, seed=1)):
        vectors = embedder.encode(batch, batch_size=[1, 3, 64][seed % 3])
        assert [v.tobytes() for v in vectors] == [alone[t] for t in batch], f"composition {seed}"


def test_hashed_ngrams_are_the_same_alone_and_in_any_batch():
    embedder = HashedNgramEmbedder()
    alone = {text: embedder.encode([text])[0].tobytes() for text in TEXTS}
    for batch in compositions(TEXTS, seed=2):
        assert [v.tobytes() for v in embedder.encode(batch)] == [alone[t] for t in batch]
    vector = embedder.encode(["VTSAX expense ratio"])[0]
    assert float(np.dot(vector.astype(np.float64), vector.astype(np.float64))) == pytest.approx(1.0, abs=1e-6)


@pytest.fixture(params=["default", "20"])
def faiss_blas_threshold(request):
    """FAISS switches to one BLAS product at ``distance_compute_blas_threshold`` (20 in
    older releases, counted in queries; 128000 in faiss 1.15, counted in queries x
    dimension): run once as installed and once pinned low, which covers the switch."""
    faiss = pytest.importorskip("faiss")
    before = faiss.cvar.distance_compute_blas_threshold
    if request.param != "default":
        faiss.cvar.distance_compute_blas_threshold = int(request.param)
    yield
    faiss.cvar.distance_compute_blas_threshold = before


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf", "torch"])
def test_dense_search_is_the_same_alone_and_in_any_batch(kind, faiss_blas_threshold):
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((2000, 64)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = rng.standard_normal((70, 64)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    searcher = (TorchSearcher(docs) if kind == "torch"
                else FaissSearcher(build_faiss_index(docs, kind, ivf_nlist=32), ef_search=64, nprobe=8))
    alone = [searcher.search(queries[i : i + 1], 10) for i in range(len(queries))]
    for seed, batch in enumerate(compositions(list(range(len(queries))), seed=3, count=4)):
        scores, indices = searcher.search(queries[batch], 10)
        for row, i in enumerate(batch):
            assert scores[row].tobytes() == alone[i][0][0].tobytes(), f"{kind}, composition {seed}, query {i}"
            assert indices[row].tolist() == alone[i][1][0].tolist()


RUBRIC_PROGRAMMATIC = """\
id: rewriter
version: "1"
criteria:
  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 1.0}
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.5}
  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.5}
"""
RUBRIC_LLM = RUBRIC_PROGRAMMATIC + """\
  - {name: keeps_intent, kind: llm, weight: 1.0, question: "Does the output keep the intent of the user's query?"}
  - {name: quality, kind: llm, weight: 1.0, question: "How good is the rewrite?", scale: likert_1_5}
"""
JUDGE_VARIANTS = {  # name -> (rubric, embedder, needs an LLM)
    "programmatic-minilm": (RUBRIC_PROGRAMMATIC, "minilm", False),
    "programmatic-minilm-onnx": (RUBRIC_PROGRAMMATIC, "minilm-onnx", False),
    "programmatic-hashed-ngrams": (RUBRIC_PROGRAMMATIC, "hashed-ngrams", False),
    "transformers-tiny": (RUBRIC_LLM, "hashed-ngrams", True),
}
QUERY_OUTPUTS = [(TEXTS[i], TEXTS[(i * 3 + 1) % len(TEXTS)]) for i in range(len(TEXTS))] + [
    ("vtsax expense ratio", "What is the expense ratio of the Vanguard Total Stock Market Index Fund (VTSAX)?"),
    ("q", "short"),
]
JUDGE_ITEMS = [JudgeItem.make(q, o, retrieved_texts=(TEXTS[n % len(TEXTS)],)) for n, (q, o) in enumerate(QUERY_OUTPUTS)]


@pytest.fixture(scope="module")
def tiny_judge_model(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("judge-model"), arch="llama", seed=3)


def judge_setup(variant: str, root, tiny_judge_model) -> tuple[str, JudgeConfig]:
    """(rubric folder, judge config) of a variant; no cache, so every score is computed."""
    rubric, embedder, needs_llm = JUDGE_VARIANTS[variant]
    folder = root / f"rubrics-{variant}"
    folder.mkdir(exist_ok=True)
    (folder / "rewriter.yaml").write_text(rubric)
    backend = f"transformers:{tiny_judge_model}" if needs_llm else "programmatic"
    embedder, onnx_suffix, _ = embedder.partition("-onnx")  # "minilm-onnx": MiniLM on ONNX Runtime
    return str(folder), JudgeConfig(backend=backend, embedder=embedder, device="cpu", allow_unvalidated=True,
                                    cache_size=0, embedder_cache_size=0,
                                    embedder_backend="onnx" if onnx_suffix else "torch")


def score_bits(criteria, total) -> tuple:
    return tuple(bits(c.score) for c in criteria), bits(total)


@pytest.mark.parametrize("variant", list(JUDGE_VARIANTS))
def test_judge_scores_are_the_same_alone_and_in_any_batch(variant, tmp_path, tiny_judge_model):
    folder, config = judge_setup(variant, tmp_path, tiny_judge_model)
    judge = Judge.from_config(config, folder)
    alone = {item: score_bits(*_criteria_total(judge.score("rewriter", [item])[0])) for item in JUDGE_ITEMS}
    for seed, batch in enumerate(compositions(JUDGE_ITEMS, seed=4, count=3)):
        computed = judge.compute(judge.resolve("rewriter"), batch)  # duplicates included: no dedup here
        assert [score_bits(*_criteria_total(s)) for s in computed] == [alone[i] for i in batch], f"composition {seed}"


def _criteria_total(score):
    return score.criteria, score.total


def test_dense_ties_keep_one_order_whatever_k_or_batch(tmp_path):
    """Duplicate passages score the same: their order must not depend on the k the server
    searched with (it batches calls at their largest k) nor on the queries beside them."""
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.testing import TINY_CORPUS

    mozart = next(p for p in TINY_CORPUS if p["_id"] == "mozart")
    records = [{**mozart, "_id": "mozart-copy"}, *TINY_CORPUS]  # the copy comes first in index order
    retriever = Retriever.load(build_test_index(tmp_path / "index", records), device="cpu")
    query = "Who composed The Magic Flute?"
    rankings = {k: retriever.ranked([query], k, SearchMode.DENSE)[0] for k in (1, 2, 5)}
    rankings["batched"] = retriever.ranked([*TEXTS, query], 5, SearchMode.DENSE)[-1]
    assert [h.doc_id for h in rankings[2]] == ["mozart-copy", "mozart"]
    assert bits(rankings[2][0].score) == bits(rankings[2][1].score)
    for name, hits in rankings.items():
        assert [(h.doc_id, bits(h.score)) for h in hits] == [(h.doc_id, bits(h.score)) for h in rankings[5]][
            : len(hits)], name


# ------------------------------------------------------------------- servers: callers, restart, replica

class Replica:
    """A server in its own process (``python -m calibrl serve ...``), found by the port it announces."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.process = subprocess.Popen([sys.executable, "-m", "calibrl", "serve", *args, "--port", "0"],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.port = None
        deadline = time.monotonic() + 180
        while self.port is None and time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            match = re.search(r"listening on [\d.]+:(\d+)", line)
            self.port = int(match.group(1)) if match else None
        if self.port is None:
            self.stop()
            raise AssertionError(f"replica {args} did not announce its port")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module", params=ENCODER_BACKENDS)
def tiny_index(request, tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("invariance") / "index", encoder_backend=request.param)


SCORE_ITEMS = [ScoreItem(text, gold_doc_ids=("mozart", "penicillin", "everest")) for text in TEXTS]


def retrieval_bits(score) -> tuple:
    """Every number of a RetrievalScore message, as bits, with the hit ids."""
    return (tuple((h.doc_id, bits(h.score), h.rank) for h in score.hits), score.hit, score.all_gold,
            bits(score.recall), bits(score.mrr), bits(score.ndcg), score.first_gold_rank)


async def score_retrieval(stub, items, mode) -> list[tuple]:
    reply = await stub.ScoreRetrieval(rpb.ScoreRetrievalRequest(
        items=[retrieval_wire.score_item_to_proto(i) for i in items], top_k=5, mode=mode), timeout=120)
    return [retrieval_bits(s) for s in reply.scores]


async def retrieval_reference(port: int, mode) -> dict[str, tuple]:
    """Each item alone, one call at a time, on the given server."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rpb_grpc.RetrievalServiceStub(channel)
        return {item.query: (await score_retrieval(stub, [item], mode))[0] for item in SCORE_ITEMS}


async def test_retrieval_scores_agree_across_callers_restart_and_replica(tiny_index):
    replica = Replica("retrieval", "--index", str(tiny_index), "device=cpu", "torch_threads=1")
    try:
        modes = (rpb.SEARCH_MODE_DENSE, rpb.SEARCH_MODE_HYBRID)
        reference = {mode: await retrieval_reference(replica.port, mode) for mode in modes}
    finally:
        replica.stop()
    assert reference[rpb.SEARCH_MODE_DENSE]["Mozart"][0][0][0] == "mozart"  # a real ranking, not an empty one

    for restart in range(2):  # the same in-process server, then a fresh one (restarted: index loaded again)
        # a unit large enough for every caller's items: the batching window then lets them join one batch
        running = await start_test_server(tiny_index, "batch_max_wait_ms=40", "serving.max_unit_cost_s=100")
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                stub = rpb_grpc.RetrievalServiceStub(channel)
                calls, expected = [], []
                for seed, batch in enumerate(compositions(SCORE_ITEMS, seed=10 + restart, count=5)):
                    mode = modes[seed % 2]
                    calls.append(score_retrieval(stub, batch, mode))
                    expected.append([reference[mode][item.query] for item in batch])
                replies = await asyncio.gather(*calls)  # concurrent callers: the server batches them together
                assert running.batcher.stats.batches < len(calls)
                for seed, (reply, want) in enumerate(zip(replies, expected)):
                    assert reply == want, f"restart {restart}, composition {seed}"
        finally:
            await running.stop(grace=1.0)


async def judge_reference(port: int) -> dict[JudgeItem, tuple]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = judge_pb2_grpc.JudgeServiceStub(channel)
        reference = {}
        for item in JUDGE_ITEMS:
            request = judge_pb2.ScoreRequest(rubric_id="rewriter", items=[judge_wire.item_to_proto(item)])
            reply = await stub.Score(request, timeout=120)
            reference[item] = score_bits(reply.scores[0].criteria, reply.scores[0].total)
        return reference


@pytest.mark.parametrize("variant", list(JUDGE_VARIANTS))
async def test_judge_scores_agree_across_callers_restart_and_replica(variant, tmp_path, tiny_judge_model):
    folder, judge_config = judge_setup(variant, tmp_path, tiny_judge_model)
    replica = Replica("judge", "--rubrics", folder, "--backend", judge_config.backend, "--allow-unvalidated",
                      f"judge.embedder={judge_config.embedder}", "judge.device=cpu", "judge.cache_size=0",
                      f"judge.embedder_backend={judge_config.embedder_backend}", "judge.embedder_cache_size=0")
    try:
        reference = await judge_reference(replica.port)
    finally:
        replica.stop()

    for restart in range(2):
        config = JudgeServerConfig(rubrics=folder, judge=judge_config, max_wait_ms=40)
        config.serving.port, config.serving.host = 0, "127.0.0.1"
        # this test is about scores, not budgets: no per-request budget, and units that hold every
        # caller's items, so the callers' items share batches
        config.serving.max_request_cost_s, config.serving.max_unit_cost_s = 0.0, 100.0
        running = await start_judge(config, Judge.from_config(judge_config, folder))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                stub = judge_pb2_grpc.JudgeServiceStub(channel)
                batches = compositions(JUDGE_ITEMS, seed=20 + restart, count=4)
                replies = await asyncio.gather(*[
                    stub.Score(judge_pb2.ScoreRequest(rubric_id="rewriter",
                                                      items=[judge_wire.item_to_proto(i) for i in batch]), timeout=120)
                    for batch in batches])
                assert running.servicer.batcher.stats.batches < len(batches)
                for seed, (batch, reply) in enumerate(zip(batches, replies)):
                    got = [score_bits(s.criteria, s.total) for s in reply.scores]
                    assert got == [reference[i] for i in batch], f"{variant}, restart {restart}, composition {seed}"
        finally:
            await running.stop(0)


def test_rubric_folder_of_the_variants_loads():
    """The rubrics above are valid (a typo would make the server tests fail for the wrong reason)."""
    for variant, (rubric, _, needs_llm) in JUDGE_VARIANTS.items():
        with tempfile.TemporaryDirectory() as root:
            (pathlib.Path(root) / "rewriter.yaml").write_text(rubric)
            [loaded] = load_rubric_dir(root)
            assert bool(loaded.llm_criteria) == needs_llm, variant


def test_both_services_share_one_embedder_module_and_model():
    """One MiniLM wrapper (calibrl.embedding) serves the index and the judge: the same loaded model."""
    from calibrl.embedding import load_embedder

    judge_embedder = load_embedder("minilm", "cpu")
    assert isinstance(judge_embedder, SentenceEmbedder)
    assert judge_embedder.model is SentenceEmbedder(None, device="cpu").model
    assert judge_embedder.encode(["iron tower in Paris"]).tobytes() == SentenceEmbedder(None, "cpu").encode(
        ["iron tower in Paris"]).tobytes()


def test_vllm_judge_asks_for_batch_invariant_kernels_before_vllm_is_imported(monkeypatch):
    """vLLM reads VLLM_BATCH_INVARIANT once per process; vLLM cannot be installed here, so
    this checks our side: the variable is set before the import, and a process that
    imported vLLM without it is refused rather than served batch-dependent scores."""
    from calibrl.errors import ConfigError
    from calibrl.judge_server.backends import vllm_backend

    monkeypatch.delenv(vllm_backend.BATCH_INVARIANT_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    vllm_backend.enable_batch_invariance()
    assert os.environ[vllm_backend.BATCH_INVARIANT_ENV] == "1"

    monkeypatch.delenv(vllm_backend.BATCH_INVARIANT_ENV)
    monkeypatch.setitem(sys.modules, "vllm", object())
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT=1"):
        vllm_backend.enable_batch_invariance()
    monkeypatch.setenv(vllm_backend.BATCH_INVARIANT_ENV, "1")
    vllm_backend.enable_batch_invariance()  # already set by the operator: fine
