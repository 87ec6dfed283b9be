"""What a judge item's pruned forward spends outside the model: the suffix mask and the rotary
embedding, at two tiny Llama sizes, one torch thread, process CPU time.

- the suffix mask: built anew for every item, or one mask per score call served as views
  (``hf.SuffixLayout.mask``, the default); the same bits either way
  (tests/test_judge_pruned_forward.py);
- the rotary embedding: the model's ``rotary_emb`` per call against a precomputed table read
  by slicing (prefix positions) or by gathering (suffix positions), to size what a rotary
  cache could save.

    python benchmarks/bench_judge_masks.py [--rounds 9]

Rounds alternate the two mask paths (median per path); compare the ratio within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import timeit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per mask path (9)")
    args = parser.parse_args(argv)

    import torch

    from calibrl.judge_server.backends.hf import SuffixLayout
    from calibrl.judge_server.backends.pruned_forward import pruned_forward_for
    from calibrl.testing import build_tokenizer
    from calibrl.tiny_lm import TinyLMSpec, build_tiny_lm

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    print("| model | items | CPU s, fresh masks | CPU s, one mask per call | speed-up | rotary_emb per call | "
          "table slice | table gather |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for hidden, layers, heads, kv_heads in ((48, 2, 3, 1), (256, 4, 4, 2)):
        spec = TinyLMSpec(arch="llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
                          num_kv_heads=kv_heads)
        model = build_tiny_lm(tokenizer, spec, seed=0).eval()
        pruned = pruned_forward_for(model)
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        # the bench judge's shapes: 7 criterion suffixes of 25-96 tokens, prefixes of 240-300 tokens
        suffixes = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (25, 40, 55, 60, 70, 80, 96)]
        prefixes = [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
                    for n in torch.randint(240, 300, (64,), generator=generator)]

        def run(kept: bool) -> float:
            layout = SuffixLayout.build(suffixes, torch, "cpu", torch.float32)
            started = time.process_time()
            with torch.inference_mode():
                for prefix in prefixes:
                    pruned.item_logprobs(prefix, layout if kept else dataclasses.replace(layout, kept={}))
            return time.process_time() - started

        run(True), run(False)  # warm-up
        kept, fresh = [], []
        for _ in range(args.rounds):
            kept.append(run(True))
            fresh.append(run(False))
        kept_s, fresh_s = sorted(kept)[args.rounds // 2], sorted(fresh)[args.rounds // 2]

        rotary = model.model.rotary_emb
        hidden_states = torch.zeros(1, 273, hidden)
        positions = torch.arange(273)[None]
        with torch.inference_mode():
            table = rotary(hidden_states, torch.arange(1024)[None])
            calls = 2000
            per_call = timeit.timeit(lambda: rotary(hidden_states, positions), number=calls) / calls
            sliced = timeit.timeit(lambda: (table[0][:, :273], table[1][:, :273]), number=calls) / calls
            gathered = timeit.timeit(lambda: (table[0][:, positions[0]], table[1][:, positions[0]]),
                                     number=calls) / calls
        print(f"| Llama {layers} layers, hidden {hidden} | {len(prefixes)} | {fresh_s:.4f} | {kept_s:.4f} | "
              f"{fresh_s / kept_s:.3f}x | {per_call * 1e6:.0f} us | {sliced * 1e6:.0f} us | {gathered * 1e6:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
