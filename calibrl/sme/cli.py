"""``calibrl sme sample``, ``calibrl sme review`` and ``calibrl sme drift`` (routed by ``calibrl.cli``).

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


def drift(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl sme drift",
        description="The drift monitor (calibrl.sme.drift): score freshly graded items (the feedback JSONL "
        "'calibrl sme review' writes, e.g. for a training run's review queue) with a rubric and a judge, and "
        "compare with the experts as validation does: Cohen's kappa with its 95%% bootstrap interval and the gate. "
        "Below the gate it raises an alarm naming the criteria that disagree. Exit 0: the judge agrees (or too "
        "few grades for a verdict), 1: alarm, 2: bad input.",
    )
    parser.add_argument("--rubric", required=True, help="rubric YAML (the version that scores the run)")
    parser.add_argument("--feedback", required=True, help="feedback JSONL of the fresh grades")
    parser.add_argument("--judge", default="programmatic", help="judge SPEC (programmatic)")
    parser.add_argument("--judge-option", action="append", default=[], metavar="KEY=VALUE",
                        help="JudgeConfig override, e.g. embedder=hashed-ngrams (repeatable)")
    parser.add_argument("--min-kappa", type=float, default=0.6, help="the gate (0.6)")
    parser.add_argument("--gate", choices=["estimate", "lower-bound", "upper-bound"], default="estimate",
                        help="what must reach --min-kappa: the estimate, its interval's lower bound, or its upper "
                             "bound (an alarm only when the whole interval is below)")
    parser.add_argument("--pass-threshold", type=float, default=None,
                        help="judge pass = total >= this (default: the rubric's validation record's, else 0.6)")
    parser.add_argument("--pass-grade", type=int, default=4, help="expert pass = grade >= this without a verdict (4)")
    parser.add_argument("--min-items", type=int, default=10, help="fewest graded items for a verdict (10)")
    parser.add_argument("--min-separation", type=float, default=0.1,
                        help="a criterion disagrees when its mean on passed minus failed items is below this (0.1)")
    parser.add_argument("--json", help="write the report as JSON here")
    args = parser.parse_args(list(argv))

    import json

    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.judge import Judge, load_llm
    from calibrl.judge_server.rubric import load_rubric
    from calibrl.judge_server.authoring.validation import read_records, validation_path
    from calibrl.sme.drift import DriftOptions, drift_report

    try:
        rubric = load_rubric(args.rubric)
        config = load_config(JudgeConfig, None, [*args.judge_option, f"backend={args.judge}", "allow_unvalidated=true",
                                                 "cache_size=0"])
        judge = Judge([rubric], config, llm=load_llm(config))
        threshold = args.pass_threshold
        if threshold is None:
            records = [r for r in read_records(validation_path(args.rubric))
                       if r.rubric_hash == rubric.hash and r.model_id == judge.scorer_id(rubric)]
            threshold = records[0].pass_threshold if records else 0.6
        options = DriftOptions(min_kappa=args.min_kappa, gate=args.gate.replace("-", "_"), pass_threshold=threshold,
                               pass_grade=args.pass_grade, min_items=args.min_items, min_items_name="--min-items",
                               min_separation=args.min_separation)
        feedback = read_feedback(args.feedback)
        scores = []
        for start in range(0, len(feedback), config.max_batch_size):
            scores += judge.score(rubric.id, [r.to_item() for r in feedback[start:start + config.max_batch_size]])
        report = drift_report(rubric, feedback, scores, options, judge.scorer_id(rubric))
    except CalibrlError as exc:
        return _fail(str(exc))
    print(f"rubric {rubric.id} version {rubric.hash[:12]} ({rubric.version}), judge {judge.scorer_id(rubric)}, "
          f"{report.n_items} graded items, pass_threshold {threshold:g}")
    for c in report.criteria:
        sep = "n/a" if c.separation is None else f"{c.separation:+.2f}"
        approves = "n/a" if c.approves_failed is None else f"{c.approves_failed:.0%}"
        print(f"  {c.name:<24} separation {sep:>6}  approves failed {approves:>5}" + ("  DISAGREES" if c.disagrees else ""))
    print(("ALARM: " if report.alarm else "") + report.reason)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
    return 1 if report.alarm else 0
