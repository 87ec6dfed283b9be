"""Expert reviews needed to pass the validation gate: representative vs random sampling.

Runs :func:`calibrl.studies.sme_time.run_study` on the built-in demo domain exactly as
``calibrl demo`` does (same SME feedback, golden split, BM25 hit@1 outcome, programmatic
judge, pass threshold picked on each budget's own reviews, gate: the kappa's whole 95%
interval >= 0.6), without the training stages:

    python benchmarks/bench_sme_sampling.py --seed 6 [--out DIR]

Prints the table and the verdict; writes study.json and the plot into --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=6, help="seed of the domain and of the sampling (6, the demo's)")
    parser.add_argument("--repeats", type=int, default=5, help="random draws per budget (5)")
    parser.add_argument("--budgets", default="5,8,10,15,20,30,45,60,90,120,160",
                        help="comma-separated review budgets")
    parser.add_argument("--out", default="", help="folder for study.json and the plot (default: a temp folder)")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the table as a JSON record (benchmarks/records/NAME.json: README block "
                             "bench-NAME)")
    args = parser.parse_args(argv)

    from calibrl.demo.domain import generate_domain
    from calibrl.studies.sme_time import StudyOptions, demo_inputs, plot_study, run_study
    from calibrl.retrieval_server.index import build_index_from_dicts
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.api.retrieval import SearchMode

    started = time.perf_counter()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench-sme-"))
    out.mkdir(parents=True, exist_ok=True)
    domain = generate_domain(args.seed)
    build_index_from_dicts(({"_id": p.doc_id, "title": p.title, "text": p.text} for p in domain.passages),
                           out / "index", device="cpu", overwrite=True, show_progress=False)
    retriever = Retriever.load(out / "index", device="cpu")

    def search(queries: list[str]) -> list[list[str]]:  # the demo's outcome: BM25 hit@1
        return [[h.doc_id for h in hits] for hits in retriever.search(queries, 1, SearchMode.BM25)]

    pool, answers, golden = demo_inputs(domain, search)
    options = StudyOptions(budgets=tuple(int(b) for b in args.budgets.split(",")), random_repeats=args.repeats,
                           seed=args.seed, glossary=tuple(domain.glossary_terms()))
    result = run_study(pool, answers, golden, options, progress=lambda line: print("  " + line, flush=True))
    plot_study(result, out / "sme_kappa_vs_reviews.png")
    (out / "study.json").write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    print(result.table())
    print(result.verdict())
    print(f"outcome mix of the pool: " + ", ".join(
        f"{k} {v}" for k, v in sorted(__import__("collections").Counter(i.outcome for i in pool).items())))
    print(f"wrote {out / 'study.json'} and {out / 'sme_kappa_vs_reviews.png'} in {time.perf_counter() - started:.0f}s")
    if args.record:
        from bench_record import tables_from_markdown, write_record

        title = ("Validation kappa on the golden set of a rubric distilled from each budget of reviews, "
                 "representative (calibrl sme sample) vs random sampling")
        write_record(args.record, tables_from_markdown([title, *result.table().splitlines()]), notes=[result.verdict()],
                     argv=[__file__, *(sys.argv[1:] if argv is None else argv)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
