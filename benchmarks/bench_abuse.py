"""The services under abuse: memory under floods of refused requests; the most
expensive requests the size limits allow, which the cost budget now refuses at once
(how fast, and how long the largest prefix it accepts takes); and a small caller's
latency while a heavy caller (the largest accepted request) and a cancelling caller run.

Starts real `calibrl serve retrieval` and `calibrl serve judge` processes on loopback
(default limits, API keys on the retrieval server), over the demo's generated corpus
(142 passages, so top_k 100 returns 100 hits) and a programmatic judge rubric.

    python benchmarks/bench_abuse.py [--requests 1000] [--oversize-mb 6] [--only memory,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

KEY = "bench-abuse-key"


def _start(args: list[str], log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "calibrl", *args, "serving.drain_seconds=0"],
                               stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = process.stdout.readline()
    if "listening on" not in line:
        raise SystemExit(f"server did not start: {line!r}; see {log}")
    return process, f"127.0.0.1:{line.strip().rsplit(':', 1)[1]}"


def _rss_mib(process: subprocess.Popen) -> float:
    import psutil

    return psutil.Process(process.pid).memory_info().rss / 2**20


async def _flood(address: str, method: str, body: bytes, metadata: list, count: int, concurrency: int = 16) -> dict:
    import grpc

    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(method)

        async def one() -> None:
            try:
                await call(body, metadata=metadata, timeout=120)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] = codes.get(exc.code().name, 0) + 1

        for _ in range(max(1, count // concurrency)):
            await asyncio.gather(*(one() for _ in range(concurrency)))
    return codes


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def memory_floods(retrieval, judge, retrieval_address, judge_address, requests, oversize_mb) -> list[dict]:
    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import retrieval_pb2 as pb

    search, score = "/calibrl.v1.RetrievalService/Search", "/calibrl.v1.JudgeService/Score"
    warm = pb.SearchRequest(queries=["expense ratio"], top_k=5).SerializeToString()
    await _flood(retrieval_address, search, warm, [("x-api-key", KEY)], 32)
    judge_warm = jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(query="fee", output="fund fee")])
    await _flood(judge_address, score, judge_warm.SerializeToString(), [], 32)
    oversize = pb.SearchRequest(queries=["x" * int(oversize_mb * 2**20)], top_k=5).SerializeToString()
    unauthenticated = pb.SearchRequest(queries=["y" * int(3.5 * 2**20)], top_k=5).SerializeToString()
    judge_oversize = jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(
        query="fee", output="fee", context={f"k{i}": "v" * 100_000 for i in range(int(oversize_mb * 10))})])
    rows = []
    for name, process, address, method, body, metadata in (
        (f"retrieval Search {oversize_mb:g} MiB (limit 4), with key", retrieval, retrieval_address, search,
         oversize, [("x-api-key", KEY)]),
        ("retrieval Search 3.5 MiB, no API key", retrieval, retrieval_address, search, unauthenticated, []),
        (f"judge Score {len(judge_oversize.SerializeToString()) / 2**20:.1f} MiB context (limit 4)", judge,
         judge_address, score, judge_oversize.SerializeToString(), []),
    ):
        before = _rss_mib(process)
        started = time.perf_counter()
        codes = await _flood(address, method, body, metadata, requests)
        seconds = time.perf_counter() - started
        after = _rss_mib(process)
        await asyncio.sleep(2.0)  # the server hands freed heap back once a second
        rows.append({"flood": name, "requests": sum(codes.values()), "codes": codes,
                     "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1),
                     "rss_settled_mib": round(_rss_mib(process), 1), "seconds": round(seconds, 1)})
        print(rows[-1], flush=True)
    return rows


async def _refused_then_fitted(call, build, metadata) -> tuple[float, int, float, str]:
    """Send ``build(None)`` (the whole request): (refusal ms, items the budget accepts, seconds
    the accepted prefix ``build(n)`` took, the refusal's message)."""
    import grpc

    started = time.perf_counter()
    try:
        await call(build(None), metadata=metadata, timeout=600)
        raise SystemExit("the cost budget accepted a request it should refuse")
    except grpc.aio.AioRpcError as exc:
        refused_ms = (time.perf_counter() - started) * 1000
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        fits = int(dict(exc.trailing_metadata())["calibrl-max-items"])
        message = exc.details()
    started = time.perf_counter()
    await call(build(fits), metadata=metadata, timeout=600)
    return refused_ms, fits, time.perf_counter() - started, message


async def worst_case(retrieval_address, judge_address, repeats: int = 1) -> list[dict]:
    """The most expensive requests the size limits admit: refused by the cost budget (time to
    refuse), then their largest accepted prefix, timed alone."""
    import grpc

    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import judge_pb2_grpc
    from calibrl.v1 import retrieval_pb2 as pb
    from calibrl.v1 import retrieval_pb2_grpc as pb_grpc

    words = "fund expense ratio annual fee account eligibility manager contribution limit tax ".split()
    long_query = " ".join(words[i % len(words)] for i in range(400))[:2030]  # + a salt: at most 2,048
    answers = [" ".join(words[(i + j) % len(words)] for j in range(60))[:512] for i in range(8)]
    text = " ".join(words[i % len(words)] for i in range(1300))[:7800]

    def search(salt):
        return lambda n: pb.SearchRequest(queries=[f"{salt}{i} {long_query}" for i in range(256 if n is None else n)],
                                          top_k=100, mode=pb.SEARCH_MODE_HYBRID)

    def score(salt):
        return lambda n: pb.ScoreRetrievalRequest(items=[pb.ScoreItem(
            query=f"{salt}{i} {long_query}", gold_answers=answers, gold_doc_ids=[f"d{j}" for j in range(32)],
            seen_doc_ids=[f"s{j}" for j in range(32)]) for i in range(256 if n is None else n)], top_k=100,
            mode=pb.SEARCH_MODE_HYBRID)

    def judge(salt):  # new texts each time: the judge's result and embedding caches would answer a repeat
        return lambda n: jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(
            query=f"{salt}{i} {text[:600]}", output=f"{salt}{i} {text[:7000]}", retrieved_texts=[text[:1000]] * 5,
            retrieved_doc_ids=[f"d{j}" for j in range(5)], context={"domain": "funds"})
            for i in range(155 if n is None else n)])  # 155 items: ~2,000,000 chars

    requests = {
        "retrieval Search: 256 queries x 2048 chars, top_k 100, hybrid": ("search", search),
        "retrieval ScoreRetrieval: 256 items x 2048 chars, 2048 answers x 512 chars, 16384 ids, top_k 100, hybrid":
            ("score", score),
        "judge Score: 155 items, ~2,000,000 chars, programmatic MiniLM rubric": ("judge", judge),
    }
    rows = []
    async with grpc.aio.insecure_channel(retrieval_address) as channel, \
            grpc.aio.insecure_channel(judge_address) as judge_channel:
        stub = pb_grpc.RetrievalServiceStub(channel)
        calls = {"search": stub.Search, "score": stub.ScoreRetrieval,
                 "judge": judge_pb2_grpc.JudgeServiceStub(judge_channel).Score}
        for name, (kind, build) in requests.items():
            metadata = [] if kind == "judge" else [("x-api-key", KEY)]
            refused, accepted = [], []
            for repeat in range(repeats):
                # new texts per request and repeat: the embedding and result caches would answer a repeat
                refused_ms, fits, seconds, message = await _refused_then_fitted(calls[kind],
                                                                                build(f"{kind}{repeat}"), metadata)
                refused.append(refused_ms)
                accepted.append(seconds)
            rows.append({"request": name, "refused_ms_max": round(max(refused), 1), "refusal": message,
                         "largest_accepted_items": fits, "accepted_seconds_min": round(min(accepted), 2),
                         "accepted_seconds_max": round(max(accepted), 2)})
            print(rows[-1], flush=True)
    return rows


