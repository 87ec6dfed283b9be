"""How long the search arms keep improving on their own training reward (no held-out data).

Trains one arm of ``calibrl study`` (``--arm grpo`` or ``calibadv``) from the seed's base
agent for ``--steps`` steps under the demo's design with only the step count changed,
and prints its per-step training reward (answer F1 x format of the sampled rollouts)
with 10-step means. Nothing is evaluated on held-out questions, so a budget read off
these curves is chosen on training signals alone.

The rule this probe serves, written before its first run (session 7): the RL budget is
the smallest multiple of 30 steps after which the 10-step mean training reward, averaged
over GRPO and CalibAdv, rises by less than 0.01 over the next 30 steps; a new budget is
then confirmed on seeds nothing was chosen on before its held-out figures are read.

    python benchmarks/probe_rl_budget.py --seed 0 --arm grpo --steps 120
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from dataclasses import replace

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arm", default="grpo", choices=["grpo", "calibadv"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = parser.parse_args()

    from calibrl import kernels

    kernels.pin()  # as calibrl demo and calibrl study: AVX2 float kernels, before torch loads
    import torch

    from calibrl.studies import search_arms as study
    from calibrl.demo.preparation import build_demo_index
    from calibrl.demo.settings import FULL
    from calibrl.demo.training import Clients
    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.trainer.aio import BackgroundLoop

    torch.set_num_threads(1)
    demo = replace(FULL, search=FULL.search.with_overrides(steps=args.steps, checkpoints=1))
    plan = study.StudyPlan(demo, (args.seed,))
    arm = next(a for a in study.ARMS if a.name == args.arm)
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(args.out or scratch)
        domain = generate_domain(args.seed)
        files = write_domain(domain, out / "data")
        build_demo_index(files.corpus, out / "index")
        with study._services(out) as (retrieval, judge), BackgroundLoop(name="probe") as background:
            clients = Clients(retrieval, judge, background)
            try:
                base = study.build_base_agent(demo, domain, out, clients, args.seed, False)
                started = time.perf_counter()
                run = study.train_arm(plan, "normal", arm, base, files, clients, out, args.seed, False)
            finally:
                clients.close()
    rewards = [step["reward"] for step in run["steps"]]
    means = [round(sum(rewards[i:i + 10]) / len(rewards[i:i + 10]), 4) for i in range(0, len(rewards), 10)]
    print(json.dumps({"seed": args.seed, "arm": args.arm, "steps": args.steps,
                      "train_s": round(time.perf_counter() - started, 1), "reward_10_step_means": means,
                      "reward": [round(r, 4) for r in rewards]}), flush=True)


if __name__ == "__main__":
    main()
