"""One judge and one retrieval server for many tenants (issue 28): the per-unit costs of
the cost models, the worst request the default budgets accept, a small tenant's latency
beside a flooding and a cancelling tenant, fair shares of four tenants (equal weights,
then 1:2:4), and 200 concurrent callers.

Starts real `calibrl serve retrieval` and `calibrl serve judge` processes on loopback
(default budgets; API keys with weights on the retrieval server) over the demo's generated
corpus (980 passages) and a programmatic judge rubric with the MiniLM embedder.

    python benchmarks/bench_tenants.py [--seconds 10] [--callers 200] [--only calibrate,worst,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench_abuse import _rss_mib, _start  # one way to start a served process and read its RSS (same folder)

TENANTS = {"t1": 1, "t2": 1, "t3": 1, "t4": 1, "w1": 1, "w2": 2, "w4": 4, "small": 1, "flood": 1, "cancel": 1,
           "crowd": 1}
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
WORDS = "fund expense ratio annual fee account eligibility manager contribution limit tax ".split()
RUBRIC = ("id: bench\nversion: '1'\ncriteria:\n"
          "  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.5}\n"
          "  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.3}\n"
          "  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.2}\n"
          "  - {name: invented, kind: programmatic, scorer: invented_entities, weight: 0.5, penalty: true}\n")


def _key(tenant: str) -> list[tuple[str, str]]:
    return [("x-api-key", f"bench-{tenant}")]


def _text(chars: int, salt: str = "") -> str:
    return (salt + " " + " ".join(WORDS[i % len(WORDS)] for i in range(chars // 4 + 1)))[:chars]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --------------------------------------------------------------------------- calibrate

def calibrate(work: pathlib.Path) -> list[dict]:
    """The per-unit costs behind calibrl.judge_server.costs and retrieval_server.limits
    (one torch thread; the best of several repeats)."""
    import torch

    from calibrl.embedding import load_embedder
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.judge import Judge
    from calibrl.judge_server.rubric import load_rubric
    from calibrl.api.judge import JudgeItem
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.retrieval_server.signals import score_hits
    from calibrl.api.retrieval import ScoreItem, SearchMode

    torch.set_num_threads(1)

    def best(run, repeats=5) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    rows = []
    rubric = load_rubric(work / "rubrics" / "bench.yaml")
    judge = Judge([rubric], JudgeConfig(cache_size=0, allow_unvalidated=True, embedder="hashed-ngrams"))
    for query, output, retrieved, length in ((20, 20, 0, 0), (8000, 8000, 0, 0), (600, 600, 50, 8000)):
        items = [JudgeItem.make(_text(query, str(i)), _text(output, f"o{i}"),
                                tuple(_text(length, str(j)) for j in range(retrieved))) for i in range(8)]
        seconds = best(lambda: judge.compute(rubric, items), 3) / len(items)
        rows.append({"unit": f"programmatic judge item: query {query}, output {output}, "
                             f"{retrieved} x {length} retrieved chars", "ms": round(seconds * 1000, 2)})
    minilm = load_embedder("minilm", "cpu")
    minilm.encode(["warm"])
    for words in (4, 256, 1000):
        text = " ".join(WORDS[i % len(WORDS)] for i in range(words))
        rows.append({"unit": f"MiniLM text of {len(text)} chars", "ms": round(best(lambda: minilm.encode([text]), 7)
                                                                              * 1000, 2)})
    retriever = Retriever.load(work / "index", device="cpu")
    for mode in SearchMode:
        for words, k in ((4, 1), (300, 1), (300, 100)):
            queries = [" ".join(WORDS[i % len(WORDS)] for i in range(words)) + f" {n}" for n in range(4)]
            seconds = best(lambda: retriever.ranked(queries, k, mode)) / len(queries)
            rows.append({"unit": f"retrieval {mode.value} query of {len(queries[0])} chars, top_k {k}",
                         "ms": round(seconds * 1000, 2)})
    hits = retriever.ranked([_text(40)], 100, SearchMode.BM25)[0]
    for answers in (1, 64):
        item = ScoreItem(query="q", gold_answers=tuple(_text(500, str(j)) for j in range(answers)))
        rows.append({"unit": f"ScoreRetrieval signals, {answers} answers x 100 hits",
                     "ms": round(best(lambda: score_hits(item, hits, 100, True)) * 1000, 2)})
    for row in rows:
        print(row, flush=True)
    return rows


# --------------------------------------------------------------------------- requests

def _fits(error) -> int:
    return int(dict(error.trailing_metadata())["calibrl-max-items"])


async def _largest_accepted(call, build, metadata, probe: int = 32) -> tuple[object, int]:
    """The largest prefix of ``build(probe)`` the server accepts (from its calibrl-max-items);
    ``probe`` stays within the 4 MiB transport limit."""
    import grpc

    try:
        await call(build(probe, "probe"), metadata=metadata, timeout=600)
        return build(probe, "x"), probe
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        n = _fits(exc)
        return build(n, "x"), n


SIZES = {"query": 2048, "judge": 8000}  # longest texts the requests use (--query-chars, --judge-chars)


def _requests():
    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import retrieval_pb2 as pb

    def search(n, salt):
        return pb.SearchRequest(queries=[_text(SIZES["query"], f"{salt}{i}") for i in range(n)], top_k=100,
                                mode=pb.SEARCH_MODE_HYBRID, include_text=True)

    def score(n, salt):
        return pb.ScoreRetrievalRequest(items=[pb.ScoreItem(
            query=_text(SIZES["query"], f"{salt}{i}"), gold_answers=[_text(512, str(j)) for j in range(8)],
            gold_doc_ids=[f"d{j}" for j in range(32)], seen_doc_ids=[f"s{j}" for j in range(32)])
            for i in range(n)], top_k=100, mode=pb.SEARCH_MODE_HYBRID)

    def prose(n, salt):
        return jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(
            query=_text(SIZES["judge"], f"{salt}q{i}"), output=_text(SIZES["judge"], f"{salt}o{i}"),
            retrieved_texts=[_text(SIZES["judge"], str(j)) for j in range(5)]) for i in range(n)])

    entity_query = " ".join(f"Ab{i}" for i in range(1600))[:SIZES["judge"]]

    def entities(n, salt):
        return jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(
            query=entity_query, output=(_text(7000, f"{salt}{i}") + " " + entity_query[:900])[-SIZES["judge"]:])
            for i in range(n)])

    q, j = SIZES["query"], SIZES["judge"]
    return {"search": (f"retrieval Search: {q}-char queries, top_k 100, hybrid, include_text", "search", search),
            "score": (f"retrieval ScoreRetrieval: {q}-char queries, 8 x 512-char answers, 64 ids, top_k 100",
                      "score", score),
            "prose": (f"judge Score: {j}-char query and output, 5 x {j} retrieved chars (MiniLM rubric)",
                      "judge", prose),
            "entities": (f"judge Score: entity shape (up to 1600 entity tokens in a {j}-char query)", "judge",
                         entities)}


def _stubs(retrieval_channel, judge_channel):
    from calibrl.v1 import judge_pb2_grpc
    from calibrl.v1 import retrieval_pb2_grpc as pb_grpc

    stub = pb_grpc.RetrievalServiceStub(retrieval_channel)
    judge = judge_pb2_grpc.JudgeServiceStub(judge_channel)
    return {"search": stub.Search, "score": stub.ScoreRetrieval, "judge": judge.Score}


async def worst(retrieval_address: str, judge_address: str, repeats: int = 3) -> list[dict]:
    """The largest request each default budget accepts, timed alone."""
    import grpc

    rows = []
    async with grpc.aio.insecure_channel(retrieval_address) as rc, grpc.aio.insecure_channel(judge_address) as jc:
        calls = _stubs(rc, jc)
        for name, kind, build in _requests().values():
            metadata = _key("small") if kind != "judge" else []
            _, n = await _largest_accepted(calls[kind], build, metadata)
            times = []
            for repeat in range(repeats):
                # new texts each time, and per request kind: the result and embedding caches would answer a repeat
                request = build(n, f"{kind}{len(rows)}r{repeat}")
                started = time.perf_counter()
                await calls[kind](request, metadata=metadata, timeout=600)
                times.append(time.perf_counter() - started)
            rows.append({"request": name, "items accepted": n, "seconds_min": round(min(times), 2),
                         "seconds_max": round(max(times), 2)})
            print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------- a small tenant

async def small_tenant(address: str, service: str, seconds: float, repeats: int = 2) -> list[dict]:
    """A 1-item call with a new text each time, one at a time: alone, then beside a tenant
    flooding with the largest accepted request and a tenant that sends it and cancels 50 ms
    later, over and over (new texts every request: the embedding cache would answer a
    repeat); the two phases interleaved ``repeats`` times."""
    import grpc

    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import retrieval_pb2 as pb

    _, kind, build = _requests()["search" if service == "retrieval" else "prose"]
    keyed = service == "retrieval"  # the judge runs without keys: each channel is its own tenant
    # own connections (channels of one process share one otherwise): without keys, a tenant each
    channels = {t: grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for t in ("small", "flood", "cancel")}
    calls = {t: _stubs(c, c)[kind] for t, c in channels.items()}
    meta = {t: _key(t) if keyed else [] for t in channels}
    _, n = await _largest_accepted(calls["flood"], build, meta["flood"])
    counter = [0]

    def small_request():
        counter[0] += 1
        if service == "retrieval":
            return pb.SearchRequest(queries=[f"expense ratio {counter[0]}"], top_k=5, mode=pb.SEARCH_MODE_HYBRID)
        return jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(query=f"VTSAX expense ratio {counter[0]}",
                                                                         output=f"VTSAX fee {counter[0]}")])

    async def small_calls(duration: float) -> list[float]:
        latencies, end = [], time.perf_counter() + duration
        while time.perf_counter() < end:
            started = time.perf_counter()
            await calls["small"](small_request(), metadata=meta["small"], timeout=300)
            latencies.append((time.perf_counter() - started) * 1000)
        return latencies

    rows = []
    done = {"flood": 0, "cancel": 0}

    async def flooder(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await calls["flood"](build(n, f"f{done['flood']}"), metadata=meta["flood"], timeout=600)
            done["flood"] += 1

    async def canceller(stop: asyncio.Event) -> None:
        while not stop.is_set():
            call = calls["cancel"](build(n, f"c{done['cancel']}"), metadata=meta["cancel"], timeout=600)
            await asyncio.sleep(0.05)
            call.cancel()
            done["cancel"] += 1

    pooled: dict[str, list[float]] = {"alone": [], "loaded": []}
    try:
        for repeat in range(repeats):
            load_before = round(os.getloadavg()[0], 2)
            alone = await small_calls(seconds)
            pooled["alone"] += alone
            stop = asyncio.Event()
            before = dict(done)
            background = [asyncio.ensure_future(flooder(stop)), asyncio.ensure_future(canceller(stop))]
            await asyncio.sleep(1.0)
            loaded = await small_calls(seconds)
            pooled["loaded"] += loaded
            stop.set()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await asyncio.sleep(1.0)  # the last flood unit finishes before the next alone phase
            for name, latencies in (("alone", alone), (f"beside a flooding tenant ({n}-item requests) and a "
                                                       "cancelling one", loaded)):
                rows.append({"service": service, "repeat": repeat, "small tenant": name, "calls": len(latencies),
                             "p50_ms": round(_percentile(latencies, 0.5), 1),
                             "p99_ms": round(_percentile(latencies, 0.99), 1)})
            rows[-1].update(p99_ratio=round(rows[-1]["p99_ms"] / rows[-2]["p99_ms"], 2),
                            flood_requests=done["flood"] - before["flood"],
                            cancelled_requests=done["cancel"] - before["cancel"], load1=load_before)
            print(rows[-2], flush=True)
            print(rows[-1], flush=True)
    finally:
        for channel in channels.values():
            await channel.close()
    summary = {"service": service, "repeat": "all", "small tenant": "pooled over the repeats",
               **{f"{phase}_{q}_ms": round(_percentile(pooled[phase], v), 1) for phase in pooled
                  for q, v in (("p50", 0.5), ("p99", 0.99))}}
    summary["p99_ratio"] = round(summary["loaded_p99_ms"] / summary["alone_p99_ms"], 2)
    print(summary, flush=True)
    return rows + [summary]


# --------------------------------------------------------------------------- fair shares

async def fair_shares(index: pathlib.Path, keys: pathlib.Path, tenants: dict[str, int], seconds: float) -> dict:
    """Tenants saturating a retrieval server (in this process, to read its batcher), each with 4
    callers and its own request size (1, 4, 16, 32 queries); served cost = the estimated cost
    of the queries run for each tenant during the window (the batcher's per-tenant figure)."""
    import grpc

    from calibrl.testing import start_test_server
    from calibrl.v1 import retrieval_pb2 as pb
    from calibrl.v1 import retrieval_pb2_grpc as pb_grpc

    running = await start_test_server(index, f"serving.api_keys_file={keys}", "device=cpu")
    stop = asyncio.Event()

    async def caller(tenant: str, stub, size: int, index: int) -> None:
        i = 0
        while not stop.is_set():
            queries = [f"{WORDS[(index + i + j) % len(WORDS)]} fee {tenant} {i} {j}" for j in range(size)]
            try:
                await stub.Search(pb.SearchRequest(queries=queries, top_k=10, mode=pb.SEARCH_MODE_HYBRID),
                                  metadata=_key(tenant), timeout=120)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED):
                    raise
                await asyncio.sleep(0.05)
            i += 1

    channels = {t: grpc.aio.insecure_channel(running.address, options=OWN_CONNECTION) for t in tenants}
    sizes = [1, 4, 16, 32]
    tasks = [asyncio.ensure_future(caller(t, pb_grpc.RetrievalServiceStub(channels[t]), sizes[n % 4], c))
             for n, t in enumerate(tenants) for c in range(4)]
    stats = running.batcher.stats
    await asyncio.sleep(2.0)  # every tenant backlogged
    before = {t: stats.tenant(t).served_cost for t in tenants}
    await asyncio.sleep(seconds)
    served = {t: stats.tenant(t).served_cost - before[t] for t in tenants}
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels.values():
        await channel.close()
    await running.stop(grace=0)
    values = list(served.values())
    total = sum(values) or 1.0
    normalised = [served[t] / w for t, w in tenants.items()]
    result = {"tenants": {t: {"weight": w, "request_queries": sizes[n % 4], "served_cost_s": round(served[t], 3),
                              "share": round(served[t] / total, 3)} for n, (t, w) in enumerate(tenants.items())},
              "jain_of_served_per_weight": round(sum(normalised) ** 2 / (len(normalised)
                                                                          * sum(v * v for v in normalised)), 3),
              "units": stats.batches}
    print(result, flush=True)
    return result


