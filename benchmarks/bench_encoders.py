"""Reward services at library speed: the MiniLM encoders against the libraries' own batched paths.

On the demo's corpus (generated, no download) and 100 of its held-out queries, in one
run, repeats interleaved (the fastest of each kept):

- ``dense``: in-process dense search (encode + FAISS flat, top 10), queries/s:
  sentence-transformers ``encode`` (batch 32, padded) + one FAISS call (the anchor),
  calibrl on torch (one text per forward pass), on ONNX Runtime (padded buckets when its self-test passes),
  and on ONNX with every query already in the embedding cache; at each ``--threads``.
- ``bm25``: bm25s + PyStemmer ``retrieve`` on the same saved index (anchor) vs
  ``Retriever.search(mode=bm25)``.
- ``rankings``: the demo index embedded by torch and by ONNX, every held-out query
  the demo can send: top-10 rankings that differ, per mode.
- ``judge``: one Score of 32 items (programmatic rubric: intent similarity, entity
  coverage, specificity) on a served judge (``calibrl serve judge`` in a child process,
  its settings as shipped, result cache off), new items every call, per encoder backend.

    python benchmarks/bench_encoders.py                       # all parts, 1 and 2 threads
    python benchmarks/bench_encoders.py --parts dense --threads 1,2 --repeats 5

The demo index is built once per encoder into --workdir and reused. Figures are noisy
on a shared machine: compare the ratios measured within one run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `calibrl serve` sets: compare like for like
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def best_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Fastest wall time of each function over ``repeats`` interleaved rounds."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def demo_index(workdir: pathlib.Path, backend: str) -> tuple[pathlib.Path, list[str]]:
    """(index folder of the demo corpus embedded by ``backend``, 100 held-out queries)."""
    from calibrl.demo.domain import generate_domain
    from calibrl.retrieval_server.corpus import Passage, records_sha256
    from calibrl.retrieval_server.index import build_index

    domain = generate_domain(0)
    queries = list(dict.fromkeys(t.query for t in domain.tasks("heldout")))[:100]
    out = workdir / f"demo-{backend}"
    if not (out / "manifest.json").is_file():
        passages = [Passage(p.doc_id, p.title, p.text) for p in domain.passages]
        print(f"building the demo index with {backend} into {out}...", file=sys.stderr)
        build_index(passages, out, corpus_sha256=records_sha256(passages), corpus_format="records", device="cpu",
                    encoder_backend=backend, overwrite=True, show_progress=False)
    return out, queries


def bench_dense(args, index: pathlib.Path, queries: list[str]) -> list[str]:
    import faiss
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from calibrl.embedding import SentenceEmbedder
    from calibrl.retrieval_server.retriever import Retriever

    retriever = Retriever.load(index, device="cpu", embedding_cache_size=0)
    anchor_model = SentenceTransformer(str(retriever.embedder.path), device="cpu", local_files_only=True)
    anchor_index = faiss.IndexFlatIP(retriever.manifest.dimension)
    anchor_index.add(np.load(index / "embeddings.npy"))
    lines = [f"Dense search, {len(queries)} held-out queries over {retriever.doc_count} passages, top 10, "
             f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} (queries/s; ratio to the anchor):", "",
             "| threads | sentence-transformers + FAISS, batched | calibrl torch, per text | calibrl ONNX, "
             "grouped as its self-test allows | calibrl ONNX, all cached |", "| --- | --- | --- | --- | --- |"]
    for threads in args.threads:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(threads)
        # one cache per encoder in a process: off for the cold rounds, then filled for the cached ones
        encoders = {name: SentenceEmbedder(None, "cpu", backend=name, cache_size=0, threads=threads)
                    for name in ("torch", "onnx")}

        def calibrl(embedder):
            def run():
                retriever.embedder = embedder
                retriever.search(queries, top_k=10, mode="dense")
            return run

        fns = {
            "anchor": lambda: anchor_index.search(anchor_model.encode(queries, batch_size=32, convert_to_numpy=True,
                                                                      normalize_embeddings=True), 10),
            "torch": calibrl(encoders["torch"]), "onnx": calibrl(encoders["onnx"]),
        }
        best = best_interleaved(fns, args.repeats)
        encoders["onnx"].cache.resize(len(queries))
        encoders["onnx"].encode(queries)
        stats = encoders["onnx"].cache.stats()
        second = best_interleaved({"anchor": fns["anchor"], "cached": calibrl(encoders["onnx"])}, args.repeats)
        best["anchor"], best["cached"] = min(best["anchor"], second["anchor"]), second["cached"]
        assert encoders["onnx"].cache.stats().misses == stats.misses, "the cached rounds must all hit"
        encoders["onnx"].cache.resize(0)
        rate = {name: len(queries) / seconds for name, seconds in best.items()}
        print(f"dense, {threads} thread(s): " + ", ".join(f"{k} {v:.1f} q/s" for k, v in rate.items())
              + f"; ONNX grouping: {encoders['onnx'].self_test.mode}", file=sys.stderr)
        lines.append(f"| {threads} | {rate['anchor']:.1f} | " + " | ".join(
            f"{rate[name]:.1f} ({rate[name] / rate['anchor']:.2f}x)" for name in ("torch", "onnx", "cached")) + " |")
    retriever.embedder = encoders["onnx"]
    return lines


def bench_bm25(args, index: pathlib.Path, queries: list[str]) -> list[str]:
    import bm25s
    import Stemmer
    import torch

    from calibrl.retrieval_server.retriever import Retriever

    torch.set_num_threads(args.threads[0])
    retriever = Retriever.load(index, device="cpu")
    anchor = bm25s.BM25.load(str(index / "bm25"), show_progress=False)
    stemmer = Stemmer.Stemmer("english")

    def anchor_run():
        tokens = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, show_progress=False)
        anchor.retrieve(tokens, k=10, show_progress=False)  # n_threads=0: no thread pool

    best = best_interleaved({"anchor": anchor_run,
                             "calibrl": lambda: retriever.search(queries, top_k=10, mode="bm25")}, args.repeats * 3)
    rate = {name: len(queries) / seconds for name, seconds in best.items()}
    print(f"bm25: " + ", ".join(f"{k} {v:.0f} q/s" for k, v in rate.items()), file=sys.stderr)
    return [f"BM25, the same {len(queries)} queries and index, top 10 (queries/s):", "",
            "| bm25s + PyStemmer retrieve | calibrl Retriever.search(mode=bm25) | ratio |", "| --- | --- | --- |",
            f"| {rate['anchor']:.0f} | {rate['calibrl']:.0f} | {rate['calibrl'] / rate['anchor']:.2f}x |"]


def compare_rankings(args) -> list[str]:
    """The demo index built by each encoder, every held-out query the demo can send: how
    many top-10 rankings differ between the two, per mode."""
    import numpy as np

    from calibrl.demo.domain import generate_domain
    from calibrl.retrieval_server.retriever import Retriever

    indexes = {backend: demo_index(args.workdir, backend)[0] for backend in ("torch", "onnx")}
    retrievers = {b: Retriever.load(path, device="cpu", embedding_cache_size=0) for b, path in indexes.items()}
    moved = np.abs(np.load(indexes["torch"] / "embeddings.npy") - np.load(indexes["onnx"] / "embeddings.npy")).max()
    domain = generate_domain(0)
    queries = [t.query for t in domain.tasks("heldout")]
    for task in domain.multistep("heldout"):
        queries += [task.question, *(step.query for step in task.steps), task.shortcut_query]
    queries = [q for q in dict.fromkeys(queries) if q]
    lines = [f"Demo index embedded by torch vs ONNX ({retrievers['onnx'].doc_count} passages, largest passage-vector "
             f"difference {moved:.1e}), {len(queries)} held-out queries, top 10:", "",
             "| mode | rankings that differ | of which only reordered |", "| --- | --- | --- |"]
    for mode in ("dense", "hybrid", "bm25"):
        differ = reordered = 0
        for start in range(0, len(queries), 64):
            chunk = queries[start : start + 64]
            pairs = zip(*(retrievers[b].search(chunk, top_k=10, mode=mode) for b in ("torch", "onnx")))
            for torch_hits, onnx_hits in pairs:
                ids = ([h.doc_id for h in torch_hits], [h.doc_id for h in onnx_hits])
                differ += ids[0] != ids[1]
                reordered += ids[0] != ids[1] and sorted(ids[0]) == sorted(ids[1])
        print(f"rankings, {mode}: {differ} of {len(queries)} differ", file=sys.stderr)
        lines.append(f"| {mode} | {differ} of {len(queries)} | {reordered} |")
    return lines


RUBRIC = """\
id: rewriter
version: "1"
criteria:
  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 1.0}
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.5}
  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.5}
