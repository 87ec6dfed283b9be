"""Bounded load test of both services: N concurrent clients for D seconds each.

Each service runs as `calibrl serve ...` in a child process on loopback:

- retrieval: the HotpotQA index that benchmarks/bench_retrieval.py builds (3,950 passages,
  MiniLM + FAISS flat + BM25) when it exists and matches the data file, else the
  twelve-passage test index (built in seconds); ScoreRetrieval requests of ``--batch``
  HotpotQA questions (or test queries) with their gold titles, top_k 5, hybrid mode
  (``--mode bm25`` measures the service without the embedder).
- judge: the programmatic backend with a demo-like rubric (entity coverage with the
  domain glossary, intent similarity by MiniLM embeddings, specificity, length, and
  the invented-entity and compliance-leak penalties); Score requests of ``--batch``
  synthetic SME-graded fund-question rewrites with their retrieved passages. The
  result cache is off, so every item is really scored (``--judge-embedder
  hashed-ngrams`` measures it without MiniLM).

Every client has its own channel and sends one request after another (closed loop)
until the phase ends; requests still in flight then finish and count. Any non-OK
status is an error. Reported per service: requests, errors, requests/s, items/s and
the p50 / p90 / p99 / max latency of a request.

    python benchmarks/bench_load.py                               # 32 clients x 30 s per service
    python benchmarks/bench_load.py --clients 8 --duration 5 --services judge
    python benchmarks/bench_load.py --index /path/to/index --out /tmp/load.json

Exit code 1 when any request failed. Loopback only; the run stops by itself.
Figures from a shared machine are noisy: the script prints the load average before
and after.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "hotpotqa" / "dev_400.jsonl"
DEFAULT_HOTPOTQA_INDEX = pathlib.Path("/tmp/calibrl-bench/hotpotqa-flat")  # where bench_retrieval.py builds it
TOP_K = 5
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # the servers' load-shedding trailer

DEMO_RUBRIC_ID = "fund-rewriter-load"


def demo_rubric_yaml(glossary: list[str]) -> str:
    """A rubric shaped like the demo's distilled one: the SME taxonomy's criteria."""
    return "\n".join([
        f"id: {DEMO_RUBRIC_ID}",
        'version: "1"',
        "description: Load-test rubric for query rewrites of fund questions (programmatic criteria only).",
        f"glossary: {json.dumps(glossary)}",
        "criteria:",
        "  - {name: key_entities, kind: programmatic, scorer: entity_coverage, weight: 0.35, severity: 2.0}",
        "  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.35, severity: 2.0}",
        "  - {name: specific, kind: programmatic, scorer: specificity, weight: 0.2, severity: 1.0}",
        "  - {name: length, kind: programmatic, scorer: length, weight: 0.1, severity: 0.5}",
        "  - {name: invented, kind: programmatic, scorer: invented_entities, weight: 0.3, severity: 3.0,"
        " penalty: true}",
        "  - {name: leak, kind: programmatic, scorer: compliance_leak, weight: 1.0, severity: 4.0, penalty: true}",
        "",
    ])


# =============================================================================== servers


class ChildServer:
    """`calibrl serve <service>` in a child process; its port is read from its log."""

    def __init__(self, service: str, args: list[str], threads: int = 0) -> None:
        self.service = service
        self.command = [sys.executable, "-m", "calibrl", "serve", service, "--port", "0", *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)  # torch's intra-op threads
        self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env=env)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._port: int | None = None
        self._ready = threading.Event()
        # Drain stderr for the whole run so the child never blocks on a full pipe.
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.tail.append(line.rstrip())
            match = re.search(r"serving calibrl\.v1\.\w+ on [\d.]+:(\d+)", line)
            if match and self._port is None:
                self._port = int(match.group(1))
                self._ready.set()
        self._ready.set()

    def target(self, timeout: float = 600.0) -> str:
        if not self._ready.wait(timeout) or self._port is None:
            raise RuntimeError(f"{' '.join(self.command)} did not start:\n" + "\n".join(self.tail))
        return f"127.0.0.1:{self._port}"

    def stop(self) -> int:
        """SIGTERM (drain and exit), then kill if it lingers; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def choose_index(index: str, data: pathlib.Path, work: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The index folder to serve and what it is."""
    from calibrl.errors import CalibrlError
    from calibrl.retrieval_server.corpus import file_sha256
    from calibrl.retrieval_server.manifest import read_manifest, verify_files

    if index != "auto":
        manifest = read_manifest(index)
        return pathlib.Path(index), f"{index} ({manifest.doc_count} passages)"
    if data.exists() and DEFAULT_HOTPOTQA_INDEX.exists():
        try:
            manifest = read_manifest(DEFAULT_HOTPOTQA_INDEX)
            verify_files(DEFAULT_HOTPOTQA_INDEX, manifest)
            if manifest.corpus_sha256 == file_sha256(data):
                return DEFAULT_HOTPOTQA_INDEX, f"HotpotQA dev_400 ({manifest.doc_count} passages, flat)"
        except CalibrlError as exc:
            print(f"not using {DEFAULT_HOTPOTQA_INDEX}: {exc}", file=sys.stderr)
    from calibrl.testing import TINY_CORPUS, build_test_index

    print("HotpotQA index not built (python benchmarks/bench_retrieval.py builds it); using the test index",
          file=sys.stderr)
    return build_test_index(work / "tiny-index"), f"tiny test index ({len(TINY_CORPUS)} passages)"


# =============================================================================== requests


MODES = {"hybrid": 3, "dense": 1, "bm25": 2}  # calibrl.v1.SearchMode numbers


def retrieval_requests(batch: int, data: pathlib.Path, hotpotqa: bool, mode: str) -> list[Any]:
    from calibrl.v1 import retrieval_pb2 as pb

    if hotpotqa:
        from calibrl.retrieval_server.corpus import read_hotpotqa_questions

        items = [pb.ScoreItem(query=q.question, gold_doc_ids=list(q.gold_titles), gold_answers=list(q.answers))
                 for q in read_hotpotqa_questions(data)]
    else:
        from calibrl.testing import TINY_CORPUS

        items = [pb.ScoreItem(query=f"{word} {p['title']}", gold_doc_ids=[p["_id"]])
                 for p in TINY_CORPUS for word in ("what is", "tell me about", "facts on", "history of")]
    return [pb.ScoreRetrievalRequest(items=[items[(start + n) % len(items)] for n in range(batch)], top_k=TOP_K,
                                     mode=MODES[mode])
            for start in range(0, len(items), batch)]


def judge_requests(batch: int) -> list[Any]:
    from calibrl.v1 import judge_pb2 as pb
    from calibrl.testing import synthetic_feedback

    items = [pb.JudgeItem(query=r.query, output=r.output, retrieved_texts=list(r.retrieved_texts),
                          retrieved_doc_ids=list(r.retrieved_doc_ids)) for r in synthetic_feedback(n=400, seed=7)]
    return [pb.ScoreRequest(rubric_id=DEMO_RUBRIC_ID, items=[items[(start + n) % len(items)] for n in range(batch)])
            for start in range(0, len(items), batch)]


# =============================================================================== load


@dataclass
class PhaseResult:
    service: str
    rpc: str
    clients: int
    batch: int
    duration_s: float
    requests: int
    errors: dict[str, int] = field(default_factory=dict)
    shed: int = 0  # RESOURCE_EXHAUSTED with a retry pushback: the caller waited it out and sent again
    requests_per_s: float = 0.0
    items_per_s: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0


async def run_phase(service: str, rpc: str, target: str, stub_factory: Callable[[Any], Any], requests: list[Any],
                    clients: int, duration: float, timeout: float) -> PhaseResult:
    """``clients`` closed-loop callers, each on its own channel, for ``duration`` seconds."""
    import grpc
    import numpy as np

    channels = [grpc.aio.insecure_channel(target) for _ in range(clients)]
    methods: list[Callable[..., Awaitable[Any]]] = [getattr(stub_factory(c), rpc) for c in channels]
    batch = len(requests[0].items)
    try:
        # Connect every channel and warm the server up; not measured.
        await asyncio.gather(*(m(requests[i % len(requests)], timeout=timeout) for i, m in enumerate(methods)))
        latencies: list[float] = []
        errors: collections.Counter[str] = collections.Counter()
        shed = [0]
        start = time.perf_counter()
        deadline = start + duration

        async def client(index: int) -> None:
            n = index
            while time.perf_counter() < deadline:
                request = requests[n % len(requests)]
                n += clients
                sent = time.perf_counter()
                try:
                    await methods[index](request, timeout=timeout)
                except grpc.aio.AioRpcError as exc:
                    pushback = dict(exc.trailing_metadata() or ()).get(PUSHBACK_KEY)
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and pushback is not None:
                        shed[0] += 1  # load shedding: honour the pushback, as the trainer's clients do
                        await asyncio.sleep(int(pushback) / 1000)
                    else:
                        errors[exc.code().name] += 1
                    continue
                latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    ms = np.asarray(latencies) * 1000.0 if latencies else np.zeros(1)
    return PhaseResult(
        service=service, rpc=rpc, clients=clients, batch=batch, duration_s=round(elapsed, 2),
        requests=len(latencies) + sum(errors.values()) + shed[0], errors=dict(errors), shed=shed[0],
        requests_per_s=len(latencies) / elapsed, items_per_s=len(latencies) * batch / elapsed,
        p50_ms=float(np.percentile(ms, 50)), p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)), max_ms=float(ms.max()),
    )


def markdown(results: list[PhaseResult]) -> str:
    lines = ["| service | RPC | clients | items/request | seconds | requests | shed (pushback honoured) | errors "
             "| OK requests/s | OK items/s | p50 ms | p90 ms | p99 ms | max ms |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        errors = ", ".join(f"{code} {n}" for code, n in sorted(r.errors.items())) or "0"
        lines.append(f"| {r.service} | {r.rpc} | {r.clients} | {r.batch} | {r.duration_s:.1f} | {r.requests} "
                     f"| {r.shed} | {errors} | {r.requests_per_s:.1f} | {r.items_per_s:.0f} | {r.p50_ms:.0f} "
                     f"| {r.p90_ms:.0f} | {r.p99_ms:.0f} | {r.max_ms:.0f} |")
    return "\n".join(lines)


# =============================================================================== main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients per service (32)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per service (30)")
    parser.add_argument("--batch", type=int, default=8, help="items per request: a trainer's reward chunk (8)")
    parser.add_argument("--services", default="retrieval,judge", help="comma-separated: retrieval, judge")
    parser.add_argument("--index", default="auto", help="index folder, or auto (HotpotQA when built, else tiny)")
    parser.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA, help="HotpotQA dev_400.jsonl")
    parser.add_argument("--mode", choices=sorted(MODES), default="hybrid",
                        help="retrieval mode (hybrid); bm25 needs no embedding")
    parser.add_argument("--judge-embedder", choices=("minilm", "hashed-ngrams"), default="minilm",
                        help="intent-similarity embedder of the judge (minilm)")
    parser.add_argument("--retrieval-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override of the retrieval server (repeatable)")
    parser.add_argument("--judge-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override of the judge server (repeatable)")
    parser.add_argument("--server-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of the server processes (torch's CPU threads); 0 = torch's default")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of each request, seconds")
    parser.add_argument("--out", type=pathlib.Path, help="also write the results as JSON here")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the table as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME, rendered by scripts/render_results.py)")
    args = parser.parse_args(argv)
    services = [s.strip() for s in args.services.split(",") if s.strip()]
    unknown = set(services) - {"retrieval", "judge"}
    if unknown or not services:
        parser.error(f"--services: unknown {sorted(unknown)}; use retrieval and/or judge")
    if args.clients < 1 or args.duration <= 0 or args.batch < 1:
        parser.error("--clients, --duration and --batch must be positive")

    from calibrl.v1 import judge_pb2_grpc, retrieval_pb2_grpc

    load_before = os.getloadavg()
    results: list[PhaseResult] = []
    setup: dict[str, str] = {}
    exit_codes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="calibrl-load-") as work_dir:
        work = pathlib.Path(work_dir)
        for service in services:
            if service == "retrieval":
                index_dir, setup["retrieval_index"] = choose_index(args.index, args.data, work)
                server = ChildServer("retrieval", ["--index", str(index_dir), "device=cpu", "embedding_cache_size=0",
                                                   *args.retrieval_set],
                                     args.server_threads)
                hotpotqa = index_dir == DEFAULT_HOTPOTQA_INDEX or "hotpotqa" in str(index_dir).lower()
                requests = retrieval_requests(args.batch, args.data, hotpotqa and args.data.exists(), args.mode)
                setup["retrieval_index"] += f", {args.mode} mode, top_k {TOP_K}, embedding cache off" + "".join(
                    f", {o}" for o in args.retrieval_set)
                stub, rpc = retrieval_pb2_grpc.RetrievalServiceStub, "ScoreRetrieval"
            else:
                from calibrl.testing import SYNTHETIC_GLOSSARY

                rubrics = work / "rubrics"
                rubrics.mkdir()
                (rubrics / f"{DEMO_RUBRIC_ID}.yaml").write_text(demo_rubric_yaml(list(SYNTHETIC_GLOSSARY)))
                server = ChildServer("judge", ["--rubrics", str(rubrics), "--backend", "programmatic",
                                               "--allow-unvalidated", f"judge.embedder={args.judge_embedder}",
                                               "judge.cache_size=0", "judge.embedder_cache_size=0", "judge.embedder_device=cpu",
                                               *args.judge_set],
                                     args.server_threads)
                setup["judge"] = (f"programmatic, {args.judge_embedder} embedder, result and embedding caches off, "
                                  f"rubric {DEMO_RUBRIC_ID}") + (
                    "".join(f", {o}" for o in args.judge_set))
                requests = judge_requests(args.batch)
                stub, rpc = judge_pb2_grpc.JudgeServiceStub, "Score"
            try:
                target = server.target()
                print(f"{service}: {args.clients} clients x {args.duration:.0f} s against {target} ...",
                      file=sys.stderr)
                result = asyncio.run(run_phase(service, rpc, target, stub, requests, args.clients, args.duration,
                                               args.timeout))
            finally:
                exit_codes[service] = server.stop()
            results.append(result)
            print(markdown([result]).splitlines()[-1], file=sys.stderr)

    load_after = os.getloadavg()
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load_before[0]:.1f} before and "
               f"{load_after[0]:.1f} after (shared machine)")
    command = "python benchmarks/bench_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n`{command.strip()}` on {machine}")
    if args.server_threads:
        setup["server threads"] = f"OMP_NUM_THREADS={args.server_threads}"
    for name, value in setup.items():
        print(f"- {name}: {value}")
    print()
    print(markdown(results))
    failed = sum(sum(r.errors.values()) for r in results)
    bad_exit = {s: c for s, c in exit_codes.items() if c != 0}
    if bad_exit:
        print(f"\nservers that did not exit cleanly on SIGTERM: {bad_exit}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "machine": machine, "setup": setup,
                                        "server_exit_codes": exit_codes,
                                        "results": [asdict(r) for r in results]}, indent=2) + "\n")
    if args.record:
        from bench_record import tables_from_markdown, write_record

        title = "Closed-loop load: " + "; ".join(f"{name} {value}" for name, value in setup.items())
        notes = [f"errors (codes other than a shed with pushback): {failed} of {sum(r.requests for r in results)} "
                 "requests"]
        if bad_exit:
            notes.append(f"servers that did not exit cleanly on SIGTERM: {bad_exit}")
        write_record(args.record, tables_from_markdown([title, "", *markdown(results).splitlines()]), notes=notes,
                     libraries=("grpcio", "torch", "onnxruntime", "faiss-cpu"))
    return 1 if failed or bad_exit else 0


if __name__ == "__main__":
    sys.exit(main())
