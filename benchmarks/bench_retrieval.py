"""Retrieval service benchmark: quality on HotpotQA, and gRPC vs in-process throughput.

1. Quality: recall@{2,5,10} and all-gold@{2,5,10} of bm25, dense and hybrid over the
   400 HotpotQA questions (query = question_text, gold = the two supporting titles).
2. Throughput: Search and ScoreRetrieval at batch 1 and 64, concurrency 1, 8 and 32,
   (a) over gRPC against `calibrl serve retrieval` in a child process (server-side
   cross-caller batching on), and (b) the same index called in-process (Retriever,
   one thread per concurrent caller). Queries/s, p50 and p99 request latency, and the
   gRPC / in-process throughput ratio.

    python benchmarks/bench_retrieval.py                      # builds the index if needed
    python benchmarks/bench_retrieval.py --index DIR --quick  # fewer requests per cell

The index is built once (MiniLM on CPU takes minutes) into --index and reused when its
manifest matches the data file. Figures on a shared machine are noisy: compare the
ratios measured within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

# The in-process path runs with the OpenMP wait policy `calibrl serve retrieval` sets by
# default, so both paths compare like for like (set OMP_WAIT_POLICY to override both).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calibrl.errors import CalibrlError  # noqa: E402
from calibrl.retrieval_server import metrics  # noqa: E402
from calibrl.retrieval_server.corpus import file_sha256, read_hotpotqa_corpus, read_hotpotqa_questions  # noqa: E402
from calibrl.api.retrieval import ScoreItem, SearchMode  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "hotpotqa" / "dev_400.jsonl"
DEFAULT_INDEX = pathlib.Path("/tmp/calibrl-bench/hotpotqa-flat")
CUTOFFS = (2, 5, 10)


@dataclass
class Cell:
    rpc: str
    path: str  # "grpc" or "in-process"
    batch: int
    concurrency: int
    requests: int
    queries_per_s: float
    p50_ms: float
    p99_ms: float


def ensure_index(data: pathlib.Path, index_dir: pathlib.Path, device: str) -> None:
    from calibrl.retrieval_server.index import build_index
    from calibrl.retrieval_server.manifest import read_manifest, verify_files

    sha = file_sha256(data)
    try:
        manifest = read_manifest(index_dir)
        verify_files(index_dir, manifest)
        if manifest.corpus_sha256 == sha:
            return
    except CalibrlError:
        pass
    print(f"building the HotpotQA index into {index_dir} (minutes on CPU)...", file=sys.stderr)
    build_index(read_hotpotqa_corpus(data), index_dir, corpus_sha256=sha, corpus_format="hotpotqa",
                device=device, overwrite=True)


def quality(retriever, questions) -> dict[str, dict[str, float]]:
    items = [ScoreItem(q.question, gold_doc_ids=q.gold_titles) for q in questions]
    table = {}
    for mode in (SearchMode.BM25, SearchMode.DENSE, SearchMode.HYBRID):
        start = time.perf_counter()
        scores = [score for start_at in range(0, len(items), retriever.limits.max_batch_size)
                  for score in retriever.score(items[start_at : start_at + retriever.limits.max_batch_size],
                                               top_k=max(CUTOFFS), mode=mode)]
        elapsed = time.perf_counter() - start
        row = {}
        for k in CUTOFFS:
            row[f"recall@{k}"] = statistics.fmean(metrics.recall_at_k(s.doc_ids, i.gold_doc_ids, k)
                                                  for s, i in zip(scores, items))
            row[f"all_gold@{k}"] = statistics.fmean(float(metrics.all_gold_at_k(s.doc_ids, i.gold_doc_ids, k))
                                                    for s, i in zip(scores, items))
        row["seconds"] = elapsed
        table[mode.value] = row
    return table


def _percentiles(latencies: list[float]) -> tuple[float, float]:
    return float(np.percentile(latencies, 50) * 1000), float(np.percentile(latencies, 99) * 1000)


def _batches(queries: list[str], batch: int, count: int) -> list[list[str]]:
    out = []
    position = 0
    for _ in range(count):
        out.append([queries[(position + j) % len(queries)] for j in range(batch)])
        position += batch
    return out


def run_in_process(retriever, rpc: str, batches: list[list[str]], concurrency: int, mode: SearchMode) -> Cell:
    def call(batch: list[str]) -> float:
        start = time.perf_counter()
        if rpc == "Search":
            retriever.search(batch, top_k=10, mode=mode)
        else:
            retriever.score([ScoreItem(q, gold_doc_ids=("x",)) for q in batch], top_k=10, mode=mode)
        return time.perf_counter() - start

    call(batches[0])  # warm-up
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        latencies = list(pool.map(call, batches))
    elapsed = time.perf_counter() - start
    p50, p99 = _percentiles(latencies)
    total = sum(len(b) for b in batches)
    return Cell(rpc, "in-process", len(batches[0]), concurrency, len(batches), total / elapsed, p50, p99)


def ceiling_rounds(retriever, queries: list[str], threads: int, mode: SearchMode,
                   rounds: int = 5) -> list[tuple[float, float, float]]:
    """Two ceilings of cross-caller batching for 8 callers at batch 1, as (8 callers, batched,
    encoder alone) queries/s triples of interleaved rounds. Each round searches ``queries`` in
    process once as 8 threads of one query per call (the in-process path) and once as
    ``threads`` threads of ``8 // threads`` queries per call (every worker batching its share of
    the 8 callers, with no per-call cost at all: the best a batching server could reach on this
    machine); then it only embeds them, on ``threads`` threads of ``8 // threads`` queries per
    call and of one query per call, and keeps the faster: a server whose BM25, FAISS, fusion,
    hits and calls cost nothing still has to run the encoder, whose vectors must stay the same,
    so no server answers faster than this."""
    group = max(1, 8 // threads)

    def rate(work: Callable[[list[str]], Any], size: int, workers: int) -> float:
        calls = [queries[i : i + size] for i in range(0, len(queries), size)]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(work, calls))
        return len(queries) / (time.perf_counter() - start)

    def search(batch: list[str]) -> Any:
        return retriever.search(batch, top_k=10, mode=mode)

    def embed(batch: list[str]) -> Any:
        return retriever.embedder.encode(batch, use_cache=False)

    rate(search, group, threads)  # warm-up
    rate(embed, group, threads)
    return [(rate(search, 1, 8), rate(search, group, threads),
             max(rate(embed, group, threads), rate(embed, 1, threads))) for _ in range(rounds)]


async def run_grpc(address: str, rpc: str, batches: list[list[str]], concurrency: int, mode: SearchMode) -> Cell:
    import grpc

    from calibrl.v1 import retrieval_pb2 as pb
    from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
    from calibrl.api import retrieval_wire as wire

    mode_pb = wire.mode_to_proto(mode)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.RetrievalServiceStub(channel)

        def request(batch: list[str]):
            if rpc == "Search":
                return stub.Search(pb.SearchRequest(queries=batch, top_k=10, mode=mode_pb), timeout=600)
            items = [pb.ScoreItem(query=q, gold_doc_ids=["x"]) for q in batch]
            return stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=items, top_k=10, mode=mode_pb), timeout=600)

        await request(batches[0])  # warm-up
        queue: asyncio.Queue = asyncio.Queue()
        for batch in batches:
            queue.put_nowait(batch)
        latencies: list[float] = []

        async def worker() -> None:
            while not queue.empty():
                batch = queue.get_nowait()
                start = time.perf_counter()
                while True:
                    try:
                        await request(batch)
                        break
                    except grpc.aio.AioRpcError as exc:  # shed: wait the pushback out and send again
                        pushback = dict(exc.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
                        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or pushback is None:
                            raise
                        await asyncio.sleep(int(pushback) / 1000)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    p50, p99 = _percentiles(latencies)
    total = sum(len(b) for b in batches)
    return Cell(rpc, "grpc", len(batches[0]), concurrency, len(batches), total / elapsed, p50, p99)


def start_server(index_dir: pathlib.Path, device: str, mode: SearchMode, dense_backend: str,
                 torch_threads: int, extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "calibrl", "serve", "retrieval", "--index", str(index_dir), "--port", "0",
               f"device={device}", f"default_mode={mode.value}", f"dense_backend={dense_backend}",
               f"torch_threads={torch_threads}", *extra]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert process.stderr is not None
    for line in process.stderr:
        match = re.search(r"serving calibrl\.v1\.RetrievalService on [\d.]+:(\d+)", line)
        if match:
            # keep draining the child's log so it never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, f"127.0.0.1:{match.group(1)}"
    raise RuntimeError(f"server exited with {process.wait()} before serving")


def markdown(quality_table, cells: list[Cell], mode: SearchMode, setup: str) -> str:
    lines = []
    if quality_table:
        lines += [f"Quality on HotpotQA dev_400 (400 questions, {setup}):", "",
                  "| mode | recall@2 | recall@5 | recall@10 | all-gold@2 | all-gold@5 | all-gold@10 |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in quality_table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[f'recall@{k}']:.3f}" for k in CUTOFFS) + " | "
                     + " | ".join(f"{row[f'all_gold@{k}']:.3f}" for k in CUTOFFS) + " |")
    lines += ["", f"Throughput, mode {mode.value}, top_k 10, {setup} (queries/s; latency per request):", "",
              "| rpc | batch | concurrency | gRPC q/s | in-process q/s | gRPC / in-process | gRPC p50 ms | "
              "gRPC p99 ms | in-process p50 ms | in-process p99 ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    index = {(c.rpc, c.path, c.batch, c.concurrency): c for c in cells}
    for (rpc, path, batch, concurrency), cell in index.items():
        if path != "grpc":
            continue
        local = index[(rpc, "in-process", batch, concurrency)]
        lines.append(
            f"| {rpc} | {batch} | {concurrency} | {cell.queries_per_s:.1f} | {local.queries_per_s:.1f} | "
            f"{cell.queries_per_s / local.queries_per_s:.2f}x | {cell.p50_ms:.1f} | {cell.p99_ms:.1f} | "
            f"{local.p50_ms:.1f} | {local.p99_ms:.1f} |"
        )
    return "\n".join(lines)


BATCHED_RATIO_TARGET = 0.8  # gRPC / in-process at batch 64
CALLERS_RATIO_TARGET = 1.5  # Search over gRPC with 8 callers at batch 1 / in-process (cross-caller batching)


def verdicts(cells: list[Cell], ceiling: Sequence[tuple[float, float, float]] = ()) -> list[str]:
    """The targets, computed from the cells that ran."""
    from bench_record import verdict

    index = {(c.rpc, c.path, c.batch, c.concurrency): c for c in cells}
    ratio = {key[:1] + key[2:]: cell.queries_per_s / index[(key[0], "in-process", *key[2:])].queries_per_s
             for key, cell in index.items() if key[1] == "grpc"}
    notes = []
    batched = [r for (rpc, batch, _), r in ratio.items() if batch == 64]
    if batched:
        notes.append(f"gRPC / in-process at batch 64: {min(batched):.2f}x to {max(batched):.2f}x (target >= "
                     f"{BATCHED_RATIO_TARGET}x): {verdict(min(batched) >= BATCHED_RATIO_TARGET)}")
    callers = ratio.get(("Search", 1, 8))
    if callers is not None:
        notes.append(f"Search over gRPC with 8 callers at batch 1: {callers:.2f}x in-process (target >= "
                     f"{CALLERS_RATIO_TARGET}x): {verdict(callers >= CALLERS_RATIO_TARGET)}")
    if ceiling:
        threads = os.cpu_count() or 1
        ratios = sorted(batched / single for single, batched, _ in ceiling)
        notes.append(f"ceiling of cross-caller batching for 8 callers at batch 1, in process ({len(ceiling)} "
                     f"interleaved rounds): {threads} threads of {max(1, 8 // threads)} queries per call (every "
                     f"worker batching its share of the 8 callers, no per-call cost) / 8 threads of one query: "
                     f"median {statistics.median(ratios):.2f}x, range {ratios[0]:.2f}x to {ratios[-1]:.2f}x")
        bounds = sorted(encoder / single for single, _, encoder in ceiling)
        notes.append(f"encoder-only bound, same rounds: the queries only embedded, {threads} threads of "
                     f"{max(1, 8 // threads)} queries or of one query per call (the faster), / Search in process "
                     f"by 8 threads of one query: median {statistics.median(bounds):.2f}x, range {bounds[0]:.2f}x "
                     f"to {bounds[-1]:.2f}x (a server that computes the same vectors with this encoder answers no "
                     f"faster; the {CALLERS_RATIO_TARGET}x target is "
                     f"{'within' if statistics.median(bounds) >= CALLERS_RATIO_TARGET else 'out of'} reach here)")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA, help="HotpotQA dev_400.jsonl")
    parser.add_argument("--index", type=pathlib.Path, default=DEFAULT_INDEX, help="index folder (built if needed)")
    parser.add_argument("--device", default="cpu", help="embedder / torch search device (server and in-process)")
    parser.add_argument("--dense-backend", default="auto", choices=("auto", "faiss", "torch"))
    parser.add_argument("--mode", default="hybrid", choices=[m.value for m in SearchMode],
                        help="mode of the throughput runs")
    parser.add_argument("--rpcs", default="Search,ScoreRetrieval", help="RPCs to measure")
    parser.add_argument("--batches", default="1,64", help="queries per request")
    parser.add_argument("--concurrency", default="1,8,32", help="concurrent callers")
    parser.add_argument("--quick", action="store_true", help="fewer requests per cell")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch CPU threads, in-process and in the server (0: torch's default)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the raw figures here")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--server-args", default="serving.max_request_cost_s=60 embedding_cache_size=0",
                        help="more key=value settings of the server (default: a cost budget that admits the "
                             "batch-64 requests whole, so both paths run the same batches, and no embedding "
                             "cache: the batches repeat queries)")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the tables as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME, rendered by scripts/render_results.py)")
    args = parser.parse_args(argv)
    if not args.data.exists():
        print(f"HotpotQA data not found at {args.data}", file=sys.stderr)
        return 2

    from calibrl.retrieval_server.retriever import Retriever

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    ensure_index(args.data, args.index, args.device)
    retriever = Retriever.load(args.index, device=args.device, dense_backend=args.dense_backend,
                               embedding_cache_size=0)  # as the server: the batches repeat queries
    questions = read_hotpotqa_questions(args.data)
    queries = [q.question for q in questions]
    mode = SearchMode(args.mode)

    quality_table = {} if args.skip_quality else quality(retriever, questions)
    for name, row in quality_table.items():
        print(f"{name:>7}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), file=sys.stderr)

    process, address = start_server(args.index, args.device, mode, args.dense_backend, args.torch_threads,
                                    args.server_args.split())
    cells: list[Cell] = []
    ceiling: list[tuple[float, float, float]] = []
    try:
        for rpc in args.rpcs.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    base = (16 if args.quick else 200) if batch == 1 else (4 if args.quick else 8)
                    count = max(base, 2 * concurrency)
                    batches = _batches(queries, batch, count)
                    if rpc == "Search" and batch == 1 and concurrency == 8:
                        ceiling = ceiling_rounds(retriever, [b[0] for b in batches], os.cpu_count() or 1, mode)
                    for cell in (asyncio.run(run_grpc(address, rpc, batches, concurrency, mode)),
                                 run_in_process(retriever, rpc, batches, concurrency, mode)):
                        cells.append(cell)
                        print(f"{cell.rpc:>14} {cell.path:>10} batch {cell.batch:>3} conc {cell.concurrency:>2}: "
                              f"{cell.queries_per_s:8.1f} q/s  p50 {cell.p50_ms:8.1f} ms  p99 {cell.p99_ms:8.1f} ms",
                              file=sys.stderr)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)

    import torch

    setup = (f"device {args.device}, dense backend {retriever.dense_index_type}, {os.cpu_count()} CPUs, "
             f"{torch.get_num_threads()} torch threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    text = markdown(quality_table, cells, mode, setup)
    print(text)
    if args.record:
        from bench_record import tables_from_markdown, write_record

        write_record(args.record, tables_from_markdown(text.splitlines()), notes=verdicts(cells, ceiling),
                     libraries=("grpcio", "torch", "onnxruntime", "faiss-cpu"))
    if args.json:
        args.json.write_text(json.dumps({"quality": quality_table, "cells": [asdict(c) for c in cells]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
