"""What batch-invariant scoring costs, and which paths vary with the batch.

For each CPU backend, on the same inputs, in one run:

- **batched**: the way a service would compute a batch if scores were not
  batch-invariant (a padded batch through the encoder, several items per judge
  forward, one FAISS call or one torch product for every query);
- **invariant**: what the services run (one text / one item per forward,
  FAISS in chunks below its BLAS switch, torch in fixed 32-row blocks).

``--probe`` also counts, per path, how many rows of a mixed batch differ bitwise from
the same input computed alone, and the largest difference: the measurement the
choices in ``calibrl/embedding.py``, ``retrieval_server/dense.py`` and
``judge_server/backends/hf.py`` rest on.

    python benchmarks/bench_invariance.py --probe
    python benchmarks/bench_invariance.py --threads 1 --texts 64 --docs 20000

Figures are noisy on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = ("the fund expense ratio vanguard total stock market index who directed alien paris tower glucose "
         "insulin pancreas river africa mountain himalayas composer baroque antibiotic fleming").split()


def make_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))) for _ in range(count)]


def best_of(repeats: int, fn) -> float:
    """The fastest of ``repeats`` runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def differing(batched, alone) -> tuple[int, float]:
    """(rows of ``batched`` not bitwise equal to ``alone``, largest absolute difference)."""
    import numpy as np

    batched, alone = np.asarray(batched, dtype=np.float64), np.asarray(alone, dtype=np.float64)
    if batched.size == 0:
        return 0, 0.0
    rows = int((batched != alone).reshape(len(batched), -1).any(axis=1).sum())
    return rows, float(np.abs(batched - alone).max()) if rows else 0.0


def padded_batch_embeddings(embedder, texts: list[str], batch_size: int = 64):
    """The encoder as the services ran it before: padded batches, masked mean pooling."""
    import numpy as np
    import torch

    chunks = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = embedder._tokenizer(texts[start : start + batch_size], padding=True, truncation=True,
                                        max_length=embedder._layout.max_tokens, return_tensors="pt")
            hidden = embedder.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(chunks)


