"""Swap a rubric's version on a judge that two trainer-like callers are using (issue 30).

Starts a real `calibrl serve judge` process on loopback (API keys for two tenants, a
programmatic rubric with the MiniLM embedder, result cache off, the rubric folder polled
every `--poll` seconds) and runs two trainer-like tenants against it: each keeps
`--concurrency` calls of `--items` fresh items in flight through the trainer's own client
(`GrpcJudgeClient`: a deadline per attempt, retries with backoff), asking for the rubric by id
(its current version); a call fails when the client gives up. Then `--swaps` cycles: a steady
window of `--seconds` ("before"), a new validated version published into the folder
(validation record first, then the rubric file by an atomic rename), and the "swap" window
from the publication until `--after` seconds after the first response scored by the new
version. Each before/swap pair is adjacent, so the two are compared under the same machine
load. With `--control`, odd cycles publish the same content again instead (the poller rereads
the file, nothing changes): their ratio is the noise of the comparison itself.

Targets: zero failed calls; p99 latency during the swaps within 2x of before.

    python benchmarks/bench_rubric_swap.py [--swaps 12] [--seconds 10] [--after 2] [--control] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_abuse import _start  # noqa: E402 (one way to start a served process, same folder)

TENANTS = ("trainer-a", "trainer-b")
MODEL_ID = "programmatic[minilm-l6-v2]"
WORDS = ("fund expense ratio annual fee account eligibility manager contribution limit tax VTSAX FZROX "
         "index bond yield dividend minimum transfer rollover 2024 Roth IRA").split()


def _rubric(k: int) -> str:
    """Version ``k`` of the bench rubric (each k different content, so a different hash)."""
    intent = 0.5 + 0.01 * k
    return ("id: bench\n"
            f"version: '{k}'\n"
            "tenants: ['*']\n"
            "criteria:\n"
            f"  - {{name: intent, kind: programmatic, scorer: intent_similarity, weight: {intent:.2f}}}\n"
            "  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.3}\n"
            "  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.2}\n"
            "  - {name: invented, kind: programmatic, scorer: invented_entities, weight: 0.5, penalty: true}\n")


def _publish(folder: pathlib.Path, k: int) -> str:
    from calibrl.judge_server.rubric import parse_rubric
    from calibrl.judge_server.authoring.validation import ValidationRecord, validation_path, write_record

    path = folder / "bench.yaml"
    text = _rubric(k)
    rubric = parse_rubric(text, str(path), folder)
    write_record(validation_path(path), ValidationRecord(
        rubric_id="bench", rubric_hash=rubric.hash, model_id=MODEL_ID, passed=True, kappa=0.8, min_kappa=0.6,
        pass_threshold=0.6, n_items=30, golden_sha256="0" * 64,
        reason="benchmark record (the swap is measured, not the rubric's agreement)"))
    staged = folder / "bench.yaml.next"
    staged.write_text(text)
    staged.replace(path)
    return rubric.hash


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _item(rng: random.Random):
    from calibrl.api.judge import JudgeItem

    query = " ".join(rng.choice(WORDS) for _ in range(6))
    output = " ".join(rng.choice(WORDS) for _ in range(9))
    return JudgeItem.make(query, output)


async def run(args: argparse.Namespace, work: pathlib.Path) -> dict:
    from calibrl.errors import CalibrlError
    from calibrl.trainer.grpc_clients import GrpcJudgeClient

    folder = work / "rubrics"
    folder.mkdir()
    _publish(folder, 0)
    keys = work / "keys.yaml"
    keys.write_text("tenants:\n" + "".join(
        f"  - {{name: {t}, key_sha256: {hashlib.sha256(f'bench-{t}'.encode()).hexdigest()}}}\n" for t in TENANTS))
    process, address = _start(["serve", "judge", "--rubrics", str(folder), "--port", "0", "judge.cache_size=0",
                               f"serving.api_keys_file={keys}", f"rubric_poll_s={args.poll}",
                               f"rubric_retention_s={args.retention}", *args.server_args.split()],
                              work / "judge.log")
    calls: list[dict] = []  # one per finished call: tenant, start, end, ok, hash, code
    phase = {"name": "warmup"}
    stop = asyncio.Event()
    try:
        clients = [GrpcJudgeClient(address, metadata=[("x-api-key", f"bench-{t}")], timeout_s=args.timeout,
                                   max_batch_size=args.items) for t in TENANTS]

        async def caller(n: int, seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                items = [_item(rng) for _ in range(args.items)]
                start, name = time.perf_counter(), phase["name"]
                try:
                    scores = await clients[n].score("bench", items)
                    calls.append({"tenant": TENANTS[n], "phase": name, "seconds": time.perf_counter() - start,
                                  "ok": True, "hash": scores[0].rubric_hash,
                                  "mixed": len({s.rubric_hash for s in scores}) > 1})
                except CalibrlError as exc:  # what a trainer would see: the retries are spent
                    calls.append({"tenant": TENANTS[n], "phase": name, "seconds": time.perf_counter() - start,
                                  "ok": False, "error": f"{type(exc).__name__}: {exc}"})

        tasks = [asyncio.create_task(caller(n, 1000 * n + c)) for n in range(len(TENANTS))
                 for c in range(args.concurrency)]
        await asyncio.sleep(args.warmup)
        load_start = os.getloadavg()
        swaps = []
        version = 0
        for k in range(1, args.swaps + 1):
            control = args.control and k % 2 == 1
            phase["name"] = f"before-{k}"
            await asyncio.sleep(args.seconds)
            phase["name"] = f"{'control' if control else 'swap'}-{k}"
            published = time.perf_counter()
            if control:  # the file rewritten with the same content: the poller rereads it, nothing changes
                _publish(folder, version)
                await asyncio.sleep(args.control_wait + args.after)
                swaps.append({"swap": k, "control": True})
                continue
            version += 1
            new_hash = _publish(folder, version)
            while not any(c.get("hash") == new_hash for c in calls[-50:]):
                if time.perf_counter() - published > 30:
                    raise SystemExit(f"swap {k}: no response scored by the new version within 30 s; see "
                                     f"{work / 'judge.log'}")
                await asyncio.sleep(0.01)
            first_new = time.perf_counter() - published
            await asyncio.sleep(args.after)
            swaps.append({"swap": k, "control": False, "hash": new_hash, "first_new_response_s": round(first_new, 3)})
        phase["name"] = "done"
        stop.set()
        await asyncio.gather(*tasks)
        load_end = os.getloadavg()
        for client in clients:
            await client.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    return _summary(args, calls, swaps, load_start, load_end)


def _summary(args, calls, swaps, load_start, load_end) -> dict:
    def stats(selected):
        ok = [c["seconds"] * 1000 for c in selected if c["ok"]]
        return {"calls": len(selected), "failed": sum(not c["ok"] for c in selected),
                "p50_ms": round(_percentile(ok, 0.5), 1), "p99_ms": round(_percentile(ok, 0.99), 1),
                "max_ms": round(max(ok), 1) if ok else None}

    swap_cycles = {s["swap"] for s in swaps if not s["control"]}
    control_cycles = {s["swap"] for s in swaps if s["control"]}
    cycle = lambda c: int(c["phase"].rsplit("-", 1)[1]) if "-" in c["phase"] else -1  # noqa: E731
    before = [c for c in calls if c["phase"].startswith("before-") and cycle(c) in swap_cycles]
    during = [c for c in calls if c["phase"].startswith("swap-")]
    control_before = [c for c in calls if c["phase"].startswith("before-") and cycle(c) in control_cycles]
    control = [c for c in calls if c["phase"].startswith("control-")]
    per_swap = []
    for s in swaps:
        b = stats([c for c in calls if c["phase"] == f"before-{s['swap']}"])
        d = stats([c for c in calls if c["phase"] in (f"swap-{s['swap']}", f"control-{s['swap']}")])
        per_swap.append({**s, "before_window": b, "swap_window": d})
    summary = {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "load_average_start": [round(x, 2) for x in load_start], "load_average_end": [round(x, 2) for x in load_end],
        "before": stats(before), "swap": stats(during),
        "control_before": stats(control_before), "control": stats(control),
        "failed_total": sum(not c["ok"] for c in calls),
        "calls_scored_by_two_versions": sum(bool(c.get("mixed")) for c in calls),
        "failures": [c for c in calls if not c["ok"]][:10],
        "per_swap": per_swap,
        "slowest": sorted(({"phase": c["phase"], "tenant": c["tenant"], "ms": round(c["seconds"] * 1000, 1),
                            "version": c.get("hash", "")[:12]} for c in calls if c["ok"]),
                          key=lambda c: -c["ms"])[:10],
        "by_tenant": {t: {"before": stats([c for c in before if c["tenant"] == t]),
                          "swap": stats([c for c in during if c["tenant"] == t])} for t in TENANTS},
    }
    summary["p99_ratio"] = round(summary["swap"]["p99_ms"] / summary["before"]["p99_ms"], 3)
    if control:
        summary["control_p99_ratio"] = round(summary["control"]["p99_ms"] / summary["control_before"]["p99_ms"], 3)
    for kind in ("swap", "control"):
        ratios = sorted(p["swap_window"]["p99_ms"] / p["before_window"]["p99_ms"] for p in per_swap
                        if p["control"] == (kind == "control") and p["swap_window"]["calls"]
                        and p["before_window"]["calls"])
        summary[f"per_{kind}_p99_ratio_median"] = round(ratios[len(ratios) // 2], 3) if ratios else None
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0, help="steady window before each swap")
    parser.add_argument("--after", type=float, default=2.0, help="seconds of the swap window after the first new score")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--items", type=int, default=16, help="items per Score call (a trainer's rollout group)")
    parser.add_argument("--concurrency", type=int, default=2, help="calls in flight per tenant")
    parser.add_argument("--poll", type=float, default=1.0, help="the server's rubric_poll_s")
    parser.add_argument("--retention", type=float, default=600.0, help="the server's rubric_retention_s")
    parser.add_argument("--server-args", default="torch_threads=1",
                        help="more key=value settings of the judge server (torch_threads=1)")
    parser.add_argument("--control", action="store_true",
                        help="odd cycles publish the same content again (A/A: the windowing's noise under this load)")
    parser.add_argument("--control-wait", type=float, default=1.7,
                        help="control window before --after (about the time a real swap takes to show)")
    parser.add_argument("--timeout", type=float, default=30.0, help="the clients' deadline per attempt (s)")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the table as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME, rendered by scripts/render_results.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir or None) as tmp:
        summary = asyncio.run(run(args, pathlib.Path(tmp)))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    if args.record:
        from bench_record import write_record

        tables, notes = record_tables(summary)
        write_record(args.record, tables, libraries=("grpcio", "torch", "onnxruntime"), notes=notes)


P99_RATIO_TARGET = 2.0  # p99 during a swap over the steady windows' p99


def record_tables(summary: dict) -> tuple[list[dict], list[str]]:
    """The record's table (steady and swap windows, and the A/A control's) and its verdict lines."""
    from bench_record import table, verdict

    def row(name: str, stats: dict, ratio: float | None = None) -> list[str]:
        return [name, str(stats["calls"]), str(stats["failed"]), f"{stats['p50_ms']:,.1f} ms",
                f"{stats['p99_ms']:,.1f} ms", "" if ratio is None else f"{ratio:.2f}"]

    swaps = sum(not s["control"] for s in summary["per_swap"])
    controls = sum(s["control"] for s in summary["per_swap"])
    rows = [row(f"steady, ahead of the {swaps} swaps", summary["before"]),
            row(f"during the {swaps} swaps", summary["swap"], summary["p99_ratio"])]
    if controls:
        rows += [row(f"steady, ahead of the {controls} controls", summary["control_before"]),
                 row(f"during the {controls} controls", summary["control"], summary["control_p99_ratio"])]
    first_new = [s["first_new_response_s"] for s in summary["per_swap"] if not s["control"]]
    start, end = summary["load_average_start"], summary["load_average_end"]
    title = (f"Calls of two tenants through the trainer's judge client while rubric versions are published "
             f"(first response scored by the new version {min(first_new):.1f}-{max(first_new):.1f} s after "
             f"publication; load average {start[0]:.2f} at the start, {end[0]:.2f} at the end)")
    header = ["windows", "calls", "failed", "p50", "p99", "p99 / its steady windows' p99"]
    notes = [f"failed calls: {summary['failed_total']} (target 0): {verdict(summary['failed_total'] == 0)}; "
             f"calls scored by two versions: {summary['calls_scored_by_two_versions']}",
             f"p99 during the swaps {summary['p99_ratio']:.2f}x the steady windows' (target <= {P99_RATIO_TARGET:g}x): "
             f"{verdict(summary['p99_ratio'] <= P99_RATIO_TARGET)}"
             + (f"; A/A control {summary['control_p99_ratio']:.2f}x; medians of the per-cycle ratios: swaps "
                f"{summary['per_swap_p99_ratio_median']}, controls {summary['per_control_p99_ratio_median']}"
                if controls else "")]
    return [table(title, header, rows)], notes


if __name__ == "__main__":
    main()