# --------------------------------------------------------------------------- overload

def _overload_request(service: str, index: int, i: int):
    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import retrieval_pb2 as pb

    if service == "retrieval":
        return pb.SearchRequest(queries=[f"{WORDS[(index + j) % len(WORDS)]} fee {index} {i} {j}" for j in range(32)],
                                top_k=10, mode=pb.SEARCH_MODE_HYBRID)
    return jpb.ScoreRequest(rubric_id="bench", items=[jpb.JudgeItem(
        query="VTSAX expense ratio", output=f"VTSAX fee {index} {i} {j}") for j in range(8)])


# The probes' deadline: shorter than the overloaded queue's wait, so that the server sheds most of
# their calls at once (what the shed-latency target times); a call it admits must still meet it.
PROBE_DEADLINE_S = 1.0


async def probe(service: str, address: str, seconds: float, out: pathlib.Path) -> None:
    """From its own process (a client not overloaded itself): connects, then one call of the
    overload's kind every 100 ms on that connection, as a trainer's long-lived channel makes
    them; the connection's set-up time and each call's code and latency, written to ``out``."""
    import grpc

    rows = []
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
        call = _stubs(channel, channel)["search" if service == "retrieval" else "judge"]
        started = time.perf_counter()
        await asyncio.wait_for(channel.channel_ready(), timeout=seconds)
        connect_ms = (time.perf_counter() - started) * 1000
        end, i = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            request = _overload_request(service, 10_000, i)  # built first: only the call is timed
            started = time.perf_counter()
            revoked = False
            try:
                await call(request, metadata=_key("crowd") if service == "retrieval" else [], timeout=PROBE_DEADLINE_S)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                revoked = "slowed down after admitting" in (exc.details() or "")
            rows.append((code, (time.perf_counter() - started) * 1000, time.time(), revoked))
            i += 1
            await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - started)))
    out.write_text(json.dumps({"connect_ms": connect_ms, "calls": rows}))