def equal_length_batches(embedder, length: int, threads: int) -> tuple[int, float]:
    """16 random token sequences of one length, two batches of 8 vs each alone, on
    ``threads`` torch threads: no padding anywhere, so any difference comes from the
    batch's shape."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(1000, 20000, size=(16, length)))
    ids[:, 0], ids[:, -1] = embedder._tokenizer.cls_token_id, embedder._tokenizer.sep_token_id

    def pooled(batch):
        with torch.inference_mode():
            hidden = embedder.model(input_ids=batch, attention_mask=torch.ones_like(batch)).last_hidden_state
            return torch.nn.functional.normalize(hidden.mean(1), dim=-1).numpy()

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = np.concatenate([pooled(ids[:8]), pooled(ids[8:])])
        return differing(batched, np.concatenate([pooled(ids[i : i + 1]) for i in range(16)]))
    finally:
        torch.set_num_threads(before)


def onnx_equal_length_groups(length: int, threads: int, rows: int = 16) -> tuple[int, float]:
    """ONNX Runtime: ``rows`` random token sequences of one length, in groups of 1-8 rows at
    random positions, vs each alone, on ``threads`` threads."""
    import numpy as np

    from calibrl.embedding import SentenceEmbedder

    runner = SentenceEmbedder(None, "cpu", backend="onnx", cache_size=0, threads=threads)._onnx
    rng = np.random.default_rng(length)
    ids = rng.integers(1000, 20000, size=(rows, length))
    ids[:, 0], ids[:, -1] = runner.tokenizer.cls_token_id, runner.tokenizer.sep_token_id
    sequences = ids.tolist()
    alone = np.stack(runner.encode_ids(sequences, mode="per-text"))
    order = rng.permutation(rows)
    grouped = np.zeros_like(alone)
    start = 0
    while start < rows:
        size = int(rng.integers(1, 9))
        chunk = order[start : start + size]
        for row, vector in zip(chunk, runner.encode_ids([sequences[i] for i in chunk], mode="equal-length groups")):
            grouped[row] = vector
        start += size
    return differing(grouped, alone)


def onnx_thread_counts(texts: list[str]) -> tuple[int, float]:
    """ONNX Runtime at 1 vs 2 threads, each text alone."""
    import numpy as np

    from calibrl.embedding import SentenceEmbedder

    one, two = (SentenceEmbedder(None, "cpu", backend="onnx", cache_size=0, threads=t) for t in (1, 2))
    return differing(np.stack([two.encode([t])[0] for t in texts]), np.stack([one.encode([t])[0] for t in texts]))


def bench_embedding(args, rows: list, probe: list) -> None:
    from calibrl.embedding import SentenceEmbedder

    embedder = SentenceEmbedder(None, device="cpu", backend="torch", cache_size=0)
    onnx = SentenceEmbedder(None, device="cpu", backend="onnx", cache_size=0)
    texts = make_texts(args.texts, seed=1)
    before = best_of(args.repeats, lambda: padded_batch_embeddings(embedder, texts))
    now = best_of(args.repeats, lambda: embedder.encode(texts))
    grouped = best_of(args.repeats, lambda: onnx.encode(texts))
    rows.append(("MiniLM embedding, torch (retrieval queries, judge intent similarity)", "texts/s",
                 len(texts) / before, len(texts) / now))
    rows.append(("MiniLM embedding, ONNX Runtime, the self-tested grouping (vs torch padded)", "texts/s",
                 len(texts) / before, len(texts) / grouped))
    if args.probe:
        alone = [embedder.encode([t])[0] for t in texts]
        probe.append(("MiniLM, padded batch of %d" % len(texts), *differing(padded_batch_embeddings(embedder, texts),
                                                                           alone), len(texts)))
        for length in (10, 40):
            for threads in (1, 2):
                probe.append((f"MiniLM, batches of 8 sequences of {length} tokens (no padding), {threads} thread(s)",
                              *equal_length_batches(embedder, length, threads), 16))
        probe.append(("MiniLM, invariant (each text alone)", *differing(embedder.encode(texts), alone), len(texts)))
        for length in (10, 40):
            for threads in (1, 2):
                probe.append((f"MiniLM on ONNX Runtime, groups of 1-8 sequences of {length} tokens at random "
                              f"positions, {threads} thread(s)", *onnx_equal_length_groups(length, threads), 16))
        probe.append(("MiniLM on ONNX Runtime, each text alone, 1 vs 2 threads", *onnx_thread_counts(texts),
                      len(texts)))
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            other = embedder.encode(texts)
        finally:
            torch.set_num_threads(threads)
        probe.append((f"MiniLM, each text alone, {threads} vs {1 if threads > 1 else 2} torch threads",
                      *differing(other, alone), len(texts)))


def bench_dense(args, rows: list, probe: list) -> None:
    import faiss
    import numpy as np
    import torch

    from calibrl.retrieval_server.dense import FaissSearcher, TorchSearcher, build_faiss_index

    rng = np.random.default_rng(0)
    docs = rng.standard_normal((args.docs, 384)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = rng.standard_normal((args.queries, 384)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    for kind in ("flat", "hnsw", "ivf"):
        searcher = FaissSearcher(build_faiss_index(docs, kind), ef_search=128, nprobe=16)
        before = best_of(args.repeats, lambda: searcher.index.search(queries, 10))
        now = best_of(args.repeats, lambda: searcher.search(queries, 10))
        rows.append((f"dense search, FAISS {kind} ({args.docs} docs)", "queries/s",
                     len(queries) / before, len(queries) / now))
        if args.probe:
            alone = np.concatenate([searcher.search(queries[i : i + 1], 10)[0] for i in range(len(queries))])
            probe.append((f"FAISS {kind}, one call, threshold as installed "
                          f"({faiss.cvar.distance_compute_blas_threshold})",
                          *differing(searcher.index.search(queries, 10)[0], alone), len(queries)))
            installed = faiss.cvar.distance_compute_blas_threshold
            faiss.cvar.distance_compute_blas_threshold = 20
            try:  # alone again: at threshold 20 even one query may take the BLAS path
                alone = np.concatenate([searcher.search(queries[i : i + 1], 10)[0] for i in range(len(queries))])
                probe.append((f"FAISS {kind}, one call, threshold 20 (older releases' default)",
                              *differing(searcher.index.search(queries, 10)[0], alone), len(queries)))
                probe.append((f"FAISS {kind}, invariant, threshold 20",
                              *differing(searcher.search(queries, 10)[0], alone), len(queries)))
            finally:
                faiss.cvar.distance_compute_blas_threshold = installed
    matrix = torch.from_numpy(docs)
    torch_searcher = TorchSearcher(docs)

    def one_product():
        with torch.inference_mode():
            return torch.topk(torch.from_numpy(queries) @ matrix.T, 10, dim=1).values.numpy()

    before = best_of(args.repeats, one_product)
    now = best_of(args.repeats, lambda: torch_searcher.search(queries, 10))
    rows.append((f"dense search, torch exact ({args.docs} docs)", "queries/s", len(queries) / before,
                 len(queries) / now))
    if args.probe:
        alone = np.concatenate([torch_searcher.search(queries[i : i + 1], 10)[0] for i in range(len(queries))])
        with torch.inference_mode():
            single = np.concatenate([torch.topk(torch.from_numpy(queries[i : i + 1]) @ matrix.T, 10).values.numpy()
                                     for i in range(len(queries))])
        probe.append(("torch, one product of every query vs each alone", *differing(one_product(), single),
                      len(queries)))
        probe.append(("torch, invariant (32-row blocks)", *differing(torch_searcher.search(queries, 10)[0], alone),
                      len(queries)))


def bench_transformers_judge(args, rows: list, probe: list) -> None:
    from calibrl.judge_server.backends.encoding import EncodedBatch
    from calibrl.judge_server.backends.hf import TransformersJudge
    from calibrl.judge_server.rubric import Criterion
    from calibrl.testing import build_tiny_causal_lm
    from calibrl.api.judge import JudgeItem

    criteria = [
        Criterion("intent", "llm", 1.0, question="Does the output keep the intent of the user's query?"),
        Criterion("quality", "llm", 1.0, question="How good is the rewrite?", scale="likert_1_5"),
    ]
    texts = make_texts(2 * args.items, seed=2)
    items = [JudgeItem.make(texts[2 * i], texts[2 * i + 1]) for i in range(args.items)]
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_causal_lm(folder, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seed=0)
        judge = TransformersJudge(folder, device="cpu", dtype="float32")
    encoded = judge.encoder.encode(items, criteria, "")
    step = 16

    def batched():  # as before: 16 items per forward, prefixes left-padded together
        out = []
        for start in range(0, len(items), step):
            chunk = EncodedBatch(encoded.prefix_ids[start : start + step], encoded.suffix_ids)
            out.extend(judge._scores_from_rows(judge.next_token_logprobs(chunk), criteria, len(chunk.prefix_ids)))
        return out

    before = best_of(args.repeats, batched)
    now = best_of(args.repeats, lambda: judge.score(items, criteria, ""))
    rows.append((f"transformers judge (tiny Llama, hidden {args.hidden}, {args.layers} layers, 2 criteria)",
                 "items/s", len(items) / before, len(items) / now))
    if args.probe:
        alone = [judge.score([item], criteria, "")[0] for item in items]
        probe.append((f"transformers judge, {step} items per padded forward", *differing(batched(), alone),
                      len(items)))
        probe.append(("transformers judge, invariant (one item per forward)",
                      *differing(judge.score(items, criteria, ""), alone), len(items)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", action="store_true", help="also count the rows that differ from alone")
    parser.add_argument("--texts", type=int, default=64, help="texts to embed")
    parser.add_argument("--queries", type=int, default=64, help="dense-search queries")
    parser.add_argument("--docs", type=int, default=20000, help="random unit vectors in the dense index")
    parser.add_argument("--items", type=int, default=32, help="items for the transformers judge")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny judge model")
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny judge model")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (the fastest is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the tables as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rows: list = []
    probe: list = []
    bench_embedding(args, rows, probe)
    bench_dense(args, rows, probe)
    bench_transformers_judge(args, rows, probe)
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(default)')}\n")
    speed_header = ["backend", "unit", "batched", "invariant", "invariant / batched"]
    speed_rows = [[name, unit, f"{batched:,.0f}", f"{invariant:,.0f}", f"{invariant / batched:.2f}"]
                  for name, unit, batched, invariant in rows]
    probe_header = ["path", "rows differing from alone", "of", "max abs difference"]
    probe_rows = [[name, str(count), str(total), f"{largest:.1e}"] for name, count, largest, total in probe]
    print("| " + " | ".join(speed_header) + " |\n|---|---|---:|---:|---:|")
    print("\n".join("| " + " | ".join(row) + " |" for row in speed_rows))
    if probe:
        print("\n| " + " | ".join(probe_header) + " |\n|---|---:|---:|---:|")
        print("\n".join("| " + " | ".join(row) + " |" for row in probe_rows))
    if args.record:
        from bench_record import table, write_record

        tables = [table(f"Throughput, the fastest of {args.repeats} run(s), {args.threads} torch thread(s): each "
                        "backend batched as one call and invariant (each input alone, FAISS in chunks, torch in "
                        "32-row blocks)", speed_header, speed_rows)]
        if probe:
            tables.append(table("Rows of a batch that are not bitwise equal to the same input computed alone",
                                probe_header, probe_rows))
        write_record(args.record, tables, libraries=("torch", "onnxruntime", "faiss-cpu", "transformers"))


if __name__ == "__main__":
    main()
