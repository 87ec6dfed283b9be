"""Judge throughput: item x criterion scores per second.

Compares, on the same items and LLM criteria, with a judge model built here (nothing
downloaded): by default a tiny causal LM trained by ``calibrl rubric train-judge``'s core
on synthetic SME feedback (``calibrl.testing.synthetic_feedback``: a rubric distilled
with LLM criteria only, plus a 1-5 "quality" question learnt from the grades), so it
answers for real; ``--judge-model random`` keeps the untrained, randomly initialised model.
Paths:

- logprob scoring with the shared-prefix KV cache (``prefix_cache``, the default: the
  criterion suffixes packed into one row behind the prefix, through the pruned forward
  of ``judge_server/backends/pruned_forward.py`` for Llama/Qwen2 models),
- the same building every item's suffix mask anew (``logprob_prefix_cache_fresh_masks``:
  the pruned forward before one mask per call served as views; scores bitwise equal),
- the same through transformers' own forward (``logprob_prefix_cache_transformers``: the
  default before the pruned forward, and still the path of other model types),
- the same with one cache row per criterion (``logprob_prefix_cache_rows``: the path for
  attention kernels without 4D masks, and the default before the packing),
- logprob scoring with every item x criterion prompt in one flat left-padded batch,
- generate-and-parse (greedy, ``max_new_tokens`` tokens, then parse), with its
  parse-failure rate (logprob scoring cannot fail to parse),

then the programmatic rubric (MiniLM intent similarity and the rule-based criteria),
and cache hits, in process and over gRPC on loopback. The bench items are new records
(another seed), never trained on; for a trained judge the script also prints how often
its logprob answers agree with the SME tags and grades of those items.

    python benchmarks/bench_judge.py                      # tiny trained model, CPU
    python benchmarks/bench_judge.py --judge-model random
    python benchmarks/bench_judge.py --hidden 256 --layers 4 --items 64
    python benchmarks/bench_judge.py --device cuda --items 256

Figures are noisy on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LLM_RUBRIC = """\
id: bench-llm
version: "1"
criteria:
  - {name: intent, kind: llm, weight: 1.0, question: "Does the output keep the intent of the user's query?"}
  - {name: entities, kind: llm, weight: 1.0, question: "Does the output keep every key entity of the query?"}
  - {name: specific, kind: llm, weight: 1.0, question: "Is the output specific enough to retrieve the right documents?"}
  - {name: invented, kind: llm, weight: 0.5, penalty: true, good_answer: "no",
     question: "Does the output mention an entity that appears neither in the query nor in the documents?"}
  - {name: quality, kind: llm, weight: 1.0, scale: likert_1_5, question: "How good is the rewrite as a search query?"}
"""
PROGRAMMATIC_RUBRIC = """\
id: bench-programmatic
version: "1"
criteria:
  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.3}
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.4}
  - {name: specificity, kind: programmatic, scorer: specificity, weight: 0.3}
  - {name: no_invented, kind: programmatic, scorer: invented_entities, weight: 0.5, penalty: true}
  - {name: no_leak, kind: programmatic, scorer: compliance_leak, weight: 1.0, penalty: true}
"""


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and process-CPU time of ``repeats`` calls after one warm-up call, and the
    last result."""
    [(wall, cpu, result)] = interleaved({"only": fn}, repeats).values()
    return wall, cpu, result


def interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float, object]]:
    """Like :func:`timed` for several paths, run in turn in each round, so that a change
    of load on a shared machine hits every path alike. CPU time (``time.process_time``,
    all threads of this process) is what one path costs whatever else runs."""
    results = {name: fn() for name, fn in fns.items()}
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name]), results[name]) for name in fns}


