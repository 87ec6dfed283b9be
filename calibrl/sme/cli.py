"""``calibrl sme sample`` and ``calibrl sme review`` (routed by ``calibrl.cli``).

Heavy imports (numpy, the embedder, Flask) happen after argument parsing.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Sequence

from calibrl.errors import CalibrlError


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def sample(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl sme sample",
        description="Choose N items worth an expert's review from rollouts or eval outputs (the sample-input "
        "JSONL, docs/guides/sme-review.md): representatives of each outcome (retrieval hit / miss) by k-means over "
        "MiniLM embeddings, the items a current judge is least sure of, and those where judge and retrieval "
        "disagree. Deterministic for a seed; prints a coverage summary and why each item was chosen.",
    )
    parser.add_argument("--rollouts", required=True, help="items JSONL (calibrl eval --sme-items, the demo, ...)")
    parser.add_argument("--n", type=int, required=True, help="items to choose")
    parser.add_argument("--out", required=True, help="sample JSONL to write (the input of calibrl sme review)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the k-means++ starts (0)")
    parser.add_argument("--pass-threshold", type=float, default=0.6, help="judge pass = judge_total >= this (0.6)")
    parser.add_argument("--margin", type=float, default=0.15,
                        help="judge unsure = |judge_total - threshold| <= this (0.15)")
    parser.add_argument("--uncertain-share", type=float, default=0.2, help="share of N for judge-unsure items (0.2)")
    parser.add_argument("--disagree-share", type=float, default=0.2,
                        help="share of N for judge-vs-retrieval disagreements (0.2)")
    parser.add_argument("--device", default="cpu", help="device of the MiniLM embedder (cpu)")
    parser.add_argument("--quiet", action="store_true", help="print the coverage summary only, not each item")
    args = parser.parse_args(list(argv))

    from calibrl.sme.items import read_items, write_items
    from calibrl.sme.sample import SampleOptions, choose_sample, minilm_embed

    try:
        options = SampleOptions(n=args.n, seed=args.seed, pass_threshold=args.pass_threshold, margin=args.margin,
                                uncertain_share=args.uncertain_share, disagree_share=args.disagree_share)
        options.validate()
        items = read_items(args.rollouts)
        result = choose_sample(items, options, embed=minilm_embed(args.device))
    except CalibrlError as exc:
        return _fail(str(exc))
    write_items(args.out, result.items)
    for line in result.coverage.lines():
        print(line)
    if not args.quiet:
        for item in result.items:
            print(f"  {item.id}: {'; '.join(item.reasons)}")
    print(f"wrote {len(result.items)} items to {args.out}")
    return 0


def review(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl sme review",
        description="Serve a local web page where experts grade a sample one item at a time (grade 1-5 and/or "
        "pass/fail, error tags, notes; keyboard shortcuts). Every answer is written at once to the feedback "
        "JSONL that 'calibrl rubric distill' reads; a restart resumes where it stopped. Pages also show the "
        "agreement between reviewers and the rubric's validation.",
    )
    parser.add_argument("--sample", required=True, help="sample JSONL (calibrl sme sample --out)")
    parser.add_argument("--rubric", help="rubric YAML: its criteria and error tags are shown")
    parser.add_argument("--out", required=True, help="feedback JSONL to write (and resume from)")
    parser.add_argument("--validation", help="validation records (default: <rubric>.validation.json)")
    parser.add_argument("--golden", help="golden JSONL: the rubric page lists its items where judge and experts "
                        "disagree (scored by --judge)")
    parser.add_argument("--judge", default="programmatic", help="judge SPEC scoring --golden (programmatic)")
    parser.add_argument("--judge-option", action="append", default=[], metavar="KEY=VALUE",
                        help="JudgeConfig override for that judge, e.g. embedder=hashed-ngrams (repeatable)")
    parser.add_argument("--pass-grade", type=int, default=4, help="expert pass = grade >= this without a verdict (4)")
    parser.add_argument("--pass-threshold", type=float, default=0.6, help="judge pass = total >= this (0.6)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1; others need --token)")
    parser.add_argument("--port", type=int, default=8765, help="TCP port, 0 = any free port (8765)")
    parser.add_argument("--token", default=None,
                        help="access token every request must carry (or CALIBRL_SME_TOKEN); required off loopback")
    args = parser.parse_args(list(argv))

    from calibrl.sme.app import ReviewSettings, serve

    if not 1 <= args.pass_grade <= 5:
        return _fail(f"--pass-grade {args.pass_grade}: must be in 1..5")
    if not 0.0 <= args.pass_threshold <= 1.0:
        return _fail(f"--pass-threshold {args.pass_threshold}: must be in [0, 1]")
    if not 0 <= args.port <= 65535:
        return _fail(f"--port {args.port}: must be in 0..65535")
    token = args.token if args.token is not None else os.environ.get("CALIBRL_SME_TOKEN", "")
    if token and len(token) < 16:
        return _fail("--token: use at least 16 characters (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
    settings = ReviewSettings(
        sample=pathlib.Path(args.sample), out=pathlib.Path(args.out),
        rubric=pathlib.Path(args.rubric) if args.rubric else None,
        validation=pathlib.Path(args.validation) if args.validation else None,
        golden=pathlib.Path(args.golden) if args.golden else None, judge=args.judge,
        judge_overrides=list(args.judge_option), pass_grade=args.pass_grade, pass_threshold=args.pass_threshold,
        token=token, host=args.host, port=args.port,
    )
    try:
        serve(settings, announce=lambda line: print(line, flush=True))
    except CalibrlError as exc:
        return _fail(str(exc))
    except ImportError as exc:
        return _fail(f"{exc}: the review page needs Flask: pip install 'calibrl[sme]'")
    except OSError as exc:
        return _fail(f"cannot serve on {args.host}:{args.port}: {exc}")
    return 0