async def small_caller_latency(address: str, calls: int, heavy_items: int) -> list[dict]:
    """A 1-query BM25 Search, one call at a time: alone, then beside a heavy ScoreRetrieval caller
    and a caller that sends a heavy Search and cancels it 50 ms later, over and over (each
    the largest the cost budget accepts, up to ``heavy_items``, with ~1,900-char queries)."""
    import grpc

    from calibrl.v1 import retrieval_pb2 as pb
    from calibrl.v1 import retrieval_pb2_grpc as pb_grpc

    metadata = [("x-api-key", KEY)]
    long_text = " ".join("fund expense ratio annual fee account eligibility".split() * 60)[:1900]

    def heavy_request(n, salt):  # new queries each time: the embedding cache would answer a repeat
        return pb.ScoreRetrievalRequest(items=[pb.ScoreItem(query=f"{salt} {i} {long_text}", gold_answers=["fee"])
                                               for i in range(n)], top_k=100, mode=pb.SEARCH_MODE_HYBRID)

    def cancelled_request(n, salt):
        return pb.SearchRequest(queries=[f"{salt} {i} {long_text}" for i in range(n)], top_k=100,
                                mode=pb.SEARCH_MODE_HYBRID)

    rows = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RetrievalServiceStub(channel)
        sizes = {}
        for kind, call, build in (("heavy", stub.ScoreRetrieval, heavy_request),
                                  ("cancelled", stub.Search, cancelled_request)):
            try:  # the largest request the cost budget accepts (it answers how many items fit)
                await call(build(heavy_items, "probe"), metadata=metadata, timeout=600)
                sizes[kind] = heavy_items
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                sizes[kind] = int(dict(exc.trailing_metadata())["calibrl-max-items"])

        async def small_calls() -> list[float]:
            latencies = []
            for i in range(calls):
                started = time.perf_counter()
                await stub.Search(pb.SearchRequest(queries=[f"expense ratio {i}"], top_k=5, mode=pb.SEARCH_MODE_BM25),
                                  metadata=metadata, timeout=300)
                latencies.append((time.perf_counter() - started) * 1000)
            return latencies

        alone = await small_calls()
        stop = asyncio.Event()
        heavy_done = cancelled = 0

        async def heavy_caller() -> None:
            nonlocal heavy_done
            while not stop.is_set():
                await stub.ScoreRetrieval(heavy_request(sizes["heavy"], f"h{heavy_done}"), metadata=metadata,
                                          timeout=600)
                heavy_done += 1

        async def cancelling_caller() -> None:
            nonlocal cancelled
            while not stop.is_set():
                call = stub.Search(cancelled_request(sizes["cancelled"], f"c{cancelled}"), metadata=metadata,
                                   timeout=600)
                await asyncio.sleep(0.05)
                call.cancel()
                cancelled += 1
                await asyncio.sleep(0.05)

        background = [asyncio.ensure_future(heavy_caller()), asyncio.ensure_future(cancelling_caller())]
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        loaded = await small_calls()
        elapsed = time.perf_counter() - started
        stop.set()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    for name, latencies in (("alone", alone), ("with a heavy and a cancelling caller", loaded)):
        rows.append({"small caller": name, "calls": len(latencies),
                     "p50_ms": round(_percentile(latencies, 0.5), 1), "p99_ms": round(_percentile(latencies, 0.99), 1),
                     "max_ms": round(max(latencies), 1)})
        print(rows[-1], flush=True)
    rows[-1].update(heavy_requests_completed=heavy_done, heavy_calls_cancelled=cancelled,
                    heavy_items=sizes["heavy"], cancelled_items=sizes["cancelled"], seconds=round(elapsed, 1),
                    p99_ratio=round(rows[-1]["p99_ms"] / rows[-2]["p99_ms"], 2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="refused requests per flood")
    parser.add_argument("--oversize-mb", type=float, default=6.0, help="size of an oversize request, MiB")
    parser.add_argument("--calls", type=int, default=200, help="small caller's calls per phase")
    parser.add_argument("--heavy-items", type=int, default=256, help="queries of the heavy and cancelled calls")
    parser.add_argument("--only", default="", help="comma-separated sections: memory, worst_case, small_caller")
    parser.add_argument("--repeats", type=int, default=1, help="timings of each worst-case request")
    parser.add_argument("--workdir", default="", help="folder for the index and logs (default: a temp folder)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the tables as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME, rendered by scripts/render_results.py)")
    args = parser.parse_args()

    from calibrl.demo.domain import generate_domain
    from calibrl.retrieval_server.index import build_index_from_dicts

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="bench-abuse-"))
    work.mkdir(parents=True, exist_ok=True)
    index = work / "index"
    if not (index / "manifest.json").exists():
        records = [{"_id": p.doc_id, "title": p.title, "text": p.text} for p in generate_domain(0).passages]
        build_index_from_dicts(records, index, device="cpu", show_progress=False)
    keys = work / "keys.yaml"
    keys.write_text(f"tenants:\n  - name: bench\n    key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n")
    rubrics = work / "rubrics"
    rubrics.mkdir(exist_ok=True)
    (rubrics / "bench.yaml").write_text(
        "id: bench\nversion: '1'\ncriteria:\n"
        "  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.5}\n"
        "  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.3}\n"
        "  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.2}\n"
        "  - {name: invented, kind: programmatic, scorer: invented_entities, weight: 0.5, penalty: true}\n")
    retrieval, retrieval_address = _start(
        ["serve", "retrieval", "--index", str(index), "--port", "0", "device=cpu", f"serving.api_keys_file={keys}"],
        work / "retrieval.log")
    judge, judge_address = _start(
        ["serve", "judge", "--rubrics", str(rubrics), "--port", "0", "--allow-unvalidated"], work / "judge.log")
    try:
        sections = {
            "memory": lambda: memory_floods(retrieval, judge, retrieval_address, judge_address,
                                            args.requests, args.oversize_mb),
            "worst_case": lambda: worst_case(retrieval_address, judge_address, args.repeats),
            "small_caller": lambda: small_caller_latency(retrieval_address, args.calls, args.heavy_items),
        }
        results: dict = {}
        for name, section in sections.items():
            if args.only and name not in args.only.split(","):
                continue
            try:
                results[name] = asyncio.run(section())
            except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(name, results[name], flush=True)
    finally:
        for process in (retrieval, judge):
            process.terminate()
            process.wait(timeout=60)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    if args.record:
        from bench_record import write_record

        tables, notes = record_tables(results)
        write_record(args.record, tables, libraries=("grpcio", "torch", "onnxruntime"), notes=notes)


