"""The untrained search agent against the length of its warm start and the teacher's care.

For each ``--steps`` value, build the demo's base search agent of ``--seed`` exactly as
``calibrl study`` builds it (the demo's tokenizer, seeded model, teacher and
``calibrl.demo.policy.warm_start``), with only ``warm_steps`` (and, with
``--careless-first``, the teacher's share of careless first queries) changed, and decode
greedily on every ``--train-stride``-th training question and on every validation
question. Print one JSON line per setting: warm-start seconds and, per split, answer F1,
exact match, the bridge-found rate (the first search returned the bridge document), the
answer-document-found rate, the read-out rate (``calibrl/demo/error_analysis.py``) and
the error categories. No arm is trained and no test question is read: the knobs are
chosen on training and validation data only, by the rules of experiments/LOG.md (D11).

    python benchmarks/probe_warm_start.py --seed 0 --steps 800,1200

It starts the study's retrieval and judge services on loopback ports.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
    parser.add_argument("--train-stride", type=int, default=4, help="probe every N-th training question")
    parser.add_argument("--careless-first", type=float, default=None,
                        help="the teacher's share of first queries without the industry word (default: the design's)")
    parser.add_argument("--fresh-values", action="store_true",
                        help="no warm-start demonstration states its training passage's own value (D16; the "
                             "design's own setting since D17, so this flag matters only on older designs)")
    parser.add_argument("--out", default="", help="working folder (default: a temporary one)")
    parser.add_argument("--hidden", type=int, default=0, help="agent hidden size (default: the design's)")
    parser.add_argument("--layers", type=int, default=0, help="agent layers (default: the design's)")
    parser.add_argument("--warm-lr", type=float, default=3e-3,
                        help="the warm start's peak learning rate (default: the design's)")
    parser.add_argument("--dump", type=int, default=0,
                        help="also write the first N greedy records of each split to <out>/records_<steps>_<split>.jsonl")
    args = parser.parse_args()

    from calibrl import kernels

    kernels.pin()  # as calibrl demo and calibrl study: AVX2 float kernels, before torch loads
    import torch

    from calibrl.studies import search_arms as study
    from calibrl.demo.preparation import build_demo_index
    from calibrl.demo.settings import FULL
    from calibrl.demo.training import Clients
    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.demo.error_analysis import greedy_search_records
    from calibrl.demo.search_design import eval_settings
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.tasks import load_tasks

    torch.set_num_threads(1)
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    spec = FULL.search.agent_spec()  # the design's base agent
    if args.hidden or args.layers:
        spec = replace(spec, hidden_size=args.hidden or spec.hidden_size, num_layers=args.layers or spec.num_layers,
                       intermediate_size=(args.hidden or spec.hidden_size) * 8 // 3)
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(args.out or scratch)
        domain = generate_domain(args.seed)
        files = write_domain(domain, out / "data")
        build_demo_index(files.corpus, out / "index")
        passages = {p.doc_id: p.text for p in domain.passages}
        splits = {"train": load_tasks(files.multistep_train)[:: args.train_stride],
                  "validation": load_tasks(files.multistep_validation)}
        with study._services(out) as (retrieval, judge), BackgroundLoop(name="probe") as background:
            clients = Clients(retrieval, judge, background)
            try:
                for warm_steps in steps:
                    changes: dict = {"warm_steps": warm_steps}
                    if args.fresh_values:
                        changes["fresh_values"] = True
                    if args.careless_first is not None:
                        changes["careless_first"] = args.careless_first
                    design = FULL.search.with_overrides(**changes)
                    started = time.perf_counter()
                    agent = study.build_base_agent(replace(FULL, search=design), domain, out / f"warm_{warm_steps}",
                                                   clients, args.seed, False, spec, warm_lr=args.warm_lr)
                    row: dict = {"seed": args.seed, "warm_steps": warm_steps, "hidden": spec.hidden_size,
                                 "layers": spec.num_layers, "careless_first": design.careless_first,
                                 "careless_second": design.careless_second,
                                 "fresh_values": design.fresh_values, "warm_lr": args.warm_lr,
                                 "warm_s": round(time.perf_counter() - started, 1)}
                    for name, tasks in splits.items():
                        records = greedy_search_records(str(agent), tasks, clients.retrieval, eval_settings(design),
                                                        background.run)
                        row[name] = probe_row(records, passages)
                        if args.dump:
                            with open(out / f"records_{warm_steps}_{name}.jsonl", "w") as f:
                                f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records[: args.dump])
                    print(json.dumps(row), flush=True)
            finally:
                clients.close()


def probe_row(records: list, passages: dict) -> dict:
    """The probe's figures of one split's greedy records."""
    from calibrl.demo.error_analysis import found_answer_doc, readout

    n = len(records)
    bridge = sum(bool(r.found) and r.gold_doc_ids[0] in r.found[0] for r in records)
    return {"questions": n, "f1": round(sum(r.f1 for r in records) / n, 4),
            "em": round(sum(r.em for r in records) / n, 4), "bridge_found": round(bridge / n, 4),
            "answer_doc_found": round(sum(found_answer_doc(r) for r in records) / n, 4),
            "readout_rate": readout(records, passages)["readout_rate"],
            "well_formed": round(sum(r.well_formed for r in records) / n, 4),
            "categories": dict(collections.Counter(r.category for r in records))}


if __name__ == "__main__":
    main()