"""


def bench_judge(args, workdir: pathlib.Path, queries: list[str]) -> list[str]:
    import asyncio

    folder = workdir / "rubrics"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewriter.yaml").write_text(RUBRIC)
    lines = ["One programmatic Score of 32 items on `calibrl serve judge` (settings as shipped, result cache off, "
             "new items every call) through the trainer's judge client, which splits what the cost budget refuses "
             "into the chunks the server names; seconds:", "", "| encoder | first call | fastest of the next |",
             "| --- | --- | --- |"]
    for backend in ("torch", "onnx"):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
        process = subprocess.Popen(
            [sys.executable, "-m", "calibrl", "serve", "judge", "--rubrics", str(folder), "--backend", "programmatic",
             "--allow-unvalidated", "--port", "0", "judge.cache_size=0", f"judge.embedder_backend={backend}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
        try:
            port = None
            for line in process.stdout:
                match = re.search(r"listening on [\d.]+:(\d+)", line)
                if match:
                    port = int(match.group(1))
                    break
            if port is None:
                raise RuntimeError(f"judge server ({backend}) exited with {process.wait()} before serving")
            times = asyncio.run(_score_calls(port, queries, args.repeats + 1))
        finally:
            process.terminate()
            process.wait(timeout=60)
        print(f"judge {backend}: " + ", ".join(f"{t:.3f}" for t in times), file=sys.stderr)
        lines.append(f"| {backend} | {times[0]:.3f} | {min(times[1:]):.3f} |")
    return lines


async def _score_calls(port: int, queries: list[str], calls: int) -> list[float]:
    """``calls`` Scores of 32 new items through the trainer's judge client, which splits a request
    the server's cost budget refuses into the chunks it names (``calibrl-max-items``) and sends
    them concurrently; the seconds of each."""
    from calibrl.api.judge import JudgeItem
    from calibrl.trainer.grpc_clients import GrpcJudgeClient

    times = []
    client = GrpcJudgeClient(f"127.0.0.1:{port}", timeout_s=600)
    try:
        for call in range(calls):
            items = [JudgeItem.make(queries[(call * 32 + i) % len(queries)],
                                    f"{queries[(call * 32 + i + 7) % len(queries)]} (call {call}, item {i})")
                     for i in range(32)]
            start = time.perf_counter()
            await client.score("rewriter", items)
            times.append(time.perf_counter() - start)
    finally:
        await client.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="dense,bm25,judge",
                        help="dense, bm25, judge, rankings (comma-separated; rankings builds a torch index: minutes)")
    parser.add_argument("--threads", default="1,2", help="CPU thread counts of the dense part")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (the fastest kept)")
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/calibrl-bench"))
    parser.add_argument("--record", metavar="PATH",
                        help="also write the tables as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME)")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    parts = args.parts.split(",")
    index, queries = demo_index(args.workdir, "onnx")
    lines: list[str] = []
    if "dense" in parts:
        lines += bench_dense(args, index, queries) + [""]
    if "bm25" in parts:
        lines += bench_bm25(args, index, queries) + [""]
    if "judge" in parts:
        lines += bench_judge(args, args.workdir, queries) + [""]
    if "rankings" in parts:
        lines += compare_rankings(args) + [""]
    print("\n".join(lines))
    if args.record:
        from bench_record import tables_from_markdown, write_record

        write_record(args.record, tables_from_markdown(lines),
                     libraries=("torch", "onnxruntime", "faiss-cpu", "bm25s", "sentence-transformers"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