def row(n_scores: int, wall: float, cpu: float, parse_failures: float = 0.0, **extra) -> dict:
    return {"seconds": wall, "cpu_seconds": cpu, "scores_per_s": n_scores / wall,
            "scores_per_cpu_s": n_scores / cpu if cpu > 0 else float("inf"), "parse_failures": parse_failures,
            **extra}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=48, help="hidden size of the random judge model")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--items-per-forward", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--judge-model", choices=("trained", "random"), default="trained",
                        help="train the judge on synthetic SME feedback first (default), or keep it random")
    parser.add_argument("--train-records", type=int, default=160, help="synthetic SME records (30%% held out)")
    parser.add_argument("--train-epochs", type=int, default=3)
    parser.add_argument("--train-lr", type=float, default=3e-3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the table as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME, rendered by scripts/render_results.py)")
    args = parser.parse_args()

    import torch

    from calibrl.judge_server.backends.pruned_forward import unsupported_reason
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.judge import Judge, load_llm
    from calibrl.judge_server.rubric import parse_rubric
    from calibrl.testing import build_tiny_causal_lm, synthetic_feedback

    if args.threads:
        torch.set_num_threads(args.threads)
    bench_records = synthetic_feedback(args.items, seed=42)
    items = [r.to_item() for r in bench_records]
    workdir = tempfile.mkdtemp(prefix="bench-judge-")
    folder = build_tiny_causal_lm(f"{workdir}/base", hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=max(2, args.hidden // 16), seed=0)
    training = None
    if args.judge_model == "trained":
        started = time.perf_counter()
        llm_rubric, folder, training = _train_judge(folder, workdir, args)
        training["seconds"] = time.perf_counter() - started
    else:
        llm_rubric = parse_rubric(LLM_RUBRIC)
    n_scores = len(items) * len(llm_rubric.llm_criteria)
    results: dict[str, dict] = {}

    def llm_config(mode: str) -> JudgeConfig:
        return JudgeConfig(backend=f"transformers:{folder}", device=args.device, llm_mode=mode, cache_size=0,
                           max_items_per_forward=args.items_per_forward, max_new_tokens=args.max_new_tokens,
                           embedder="hashed-ngrams", allow_unvalidated=True)

    backend = load_llm(llm_config("prefix_cache"))
    encoded = backend.encoder.encode(items, llm_rubric.llm_criteria, llm_rubric.instructions)
    prefix_tokens = statistics.mean(len(p) for p in encoded.prefix_ids)
    suffix_tokens = statistics.mean(len(s) for s in encoded.suffix_ids)
    n_params = sum(p.numel() for p in backend.model.parameters())

    packs, pruned = backend.packs_suffixes, backend.pruned

    def logprob(mode: str, packed: bool = True, prune: bool = True):
        def run():
            backend.mode, backend.packs_suffixes = mode, packs and packed
            backend.pruned = pruned if prune and packed else None
            return backend.score(items, llm_rubric.llm_criteria, llm_rubric.instructions)
        return run

    def with_fresh_masks():  # the pruned forward building each item's suffix mask anew
        from calibrl.judge_server.backends import hf

        kept_mask = hf.SuffixLayout.mask
        hf.SuffixLayout.mask = lambda layout, n: kept_mask(dataclasses.replace(layout, kept={}), n)
        try:
            return logprob("prefix_cache")()
        finally:
            hf.SuffixLayout.mask = kept_mask

    logprob_paths = {"logprob_prefix_cache": logprob("prefix_cache"),
                     "logprob_prefix_cache_fresh_masks": with_fresh_masks,
                     "logprob_prefix_cache_transformers": logprob("prefix_cache", prune=False),
                     "logprob_prefix_cache_rows": logprob("prefix_cache", packed=False),
                     "logprob_flat": logprob("flat")}
    measured = interleaved({**logprob_paths,
                            "generate_and_parse": lambda: backend.generate_answers(encoded, llm_rubric.llm_criteria)},
                           args.repeats)
    backend.packs_suffixes, backend.pruned = packs, pruned
    reference = measured["logprob_prefix_cache"][2]
    for name in logprob_paths:
        wall, cpu, scores = measured[name]
        diff = max(abs(a - b) for ra, rb in zip(scores, reference) for a, b in zip(ra, rb))
        results[name] = row(n_scores, wall, cpu, max_abs_diff_vs_prefix_cache=diff)
    wall, cpu, answers = measured["generate_and_parse"]
    values = [v for answer_row in answers for v in answer_row]
    results["generate_and_parse"] = row(n_scores, wall, cpu, sum(v is None for v in values) / len(values))
    agreement = _agreement_with_experts(llm_rubric.llm_criteria, bench_records, reference)

    # Programmatic rubric (MiniLM loads once; timed calls run warm).
    programmatic = Judge([parse_rubric(PROGRAMMATIC_RUBRIC)], JudgeConfig(cache_size=0, allow_unvalidated=True))
    n_prog = len(items) * 5
    wall, cpu, _ = timed(lambda: programmatic.score("bench-programmatic", items), args.repeats)
    results["programmatic_minilm"] = row(n_prog, wall, cpu)

    # Cache hits: in process, then over gRPC on loopback.
    cached_judge = Judge([llm_rubric], dataclasses.replace(llm_config("prefix_cache"), cache_size=100_000),
                         llm=backend)
    backend.mode = "prefix_cache"
    cached_judge.score(llm_rubric.id, items)
    wall, cpu, hits = timed(lambda: cached_judge.score(llm_rubric.id, items), args.repeats)
    assert all(s.cached for s in hits)
    results["cache_hits_in_process"] = row(n_scores, wall, cpu)
    results["cache_hits_grpc"] = asyncio.run(_grpc_cache_hits(cached_judge, llm_rubric.id, items, n_scores,
                                                              args.repeats))

    shown: list[str] = []

    def say(text: str = "") -> None:  # printed, and kept for the record
        print(text)
        shown.append(text)

    base = results["logprob_prefix_cache"]["scores_per_s"]
    n_likert = sum(c.scale == "likert_1_5" for c in llm_rubric.llm_criteria)
    say(f"judge benchmark: {len(items)} items x {len(llm_rubric.llm_criteria)} LLM criteria "
          f"({len(llm_rubric.llm_criteria) - n_likert} yes/no, {n_likert} 1-5) = {n_scores} scores; "
          f"{args.judge_model} Llama {args.layers} layers, hidden {args.hidden} ({n_params / 1e6:.2f} M parameters); "
          f"prompts: prefix {prefix_tokens:.0f} + suffix {suffix_tokens:.0f} tokens on average; device {args.device}, "
          f"torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    say()
    base_cpu = results["logprob_prefix_cache"]["scores_per_cpu_s"]
    say("| path | wall s | scores/s | vs prefix cache | CPU s | scores/CPU s | vs prefix cache | parse failures |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        say(f"| {name} | {r['seconds']:.4f} | {r['scores_per_s']:,.0f} | {r['scores_per_s'] / base:.2f}x | "
              f"{r['cpu_seconds']:.4f} | {r['scores_per_cpu_s']:,.0f} | {r['scores_per_cpu_s'] / base_cpu:.2f}x | "
              f"{r['parse_failures']:.0%} |")
    say()
    say(f"pruned forward: {'yes' if pruned is not None else 'no (' + unsupported_reason(backend.model) + ')'}")
    for name in list(logprob_paths)[1:]:
        say(f"{name} vs prefix-cache scores: max |diff| = {results[name]['max_abs_diff_vs_prefix_cache']:.2e}")
    ratio = base / results["generate_and_parse"]["scores_per_s"]
    ratio_cpu = base_cpu / results["generate_and_parse"]["scores_per_cpu_s"]
    say(f"shared-prefix logprob vs generate-and-parse: {ratio:.1f}x wall, {ratio_cpu:.1f}x CPU (target >= 5x)")
    if training is not None:
        say(f"trained on {training['n_train']} of {training['n_records']} synthetic SME records "
              f"({training['epochs']} epochs, {training['seconds']:.0f} s); held-in agreement after training: "
              + ", ".join(f"{name} {value:.2f}" for name, value in training["held_in_agreement"].items()))
    say("agreement of the logprob answers with the SME tags/grades of the bench items (never trained on): "
          + ", ".join(f"{name} {value:.2f}" for name, value in agreement.items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "n_params": n_params, "prefix_tokens": prefix_tokens,
                       "suffix_tokens": suffix_tokens, "results": results, "training": training,
                       "agreement_with_experts": agreement}, handle, indent=2)
    if args.record:
        from bench_record import tables_from_markdown, write_record

        table_end = max(i for i, line in enumerate(shown) if line.startswith("|")) + 1
        write_record(args.record, tables_from_markdown(shown[:table_end]),
                     notes=[line for line in shown[table_end:] if line], libraries=("torch", "transformers"))
    return 0


def _train_judge(base, workdir: str, args) -> tuple:
    """Distil LLM criteria from synthetic SME feedback, add a 1-5 question learnt from the
    grades, and train the judge on the training part: (rubric, model folder, summary)."""
    from calibrl.judge_server.authoring.distill import DistillOptions, distill
    from calibrl.judge_server.authoring.feedback import write_feedback
    from calibrl.judge_server.rubric import Criterion, dump_rubric, load_rubric, with_fields
    from calibrl.testing import synthetic_feedback
    from calibrl.judge_server.authoring.train_judge import TrainJudgeOptions, train_judge

    records = synthetic_feedback(args.train_records, seed=7)
    write_feedback(f"{workdir}/feedback.jsonl", records)
    rubric = distill(records, DistillOptions(rubric_id="bench-llm", criteria_mode="llm")).rubric
    quality = Criterion("quality", "llm", 0.5, question="How good is the output as a search query for the user's "
                        "question?", scale="likert_1_5")
    rubric = with_fields(rubric, criteria=rubric.criteria + (quality,))
    with open(f"{workdir}/rubric.yaml", "w") as handle:
        handle.write(dump_rubric(rubric))
    options = TrainJudgeOptions(epochs=args.train_epochs, lr=args.train_lr, batch_size=16, device=args.device)
    result = train_judge(f"{workdir}/feedback.jsonl", f"{workdir}/rubric.yaml", base, f"{workdir}/judge", options,
                         progress=False, echo=lambda line: print(line, file=sys.stderr))
    summary = {"n_records": len(records), "n_train": len(result.train), "epochs": args.train_epochs,
               "held_in_agreement": {name: c["final"]["agreement"] for name, c in result.record["criteria"].items()}}
    return load_rubric(f"{workdir}/rubric.yaml"), result.out, summary


def _agreement_with_experts(criteria, records, scores) -> dict[str, float]:
    """Per criterion, the share of items whose logprob answer is the one training would
    target for that record (``train_judge.criterion_target``: from the SME tags, verdict or
    grade; a 1-5 answer agrees when it rounds to the target grade)."""
    from calibrl.judge_server.authoring.train_judge import answer_agrees, criterion_target

    out = {}
    for column, criterion in enumerate(criteria):
        hits = [answer_agrees(criterion, criterion_target(criterion, record), row[column])
                for record, row in zip(records, scores)]
        out[criterion.name] = sum(hits) / len(hits)
    return out


async def _grpc_cache_hits(judge, rubric_id, items, n_scores, repeats) -> dict:
    import grpc

    from calibrl.v1 import judge_pb2 as pb
    from calibrl.v1 import judge_pb2_grpc
    from calibrl.api import judge_wire as wire
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.judge_server.server import start

    config = JudgeServerConfig(rubrics="(in memory)")
    config.serving.port = 0
    running = await start(config, judge=judge)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            request = pb.ScoreRequest(rubric_id=rubric_id, items=[wire.item_to_proto(i) for i in items])
            await stub.Score(request)
            times = []
            cpu_times = []
            for _ in range(max(repeats, 5)):
                start_time, start_cpu = time.perf_counter(), time.process_time()
                response = await stub.Score(request)
                times.append(time.perf_counter() - start_time)
                cpu_times.append(time.process_time() - start_cpu)
            assert all(s.cached for s in response.scores)
    finally:
        await running.stop(0)
    return row(n_scores, statistics.median(times), statistics.median(cpu_times))


if __name__ == "__main__":
    sys.exit(main())
