"""Rollout generation benchmark: batched sampling vs one prompt at a time.

A random Llama-architecture model (no download; size set by --hidden/--layers) and
a byte-level BPE tokenizer trained on the spot sample ``--new-tokens`` tokens for
``--prompts`` prompts with :class:`calibrl.trainer.engines.TransformersEngine`:

1. one left-padded batch (what the rollouts do);
2. the same prompts one at a time;

and report new tokens/s of each and their ratio, plus the time of one
``sequence_logprobs`` pass over the batch (the policy/old/reference forward of a
training step). Stop strings are on in both runs (the search-agent stops) but a
random model never emits them, so every row generates ``--new-tokens`` tokens.

    python benchmarks/bench_generation.py                       # CPU defaults
    python benchmarks/bench_generation.py --device cuda --hidden 512 --layers 8

Figures on a shared machine are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch

    from calibrl.testing import build_model, build_tokenizer
    from calibrl.trainer.engines import TransformersEngine
    from calibrl.testing.logprobs import sequence_logprobs
    from calibrl.trainer.policy import Policy
    from calibrl.trainer.rollout import assemble_rows
    from calibrl.trainer.search_format import TURN_STOP_STRINGS

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=args.hidden, layers=args.layers, context=1024).to(args.device)
    policy = Policy(model=model, tokenizer=tokenizer, device=torch.device(args.device), model_id="random")
    engine = TransformersEngine(policy)
    questions = ["Where is the Eiffel Tower?", "Who wrote Dune and when?", "What does insulin do?",
                 "Which river flows north into the Mediterranean Sea?"]
    prompts = [tokenizer(f"Question {i}: {questions[i % len(questions)]}\n<think>")["input_ids"]
               for i in range(args.prompts)]
    sampling = dict(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, stop_strings=TURN_STOP_STRINGS)

    engine.generate(prompts[:2], **{**sampling, "max_new_tokens": 4}, seed=0)  # warm-up

    def timed(fn):
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - start)
        return best, result

    batched_s, completions = timed(lambda: engine.generate(prompts, **sampling, seed=1))
    sequential_s, _ = timed(lambda: [engine.generate([p], **sampling, seed=1) for p in prompts])
    new_tokens = sum(len(c) for c in completions)

    rows = [[(p, False), (c, True)] for p, c in zip(prompts, completions)]
    batch = assemble_rows(rows, tokenizer.pad_token_id)

    def logprob_pass():
        with torch.no_grad():
            return sequence_logprobs(model, batch["input_ids"].to(args.device), batch["attention_mask"].to(args.device))

    logprob_s, _ = timed(logprob_pass)
    report = {
        "device": args.device,
        "model": f"llama hidden={args.hidden} layers={args.layers} vocab={len(tokenizer)}",
        "prompts": args.prompts,
        "new_tokens_total": new_tokens,
        "batched_tokens_per_s": round(new_tokens / batched_s, 1),
        "one_at_a_time_tokens_per_s": round(new_tokens / sequential_s, 1),
        "batched_over_one_at_a_time": round(sequential_s / batched_s, 2),
        "token_logprobs_batch_s": round(logprob_s, 4),
        "best_of": args.repeats,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
