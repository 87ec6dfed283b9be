"""The untrained search agent's failures against the length of its warm start.

For each ``--steps`` value, build the demo's base search agent of ``--seed`` exactly as
``calibrl study`` builds it (the demo's tokenizer, seeded model, teacher and
``calibrl.demo.policy.warm_start``), with only ``warm_steps`` changed, and decode
greedily (``calibrl study``'s ``question_scores``) on every ``--train-stride``-th
training question. Print one JSON line per setting: warm-start seconds, mean answer
F1 and the error categories (``calibrl/demo/error_analysis.py``). No arm is trained
and no held-out question is read: a design knob is chosen on training data only, by a
rule written before the probe's first run (``experiments/LOG.md``).

    python benchmarks/probe_warm_start.py --seed 0 --steps 300,600,900

It starts the study's retrieval and judge services on loopback ports; on two cores
one setting of 600 steps takes about two minutes.
"""

from __future__ import annotations

import argparse
import collections
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
    parser.add_argument("--steps", default="300,600,900", help="comma-separated warm-start step counts")
    parser.add_argument("--train-stride", type=int, default=8, help="probe every N-th training question")
    parser.add_argument("--out", default="", help="working folder (default: a temporary one)")
    args = parser.parse_args()

    from calibrl import kernels

    kernels.pin()  # as calibrl demo and calibrl study: AVX2 float kernels, before torch loads
    import torch

    from calibrl.demo import study
    from calibrl.demo.cli import FULL, _Clients, build_demo_index
    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.demo.search_design import eval_settings
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.tasks import load_tasks

    torch.set_num_threads(1)
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(args.out or scratch)
        domain = generate_domain(args.seed)
        files = write_domain(domain, out / "data")
        build_demo_index(files.corpus, out / "index")
        train = load_tasks(files.multistep_train)[:: args.train_stride]
        with study._services(out) as (retrieval, judge), BackgroundLoop(name="probe") as background:
            clients = _Clients(retrieval, judge, background)
            try:
                for warm_steps in steps:
                    design = FULL.search.with_overrides(warm_steps=warm_steps)
                    started = time.perf_counter()
                    agent = study.build_base_agent(replace(FULL, search=design), domain, out / f"warm_{warm_steps}",
                                                   clients, args.seed, False)
                    row: dict = {"seed": args.seed, "warm_steps": warm_steps,
                                 "warm_s": round(time.perf_counter() - started, 1)}
                    for name, tasks in (("train", train),):
                        scores = study.question_scores(agent, tasks, clients, eval_settings(design))
                        row[name] = {"questions": len(tasks), "f1": round(sum(scores["f1"]) / len(tasks), 4),
                                     "categories": dict(collections.Counter(scores["category"]))}
                    print(json.dumps(row), flush=True)
            finally:
                clients.close()


if __name__ == "__main__":
    main()
