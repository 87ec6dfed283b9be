"""Where one RL step of the search agent spends its time.

Trains ``--steps`` steps of one search arm from a demo's base agent (the folder ``calibrl
demo --out DIR`` wrote: its ``policies/base_agent``, ``data/multistep_train.jsonl`` and
``index``), with the demo's search design, the retrieval service in process and one torch
thread (as each arm trains in the demo and the study), under cProfile; prints one JSON line
with the seconds per step of each stage of the step:

- ``generate``: the rollouts' sampling (``trainer.engines`` generate), of which ``prefill``
  (each turn's prompt forward pass) and ``sample`` (drawing the next tokens);
- ``early_forward``: the reference and policy forward passes over the rollouts;
- ``backward``: the policy loss's backward pass;
- ``other``: the rest of the step (retrieval, rewards, advantages, the optimizer).

Only training questions are read. Loading the policy is timed apart (``load_s``).

    calibrl demo --out /tmp/demo && python benchmarks/profile_rl_step.py --demo /tmp/demo --steps 6

``--set KEY=VALUE`` (repeatable) adds a trainer override on top of the design's, to time a
knob a later design might change (training questions only, as always).
``--record PATH`` also writes the table as a record (``benchmarks/records/NAME.json``,
rendered into ``benchmarks/README.md`` by ``scripts/render_results.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import pstats
import tempfile
import time

STAGES = {  # stage -> (file suffix, function name) whose cumulative time it is
    "generate": ("trainer/engines.py", "_generate_batch"),
    "prefill": ("trainer/engines.py", "_prefill"),
    "sample": ("trainer/engines.py", "sample_next_token"),
    "early_forward": ("trainer/update.py", "forward_without_rewards"),
    "backward": ("trainer/update.py", "_backward"),
    "step": ("trainer/loop.py", "step"),
}


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    """The cumulative seconds of the function ``name`` defined in a file ending ``suffix``."""
    return sum(entry[3] for (path, _, function), entry in stats.stats.items()  # type: ignore[attr-defined]
               if function == name and path.replace("\\", "/").endswith(suffix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", required=True, help="a folder written by `calibrl demo --out DIR`")
    parser.add_argument("--steps", type=int, default=6, help="RL steps to train and time")
    parser.add_argument("--arm", default="grpo", help="the search arm (grpo, calibadv, calibadv_silver)")
    parser.add_argument("--seed", type=int, default=6, help="the trainer's seed")
    parser.add_argument("--quick", action="store_true", help="the quick demo's search design")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer override on top of the design's (repeat; e.g. rollout.chunk_prompts=4)")
    parser.add_argument("--record", metavar="PATH", help="also write the table as a JSON record")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from calibrl.demo.search_design import FULL_SEARCH, QUICK_SEARCH, train_overrides
    from calibrl.trainer.cli import make_clients
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.loop import train

    demo = pathlib.Path(args.demo)
    design = (QUICK_SEARCH if args.quick else FULL_SEARCH).with_overrides(steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="profile-rl-") as out:
        overrides = train_overrides(design, args.arm, policy=demo / "policies" / "base_agent",
                                    tasks=demo / "data" / "multistep_train.jsonl", output_dir=out,
                                    retrieval="inprocess", seed=args.seed,
                                    extra=[f"services.index_dir={demo / 'index'}", "checkpoint_every=0", *args.set])
        config = load_train_config(None, overrides)
        retrieval, judge, _ = make_clients(config.services)
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        result = train(config, retrieval=retrieval, judge=judge)
        profile.disable()
        wall = time.perf_counter() - started
    stats = pstats.Stats(profile)
    per_step = {stage: cumulative(stats, *where) / args.steps for stage, where in STAGES.items()}
    per_step["other"] = per_step["step"] - per_step["generate"] - per_step["early_forward"] - per_step["backward"]
    print(json.dumps({
        "arm": args.arm, "overrides": args.set, "steps": len(result.history), "wall_s": round(wall, 2),
        "load_s": round(wall - per_step["step"] * args.steps, 2),
        "seconds_per_step": {k: round(v, 3) for k, v in per_step.items()},
        "share_of_step": {k: round(v / per_step["step"], 3) for k, v in per_step.items() if k != "step"},
        "torch": torch.__version__,
    }))
    if args.record:
        from bench_record import table, write_record

        rows = [[stage, f"{per_step[stage]:.3f}", "-" if stage == "step" else f"{per_step[stage] / per_step['step']:.1%}"]
                for stage in ("generate", "prefill", "sample", "early_forward", "backward", "other", "step")]
        write_record(args.record, [table(
            f"One RL step of the {args.arm} arm ({'quick' if args.quick else 'full'} demo's search design, "
            f"{len(result.history)} steps from the demo's base agent, one torch thread, under cProfile): seconds "
            "per step by stage (prefill and sample are parts of generate)",
            ["stage", "seconds per step", "share of the step"], rows)], libraries=("torch", "transformers"))


if __name__ == "__main__":
    main()