def _start_probe(service: str, address: str, seconds: float, out: pathlib.Path,
                 nice: int = 0) -> subprocess.Popen | None:
    """The probe process (:func:`probe`) writing to ``out``, at ``nice`` (below 0 needs root:
    None where raising the priority is not allowed)."""
    command = [sys.executable, __file__, "--probe", f"{service},{address},{seconds},{out}"]
    if not nice:
        return subprocess.Popen(command)
    try:
        return subprocess.Popen(command, preexec_fn=lambda: os.nice(nice))
    except (PermissionError, subprocess.SubprocessError):
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_figures(metrics_port: int) -> dict[str, float]:
    """From the server's Prometheus page: admitted calls that ran out of time there, and those
    it refused after admission because it slowed (``revoked``, counted among the shed); its
    shed calls (RESOURCE_EXHAUSTED), all and those answered within 50 ms (server-side RPC
    duration histogram); and its event loop's lag samples (a timer due every 10 ms,
    ``calibrl.server.loop.lag``), all and those more than 50 and 250 ms late."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode("utf-8")
    figures = {"missed": 0.0, "revoked": 0.0, "shed": 0.0, "shed_within_50ms": 0.0, "loop_lag_samples": 0.0,
               "loop_lag_over_50ms": 0.0, "loop_lag_over_250ms": 0.0}
    lag_buckets: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "calibrl_tenant_deadline_missed_total":
                figures["missed"] += sample.value
            elif sample.name == "calibrl_tenant_refusals_total" and sample.labels.get("reason") == "slowed":
                figures["revoked"] += sample.value
            elif (sample.name == "calibrl_rpc_server_duration_seconds_bucket"
                  and sample.labels.get("code") == "RESOURCE_EXHAUSTED"):
                if sample.labels.get("le") == "+Inf":
                    figures["shed"] += sample.value
                elif float(sample.labels.get("le", "0")) == 0.05:
                    figures["shed_within_50ms"] += sample.value
            elif sample.name == "calibrl_server_loop_lag_seconds_bucket":
                lag_buckets[sample.labels["le"]] = lag_buckets.get(sample.labels["le"], 0.0) + sample.value
    if "+Inf" in lag_buckets:
        total = lag_buckets["+Inf"]
        figures.update(loop_lag_samples=total, loop_lag_over_50ms=total - lag_buckets.get("0.05", 0.0),
                       loop_lag_over_250ms=total - lag_buckets.get("0.25", 0.0))
    return figures


def _busy_processes(count: int, seconds: float) -> list[subprocess.Popen]:
    """``count`` processes that spin on a core for ``seconds`` (other work on the machine)."""
    spin = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


# The overload's onset: 200 callers start at once, are shed together and come back after their
# pushback in a wave; a call that arrives with that wave waits behind it for the server to read it.
# The probes' shed times count from SETTLE_S into the phase; the onset's worst is reported beside them.
SETTLE_S = 5.0


async def overload(address: str, service: str, process: subprocess.Popen, callers: int, seconds: float,
                   deadline_s: float, busy: int = 0, metrics_port: int = 0) -> dict:
    """``callers`` concurrent callers (50 channels: each its own tenant without keys; one
    tenant with keys) for ``seconds``, each call with a ``deadline_s`` deadline; with
    ``busy`` processes spinning on the cores meanwhile."""
    import grpc

    rss_before = _rss_mib(process)
    server_before = _server_figures(metrics_port)
    load_before = round(os.getloadavg()[0], 2)
    spinners = _busy_processes(busy, seconds + 1)
    phase_start = time.time()  # the probes' sheds before phase_start + SETTLE_S are the onset's (see SETTLE_S)
    probe_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-probe-"))
    probe_out, high_out = probe_dir / "probe.json", probe_dir / "probe-high.json"
    prober = _start_probe(service, address, seconds - 5, probe_out)
    # A second probe at raised priority (nice -10, as root): its own wait for a core taken out, it times what
    # the server and the loopback transport take, as a client on another machine would see them.
    high = _start_probe(service, address, seconds - 5, high_out, nice=-10)
    codes: dict[str, int] = {}
    shed_ms: list[float] = []
    ok_ms: list[float] = []
    stop = asyncio.Event()
    channels = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(min(callers, 50))]
    stubs = [_stubs(c, c) for c in channels]

    async def caller(index: int) -> None:
        call = stubs[index % len(stubs)]["search" if service == "retrieval" else "judge"]
        i = 0
        while not stop.is_set():
            request = _overload_request(service, index, i)
            started = time.perf_counter()
            trailers: dict = {}
            try:
                await call(request, metadata=_key("crowd") if service == "retrieval" else [], timeout=deadline_s)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code, trailers = exc.code().name, dict(exc.trailing_metadata() or ())
            elapsed = (time.perf_counter() - started) * 1000
            codes[code] = codes.get(code, 0) + 1
            (shed_ms if code == "RESOURCE_EXHAUSTED" else ok_ms).append(elapsed)
            if code == "RESOURCE_EXHAUSTED":  # honour the pushback, as the trainer's clients do
                pushback = trailers.get("grpc-retry-pushback-ms", "200")
                await asyncio.sleep(int(pushback) / 1000)
            i += 1

    tasks = [asyncio.ensure_future(caller(i)) for i in range(callers)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    for spinner in spinners:
        spinner.wait()
    prober.wait()
    probe_record = json.loads(probe_out.read_text())
    probed = probe_record["calls"]
    settled = phase_start + SETTLE_S
    # shed at admission (the target's refusals); a call refused after admission because the server
    # slowed had waited in the queue first, and is reported apart
    probe_shed = [ms for code, ms, at, revoked in probed if code == "RESOURCE_EXHAUSTED" and at >= settled
                  and not revoked]
    onset_shed = [ms for code, ms, at, revoked in probed if code == "RESOURCE_EXHAUSTED" and at < settled
                  and not revoked]
    probe_revoked = [ms for code, ms, at, revoked in probed if revoked]
    high_shed: list[float] = []
    if high is not None:
        high.wait()
        high_shed = [ms for code, ms, at, revoked in json.loads(high_out.read_text())["calls"]
                     if code == "RESOURCE_EXHAUSTED" and at >= settled and not revoked]
    await asyncio.sleep(2.0)
    result = {"service": service, "callers": callers, "seconds": seconds, "deadline_s": deadline_s,
              "busy_processes": busy, "load1_before": load_before, "codes": codes,
              "client_deadline_exceeded": codes.get("DEADLINE_EXCEEDED", 0),
              **{f"server_{k}": v - server_before[k] for k, v in _server_figures(metrics_port).items()},
              "probe_connect_ms": round(probe_record["connect_ms"], 1),
              "probe_codes": {c: sum(1 for code, *_ in probed if code == c) for c in {code for code, *_ in probed}},
              "probe_revoked": len(probe_revoked),
              "probe_revoked_max_ms": round(max(probe_revoked), 1) if probe_revoked else None,
              "probe_onset_shed_max_ms": round(max(onset_shed), 1) if onset_shed else None,
              "probe_shed_p50_ms": round(_percentile(probe_shed, 0.5), 1) if probe_shed else None,
              "probe_shed_p99_ms": round(_percentile(probe_shed, 0.99), 1) if probe_shed else None,
              "probe_high_shed_p50_ms": round(_percentile(high_shed, 0.5), 1) if high_shed else None,
              "probe_high_shed_p99_ms": round(_percentile(high_shed, 0.99), 1) if high_shed else None,
              "shed_p99_ms": round(_percentile(shed_ms, 0.99), 1) if shed_ms else None,
              "shed_max_ms": round(max(shed_ms), 1) if shed_ms else None,
              "ok_p99_ms": round(_percentile(ok_ms, 0.99), 1) if ok_ms else None,
              "rss_mib_before": round(rss_before, 1), "rss_mib_after": round(_rss_mib(process), 1)}
    print(result, flush=True)
    return result



# --------------------------------------------------------------------------- work stops

def _quiet_from(samples: list[tuple[float, float]], window_s: float = 0.5, share: float = 0.1) -> float:
    """The first time from which the process used under ``share`` of a core for ``window_s``
    ((seconds, CPU seconds) samples)."""
    for i, (t, cpu) in enumerate(samples):
        j = next((j for j in range(i, len(samples)) if samples[j][0] - t >= window_s), None)
        if j is None:
            break
        if samples[j][1] - cpu < share * (samples[j][0] - t):
            return t
    return samples[-1][0]


async def work_stops(address: str, service: str, process: subprocess.Popen, calls: int = 16,
                     after_s: float = 1.5) -> dict:
    """``calls`` largest accepted requests at once (each its own connection: a tenant each
    without keys), all cancelled ``after_s`` later: how long the server's process keeps
    using the CPU after the cancel (psutil CPU time sampled every 20 ms; busy until the
    first half second in which it used under 10% of a core)."""
    import grpc
    import psutil

    _, kind, build = _requests()["search" if service == "retrieval" else "prose"]
    channels = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(calls)]
    stubs = [_stubs(c, c)[kind] for c in channels]
    meta = _key("flood") if service == "retrieval" else []
    _, n = await _largest_accepted(stubs[0], build, meta)
    server = psutil.Process(process.pid)
    await asyncio.sleep(1.0)
    pending = [stub(build(n, f"stop{i}"), metadata=meta, timeout=60) for i, stub in enumerate(stubs)]
    await asyncio.sleep(after_s)
    for call in pending:
        call.cancel()
    cancelled_at = time.perf_counter()
    samples = [(0.0, sum(server.cpu_times()[:2]))]
    while samples[-1][0] < 10.0:
        await asyncio.sleep(0.02)
        samples.append((time.perf_counter() - cancelled_at, sum(server.cpu_times()[:2])))
    last_busy = _quiet_from(samples)
    codes: dict[str, int] = {}
    for call in pending:
        try:
            await call
            code = "OK"
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "CANCELLED"
        codes[code] = codes.get(code, 0) + 1
    for channel in channels:
        await channel.close()
    result = {"service": service, "calls": calls, "items_each": n, "cancelled_after_s": after_s,
              "codes": codes,
              "server_busy_after_cancel_s": round(last_busy, 2), "load1": round(os.getloadavg()[0], 2)}
    print(result, flush=True)
    return result


# --------------------------------------------------------------------------- soak

async def soak(retrieval, judge, retrieval_address: str, judge_address: str, seconds: float, rate: float,
               warm_up_s: float, out: pathlib.Path | None) -> dict:
    """Mixed valid and invalid traffic at a steady, low rate (``rate`` calls per second over
    both services, one at a time on a fixed schedule) for ``seconds``; the servers' RSS every
    30 s, and its least-squares slope after ``warm_up_s``. Valid calls use new texts, so the
    result and embedding caches (started small by the caller) fill and then evict."""
    import grpc

    from calibrl.v1 import judge_pb2 as jpb
    from calibrl.v1 import retrieval_pb2 as pb

    codes: dict[str, dict[str, int]] = {}
    samples: list[dict] = []
    started = time.monotonic()
    mib = {"retrieval": lambda: _rss_mib(retrieval), "judge": lambda: _rss_mib(judge)}

    def search(n: int, **overrides) -> "pb.SearchRequest":
        fields = dict(queries=[f"{WORDS[(n + j) % len(WORDS)]} fee {n} {j}" for j in range(4)], top_k=10,
                      mode=pb.SEARCH_MODE_HYBRID)
        fields.update(overrides)
        return pb.SearchRequest(**fields)

    def score(n: int, **overrides) -> "jpb.ScoreRequest":
        fields = dict(rubric_id="bench", items=[jpb.JudgeItem(query=f"VTSAX expense ratio {n}",
                                                              output=f"VTSAX fee {n} {j} 0.04%") for j in range(4)])
        fields.update(overrides)
        return jpb.ScoreRequest(**fields)

    # (service, what, request builder, metadata, cancel after seconds or None)
    mix = [
        ("retrieval", "search", lambda n: search(n), _key("small"), None),
        ("judge", "score", lambda n: score(n), [], None),
        ("retrieval", "search", lambda n: search(n), _key("small"), None),
        ("retrieval", "empty query", lambda n: search(n, queries=["fee", " "]), _key("small"), None),
        ("judge", "score", lambda n: score(n), [], None),
        ("retrieval", "top_k 0", lambda n: search(n, top_k=0), _key("small"), None),
        ("judge", "unknown rubric", lambda n: score(n, rubric_id="nope"), [], None),
        ("retrieval", "query too long", lambda n: search(n, queries=["x" * 3000]), _key("small"), None),
        ("judge", "over budget", lambda n: score(n, items=[jpb.JudgeItem(query=_text(8000, str(n)),
                                                                           output=_text(8000, f"o{n}"))] * 40),
         [], None),
        ("retrieval", "wrong key", lambda n: search(n), [("x-api-key", "wrong")], None),
        ("retrieval", "cancelled", lambda n: search(n), _key("small"), 0.005),
        ("judge", "empty items", lambda n: score(n, items=[]), [], None),
        ("retrieval", "oversize 5 MiB", lambda n: search(n, queries=["y" * (5 << 20)]), _key("small"), None),
        ("judge", "score", lambda n: score(n), [], None),
    ]
    async with grpc.aio.insecure_channel(retrieval_address) as rc, grpc.aio.insecure_channel(judge_address) as jc:
        calls = _stubs(rc, jc)
        n = 0
        next_sample = started
        while time.monotonic() - started < seconds:
            now = time.monotonic()
            if now >= next_sample:
                samples.append({"t_s": round(now - started, 1), **{k: round(f(), 2) for k, f in mib.items()},
                                "load1": round(os.getloadavg()[0], 2)})
                next_sample += 30.0
                if out is not None:
                    out.write_text(json.dumps({"samples": samples, "codes": codes}, indent=1))
            service, what, build, metadata, cancel_after = mix[n % len(mix)]
            call = calls["judge" if service == "judge" else "search"](build(n), metadata=metadata, timeout=30)
            try:
                if cancel_after is not None:
                    await asyncio.sleep(cancel_after)
                    call.cancel()
                await call
                code = "OK"
            except asyncio.CancelledError:
                code = "CANCELLED"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
            row = codes.setdefault(f"{service} {what}", {})
            row[code] = row.get(code, 0) + 1
            n += 1
            await asyncio.sleep(max(0.0, started + n / rate - time.monotonic()))
    result = {"seconds": seconds, "rate_per_s": rate, "calls": n, "warm_up_s": warm_up_s, "codes": codes,
              "samples": samples}
    for service in ("retrieval", "judge"):
        points = [(s["t_s"] / 60, s[service]) for s in samples if s["t_s"] >= warm_up_s]
        if len(points) >= 3:
            mx = sum(x for x, _ in points) / len(points)
            my = sum(y for _, y in points) / len(points)
            slope = (sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points))
            result[f"{service}_rss_slope_mib_per_min"] = round(slope, 3)
            result[f"{service}_rss_mib_after_warm_up"] = [points[0][1], points[-1][1]]
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
    print({k: v for k, v in result.items() if k != "samples"}, flush=True)
    return result


# --------------------------------------------------------------------------- record

SOAK_SLOPE_TARGET_MIB_PER_MIN = 0.5  # the target for the RSS slope after warm-up


def soak_tables(result: dict, every_s: float = 300.0) -> tuple[list[dict], list[str]]:
    """The soak's tables (RSS every ``every_s`` seconds, the codes per call kind, the slopes)
    and its verdict lines."""
    from bench_record import table, verdict

    samples, shown, next_t = result["samples"], [], 0.0
    for sample in samples:
        if sample["t_s"] >= next_t or sample is samples[-1]:
            shown.append([f"{sample['t_s'] / 60:.1f}", f"{sample['retrieval']:.1f}", f"{sample['judge']:.1f}",
                          f"{sample['load1']:.2f}"])
            next_t = (sample["t_s"] // every_s + 1) * every_s
    rss = table(f"Soak: server RSS (MiB) every {every_s / 60:.0f} min of a {result['seconds'] / 60:.0f}-minute run "
                f"at {result['rate_per_s']:g} calls/s ({result['calls']} calls)",
                ["minute", "retrieval RSS MiB", "judge RSS MiB", "load (1 min)"], shown)
    codes = sorted({code for row in result["codes"].values() for code in row})
    calls = table("Soak: answers per call kind", ["call", *codes],
                  [[what, *(result["codes"][what].get(code, 0) for code in codes)] for what in sorted(result["codes"])])
    slope_rows, notes = [], []
    for service in ("retrieval", "judge"):
        slope = result.get(f"{service}_rss_slope_mib_per_min")
        if slope is None:
            continue
        first, last = result[f"{service}_rss_mib_after_warm_up"]
        met = abs(slope) < SOAK_SLOPE_TARGET_MIB_PER_MIN
        slope_rows.append([service, f"{first:.1f}", f"{last:.1f}", f"{slope:+.3f}",
                           f"< {SOAK_SLOPE_TARGET_MIB_PER_MIN}: {verdict(met)}"])
        notes.append(f"{service}: RSS slope after {result['warm_up_s'] / 60:.0f} min of warm-up {slope:+.3f} MiB/min "
                     f"({'meets' if met else 'misses'} the < {SOAK_SLOPE_TARGET_MIB_PER_MIN} MiB/min target)")
    slopes = table(f"Soak: least-squares RSS slope after {result['warm_up_s'] / 60:.0f} min of warm-up",
                   ["server", "RSS MiB after warm-up", "RSS MiB at the end", "slope MiB/min", "target"], slope_rows)
    return [slopes, rss, calls], notes


SMALL_P99_RATIO_TARGET = 3.0  # a small tenant's p99 beside a flood and a canceller, over its p99 alone
JAIN_TARGET = 0.95
WEIGHT_TOLERANCE = 0.10
SHED_MS_TARGET = 50.0
RSS_GROWTH_TARGET = 0.10
WORST_S_TARGET = 1.0
WORST_S_SLACK = 1.2  # "about 1 s": the cost model is an estimate


def record_tables(results: dict) -> tuple[list[dict], list[str]]:
    """The record's tables and verdict lines (each computed against the issue's target) for the
    sections that ran."""
    from bench_record import cell, rows_table, verdict

    tables: list[dict] = []
    notes: list[str] = []
    if "calibrate" in results:
        tables.append(rows_table("Cost model constants: per-unit costs, one torch thread, best of several repeats",
                                 results["calibrate"]))
    if "worst" in results:
        rows = results["worst"]
        tables.append(rows_table("Worst accepted request: the largest prefix the default budgets accept (from the "
                                 "calibrl-max-items trailer), new texts each time, seconds min-max of the repeats",
                                 rows))
        worst_s = max(row["seconds_max"] for row in rows)
        notes.append(f"worst accepted request: {worst_s:.2f} s at most (target <= ~{WORST_S_TARGET:g} s, read as "
                     f"<= {WORST_S_TARGET * WORST_S_SLACK:g} s): {verdict(worst_s <= WORST_S_TARGET * WORST_S_SLACK)}")
    if "small" in results:
        phases = [row for row in results["small"] if row.get("repeat") != "all"]
        pooled = [row for row in results["small"] if row.get("repeat") == "all"]
        tables.append(rows_table("A small tenant's one-item calls, one at a time, alone, then beside a tenant "
                                 "flooding with the largest accepted request and one that sends it and cancels 50 ms "
                                 "later (phases interleaved; load1 at the start of each pair)", phases))
        tables.append(rows_table("The small tenant's phases pooled per service", pooled,
                                 drop=("repeat", "small tenant")))
        for row in pooled:
            notes.append(f"{row['service']}: small tenant's pooled p99 beside flood + canceller "
                         f"{row['p99_ratio']:.2f}x its p99 alone (target <= {SMALL_P99_RATIO_TARGET:g}x): "
                         f"{verdict(row['p99_ratio'] <= SMALL_P99_RATIO_TARGET)}")
    for key, what in (("fair_equal", "four equal-weight tenants"), ("fair_weighted", "weights 1 : 2 : 4")):
        if key not in results:
            continue
        fair = results[key]
        rows = [{"tenant": name, **figures} for name, figures in fair["tenants"].items()]
        first = rows[0]
        for row in rows:
            row["served per weight, ratio to the first"] = round(
                (row["served_cost_s"] / row["weight"]) / (first["served_cost_s"] / first["weight"]), 3)
        tables.append(rows_table(f"Fair shares, {what}: estimated served cost in the window, Jain's index of "
                                 f"served cost per weight {fair['jain_of_served_per_weight']}", rows))
        ratios = [row["served per weight, ratio to the first"] for row in rows]
        if key == "fair_equal":
            notes.append(f"fair shares, equal weights: Jain's index {fair['jain_of_served_per_weight']} (target >= "
                         f"{JAIN_TARGET}): {verdict(fair['jain_of_served_per_weight'] >= JAIN_TARGET)}")
        else:
            worst_off = max(abs(r - 1.0) for r in ratios)
            notes.append(f"fair shares, weights 1 : 2 : 4: served per weight within {worst_off:.1%} of equal (target "
                         f"within {WEIGHT_TOLERANCE:.0%}): {verdict(worst_off <= WEIGHT_TOLERANCE)}")
    if "overload" in results:
        rows = results["overload"]
        first = rows[0]
        servers = "; ".join(f"{name} server run with `{extra}`"
                            for name, extra in results.get("server_args", {}).items() if extra)
        tables.append(rows_table(f"Overload: {first['callers']} concurrent callers for {first['seconds']:g} s, "
                                 f"{first['deadline_s']:g} s deadlines (server_* figures from the server's "
                                 "Prometheus page; probe_*: a separate process's calls during the phase"
                                 + (f"; {servers}" if servers else "") + ")", rows,
                                 drop=("callers", "seconds", "deadline_s", "shed_max_ms")))
        for row in rows:
            late = row.get("server_missed")
            shed_server = row.get("server_shed") or 0
            fast = (row.get("server_shed_within_50ms") or 0) / shed_server if shed_server else None
            growth = row["rss_mib_after"] / row["rss_mib_before"] - 1.0
            shed = row.get("probe_shed_p99_ms")
            high = row.get("probe_high_shed_p99_ms")
            notes.append(f"{row['service']}, {row['callers']} callers, {row['busy_processes']} busy processes: "
                         f"admitted calls that missed their deadline (server) {cell(late)}; admitted calls "
                         f"refused with pushback when the server slowed (server) {cell(row.get('server_revoked'))}; "
                         f"client-seen "
                         f"DEADLINE_EXCEEDED {row['client_deadline_exceeded']}; shed calls answered within 50 ms "
                         f"(server) {'-' if fast is None else f'{fast:.1%}'}; shed p99 (probe process) "
                         f"{cell(shed)} ms (target < {SHED_MS_TARGET:g}: "
                         f"{verdict(shed is not None and shed < SHED_MS_TARGET)}); shed p99 (probe process at "
                         f"nice -10) {cell(high)} ms (target < {SHED_MS_TARGET:g}: "
                         f"{verdict(high is not None and high < SHED_MS_TARGET)}); RSS {growth:+.1%} (target within "
                         f"{RSS_GROWTH_TARGET:.0%}: {verdict(abs(growth) <= RSS_GROWTH_TARGET)})"
                         + (f"; the server's event loop ran {int(row.get('server_loop_lag_over_50ms') or 0)} of its "
                            f"{int(row['server_loop_lag_samples'])} 10 ms timers more than 50 ms late "
                            f"({int(row.get('server_loop_lag_over_250ms') or 0)} more than 250 ms)"
                            if row.get("server_loop_lag_samples") else ""))
    if "stops" in results:
        tables.append(rows_table("Work stops when nobody waits: calls cancelled mid-work, then the server's CPU "
                                 "sampled until quiet", results["stops"]))
        for row in results["stops"]:
            notes.append(f"{row['service']}: server busy {row['server_busy_after_cancel_s']} s after the cancel "
                         f"(target < 0.5 s): {verdict(row['server_busy_after_cancel_s'] < 0.5)}")
    if "soak" in results:
        soaked, soak_notes = soak_tables(results["soak"])
        tables += soaked
        notes += soak_notes
    return tables, notes


# --------------------------------------------------------------------------- main

def _prepare(work: pathlib.Path) -> pathlib.Path:
    from calibrl.demo.domain import generate_domain
    from calibrl.retrieval_server.index import build_index_from_dicts

    index = work / "index"
    if not (index / "manifest.json").exists():
        records = [{"_id": p.doc_id, "title": p.title, "text": p.text} for p in generate_domain(0).passages]
        build_index_from_dicts(records, index, device="cpu", show_progress=False)
    lines = ["tenants:"] + [f"  - {{name: {t}, key_sha256: {hashlib.sha256(f'bench-{t}'.encode()).hexdigest()}, "
                            f"weight: {w}}}" for t, w in TENANTS.items()]
    (work / "keys.yaml").write_text("\n".join(lines) + "\n")
    (work / "rubrics").mkdir(exist_ok=True)
    (work / "rubrics" / "bench.yaml").write_text(RUBRIC)
    return index


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:  # the overload's probe process (see probe())
        service, address, seconds, out = sys.argv[2].split(",")
        asyncio.run(probe(service, address, float(seconds), pathlib.Path(out)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each timed phase")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved alone/loaded phase pairs (small)")
    parser.add_argument("--callers", type=int, default=200, help="concurrent callers of the overload phase")
    parser.add_argument("--overload-seconds", type=float, default=60.0, help="length of the overload phase")
    parser.add_argument("--busy", type=int, default=2,
                        help="overload again with this many processes spinning on the cores (0: not)")
    parser.add_argument("--services", default="retrieval,judge", help="services of the overload phases")
    parser.add_argument("--overload-busy", default="",
                        help="busy-process counts of the overload phases (default: 0 and --busy)")
    parser.add_argument("--deadline", type=float, default=5.0, help="deadline of each overload call, seconds")
    parser.add_argument("--retrieval-args", default="", help="extra key=value overrides of the retrieval server")
    parser.add_argument("--judge-args", default="", help="extra key=value overrides of the judge server")
    parser.add_argument("--query-chars", type=int, default=2048, help="query length of the largest retrieval requests")
    parser.add_argument("--judge-chars", type=int, default=8000, help="text length of the largest judge requests")
    parser.add_argument("--only", default="", help="sections: calibrate, worst, small, fair, overload, stops, "
                                                    "soak (stops and soak only when named)")
    parser.add_argument("--soak-seconds", type=float, default=3600.0, help="length of the soak")
    parser.add_argument("--soak-rate", type=float, default=4.0, help="calls per second of the soak")
    parser.add_argument("--soak-warm-up", type=float, default=600.0, help="seconds of the soak before the slope")
    parser.add_argument("--soak-cache", type=int, default=2000,
                        help="result and embedding cache sizes of the soak's servers (small, so they fill)")
    parser.add_argument("--workdir", default="", help="folder for the index and logs (default: a temp folder)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the tables of the sections run as a JSON record (benchmarks/records/"
                             "NAME.json: README block bench-NAME, rendered by scripts/render_results.py)")
    args = parser.parse_args()
    SIZES.update(query=args.query_chars, judge=args.judge_chars)
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="bench-tenants-"))
    work.mkdir(parents=True, exist_ok=True)
    index = _prepare(work)
    only = set(filter(None, args.only.split(","))) or {"calibrate", "worst", "small", "fair", "overload"}
    results: dict = {"server_args": {"retrieval": args.retrieval_args.strip(), "judge": args.judge_args.strip()}}
    if "calibrate" in only:
        results["calibrate"] = calibrate(work)
    if only - {"calibrate"}:
        results.update(asyncio.run(_served(args, work, index, only)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    if args.record:
        from bench_record import write_record

        tables, notes = record_tables(results)
        write_record(args.record, tables, libraries=("grpcio", "torch", "onnxruntime", "faiss-cpu"), notes=notes)


async def _served(args, work: pathlib.Path, index: pathlib.Path, only: set[str]) -> dict:
    soaking = "soak" in only  # small caches that fill; otherwise no result cache (every call is work)
    caches = ([f"embedding_cache_size={args.soak_cache}"],
              [f"judge.cache_size={args.soak_cache}", f"judge.embedder_cache_size={args.soak_cache}"]) \
        if soaking else ([], ["judge.cache_size=0"])
    ports = {"retrieval": _free_port(), "judge": _free_port()}  # their Prometheus pages (overload reads them)
    metrics = {name: ["serving.telemetry.enabled=true", f"serving.telemetry.prometheus_port={port}"]
               for name, port in ports.items()}
    retrieval, retrieval_address = _start(
        ["serve", "retrieval", "--index", str(index), "--port", "0", "device=cpu", "torch_threads=1",
         f"serving.api_keys_file={work / 'keys.yaml'}", *caches[0], *metrics["retrieval"],
         *args.retrieval_args.split()], work / "retrieval.log")
    judge, judge_address = _start(["serve", "judge", "--rubrics", str(work / "rubrics"), "--port", "0",
                                   "--allow-unvalidated", *caches[1], *metrics["judge"], *args.judge_args.split()],
                                  work / "judge.log")
    results: dict = {}
    try:
        if "worst" in only:
            results["worst"] = await worst(retrieval_address, judge_address)
        if "small" in only:
            results["small"] = (await small_tenant(retrieval_address, "retrieval", args.seconds, args.repeats)
                                + await small_tenant(judge_address, "judge", args.seconds, args.repeats))
        if "fair" in only:
            keys = work / "keys.yaml"
            results["fair_equal"] = await fair_shares(index, keys, {t: 1 for t in ("t1", "t2", "t3", "t4")},
                                                      args.seconds)
            results["fair_weighted"] = await fair_shares(index, keys, {"w1": 1, "w2": 2, "w4": 4}, args.seconds)
        if "overload" in only:
            results["overload"] = []
            counts = sorted({int(n) for n in args.overload_busy.split(",")} if args.overload_busy else {0, args.busy})
            servers = {"retrieval": (retrieval_address, retrieval), "judge": (judge_address, judge)}
            for busy in counts:
                for service in args.services.split(","):
                    address, process = servers[service]
                    results["overload"].append(await overload(address, service, process, args.callers,
                                                              args.overload_seconds, args.deadline, busy,
                                                              ports[service]))
        if "stops" in only:
            results["stops"] = [await work_stops(retrieval_address, "retrieval", retrieval),
                                await work_stops(judge_address, "judge", judge)]
        if soaking:
            results["soak"] = await soak(retrieval, judge, retrieval_address, judge_address, args.soak_seconds,
                                         args.soak_rate, args.soak_warm_up,
                                         pathlib.Path(args.json + ".partial") if args.json else None)
    finally:
        for process in (retrieval, judge):
            process.terminate()
            process.wait(timeout=60)
    return results


if __name__ == "__main__":
    main()