MEMORY_GROWTH_TARGET = 0.10  # RSS after a flood of refused requests, settled, over before


def record_tables(results: dict) -> tuple[list[dict], list[str]]:
    """The record's tables (one per section that ran) and their verdict lines."""
    from bench_record import rows_table, verdict

    tables, notes = [], []
    for name, rows in results.items():
        if isinstance(rows, dict) and "error" in rows:
            notes.append(f"{name}: failed: {rows['error']}")
    memory = results.get("memory")
    if isinstance(memory, list):
        tables.append(rows_table("Memory under floods of refused requests (16 concurrent callers; server RSS from "
                                 "psutil before, right after and 2 s after the flood)", memory))
        for row in memory:
            growth = row["rss_settled_mib"] / row["rss_before_mib"] - 1.0
            notes.append(f"{row['flood']}: settled RSS {growth:+.1%} of before (target within "
                         f"{MEMORY_GROWTH_TARGET:.0%}): {verdict(abs(growth) <= MEMORY_GROWTH_TARGET)}")
    worst = results.get("worst_case")
    if isinstance(worst, list):
        tables.append(rows_table("The worst requests within the size limits: refused whole by the cost budget, then "
                                 "the largest accepted prefix (calibrl-max-items trailer) timed alone, new texts "
                                 "each time", worst))
    small = results.get("small_caller")
    if isinstance(small, list):
        tables.append(rows_table("A small caller (1-query BM25 Search, one at a time) alone, then beside a heavy "
                                 "caller (the largest accepted ScoreRetrieval, back to back) and a cancelling caller "
                                 "(the largest accepted hybrid Search, cancelled 50 ms later)", small))
        notes.append(f"small caller's p99 beside the heavy and cancelling callers: {small[-1]['p99_ratio']:.2f}x "
                     "its p99 alone")
    return tables, notes


if __name__ == "__main__":
    main()
