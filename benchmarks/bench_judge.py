"""Judge throughput: item x criterion scores per second.

Compares, on the same items and LLM criteria, with a tiny randomly initialised causal
LM built here (nothing downloaded):

- logprob scoring with the shared-prefix KV cache (``prefix_cache``, the default),
- logprob scoring with every item x criterion prompt in one flat left-padded batch,
- generate-and-parse (greedy, ``max_new_tokens`` tokens, then parse), with its
  parse-failure rate (logprob scoring cannot fail to parse),

then the programmatic rubric (MiniLM intent similarity and the rule-based criteria),
and cache hits, in process and over gRPC on loopback.

    python benchmarks/bench_judge.py                      # tiny model, CPU
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


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls after one warm-up call, and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


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
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    from judge_server.config import JudgeConfig
    from judge_server.judge import Judge, load_llm
    from judge_server.rubric import parse_rubric
    from calibrl.testing import build_tiny_causal_lm, synthetic_feedback

    if args.threads:
        torch.set_num_threads(args.threads)
    items = [r.to_item() for r in synthetic_feedback(args.items, seed=42)]
    llm_rubric = parse_rubric(LLM_RUBRIC)
    n_scores = len(items) * len(llm_rubric.llm_criteria)
    folder = build_tiny_causal_lm(tempfile.mkdtemp(prefix="bench-judge-"), hidden_size=args.hidden,
                                  num_layers=args.layers, num_heads=max(2, args.hidden // 16), seed=0)
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

    reference = None
    for mode in ("prefix_cache", "flat"):
        backend.mode = mode
        seconds, scores = timed(lambda: backend.score(items, llm_rubric.llm_criteria, ""), args.repeats)
        if reference is None:
            reference = scores
        diff = max(abs(a - b) for ra, rb in zip(scores, reference) for a, b in zip(ra, rb))
        results[f"logprob_{mode}"] = {"seconds": seconds, "scores_per_s": n_scores / seconds, "parse_failures": 0.0,
                                      "max_abs_diff_vs_prefix_cache": diff}

    def generate():
        return backend.generate_answers(encoded, llm_rubric.llm_criteria)

    seconds, answers = timed(generate, max(1, args.repeats - 1))
    values = [v for row in answers for v in row]
    results["generate_and_parse"] = {"seconds": seconds, "scores_per_s": n_scores / seconds,
                                     "parse_failures": sum(v is None for v in values) / len(values)}

    # Programmatic rubric (MiniLM loads once; timed calls run warm).
    programmatic = Judge([parse_rubric(PROGRAMMATIC_RUBRIC)], JudgeConfig(cache_size=0, allow_unvalidated=True))
    n_prog = len(items) * 5
    seconds, _ = timed(lambda: programmatic.score("bench-programmatic", items), args.repeats)
    results["programmatic_minilm"] = {"seconds": seconds, "scores_per_s": n_prog / seconds, "parse_failures": 0.0}

    # Cache hits: in process, then over gRPC on loopback.
    cached_judge = Judge([llm_rubric], dataclasses.replace(llm_config("prefix_cache"), cache_size=100_000),
                         llm=backend)
    backend.mode = "prefix_cache"
    cached_judge.score("bench-llm", items)
    seconds, hits = timed(lambda: cached_judge.score("bench-llm", items), args.repeats)
    assert all(s.cached for s in hits)
    results["cache_hits_in_process"] = {"seconds": seconds, "scores_per_s": n_scores / seconds, "parse_failures": 0.0}
    results["cache_hits_grpc"] = asyncio.run(_grpc_cache_hits(cached_judge, items, n_scores, args.repeats))

    base = results["logprob_prefix_cache"]["scores_per_s"]
    print(f"judge benchmark: {len(items)} items x {len(llm_rubric.llm_criteria)} LLM criteria = {n_scores} scores; "
          f"random Llama {args.layers} layers, hidden {args.hidden} ({n_params / 1e6:.2f} M parameters); "
          f"prompts: prefix {prefix_tokens:.0f} + suffix {suffix_tokens:.0f} tokens on average; device {args.device}, "
          f"torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print()
    print("| path | seconds | item x criterion scores/s | vs prefix cache | parse failures |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, row in results.items():
        print(f"| {name} | {row['seconds']:.4f} | {row['scores_per_s']:,.0f} | {row['scores_per_s'] / base:.2f}x | "
              f"{row['parse_failures']:.0%} |")
    print()
    print(f"flat vs prefix-cache scores: max |diff| = {results['logprob_flat']['max_abs_diff_vs_prefix_cache']:.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "n_params": n_params, "prefix_tokens": prefix_tokens,
                       "suffix_tokens": suffix_tokens, "results": results}, handle, indent=2)
    return 0


async def _grpc_cache_hits(judge, items, n_scores, repeats) -> dict:
    import grpc

    from calibrl.v1 import judge_pb2 as pb
    from calibrl.v1 import judge_pb2_grpc
    from judge_server import wire
    from judge_server.config import JudgeServerConfig
    from judge_server.server import start

    config = JudgeServerConfig(rubrics="(in memory)")
    config.serving.port = 0
    running = await start(config, judge=judge)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            request = pb.ScoreRequest(rubric_id="bench-llm", items=[wire.item_to_proto(i) for i in items])
            await stub.Score(request)
            times = []
            for _ in range(max(repeats, 5)):
                start_time = time.perf_counter()
                response = await stub.Score(request)
                times.append(time.perf_counter() - start_time)
            assert all(s.cached for s in response.scores)
    finally:
        await running.stop(0)
    seconds = statistics.median(times)
    return {"seconds": seconds, "scores_per_s": n_scores / seconds, "parse_failures": 0.0}


if __name__ == "__main__":
    sys.exit(main())
