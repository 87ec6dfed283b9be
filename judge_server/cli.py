"""Command-line entry points of the judge service (routed by ``calibrl.cli``):

- ``calibrl serve judge --rubrics DIR --backend SPEC [--port N] [--allow-unvalidated]
  [--config FILE] [key=value ...]``
- ``calibrl rubric distill --feedback F --out rubric.yaml --golden-out golden.jsonl``
- ``calibrl rubric validate --rubric R --golden G --judge SPEC`` (exit 0 = gate passed)
- ``calibrl rubric train-judge --feedback F --rubric R --base MODEL --out DIR [--lora]``

Heavy imports happen inside the functions, after argument parsing.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from calibrl.errors import CalibrlError


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- serve

def serve(argv: list[str]) -> int:
    from calibrl.threads import passive_openmp

    passive_openmp()  # before torch loads its OpenMP runtime (calibrl.threads)
    from calibrl.config import describe

    parser = argparse.ArgumentParser(
        prog="calibrl serve judge",
        description="Serve rubric judges over gRPC (calibrl.v1.JudgeService).",
        epilog="config keys (set in --config FILE or as key=value overrides):\n  "
        + "\n  ".join(describe(_server_config_cls())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rubrics", help="folder of rubric YAML files (overrides 'rubrics')")
    parser.add_argument("--backend", help="judge SPEC: programmatic | transformers:PATH | vllm:PATH")
    parser.add_argument("--host", help="address to bind (serving.host)")
    parser.add_argument("--port", type=int, help="TCP port, 0 = any free port (serving.port)")
    parser.add_argument("--allow-unvalidated", action="store_true",
                        help="serve rubrics that have no passing validation record for this judge")
    parser.add_argument("--config", help="YAML config file (JudgeServerConfig)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. judge.cache_size=0")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from calibrl.config import load_config

    overrides = list(args.overrides)
    if args.rubrics:
        overrides.append(f"rubrics={args.rubrics}")
    if args.backend:
        overrides.append(f"judge.backend={args.backend}")
    if args.host:
        overrides.append(f"serving.host={args.host}")
    if args.port is not None:
        overrides.append(f"serving.port={args.port}")
    if args.allow_unvalidated:
        overrides.append("judge.allow_unvalidated=true")
    try:
        config = load_config(_server_config_cls(), args.config, overrides)
    except CalibrlError as exc:
        return _fail(str(exc))
    if config.judge.allow_unvalidated:
        logging.getLogger(__name__).warning(
            "--allow-unvalidated: rubrics without a passing validation record for this judge WILL be served")

    import asyncio

    from calibrl.serving import freeze_loaded_objects, serve_until_signal, stop_on_signals
    from calibrl.judge_server.server import start
    from calibrl.threads import apply_thread_policy, call_nicer, set_process_niceness

    try:  # first: every thread from here on (gRPC's, the models' pools) inherits it
        if config.serving.nice is not None:
            set_process_niceness(config.serving.nice)
    except CalibrlError as exc:
        return _fail(str(exc))
    apply_thread_policy(config.torch_threads, "judge server")  # before the models load: they size to it
    try:  # at the workers' niceness: the encoder's native threads inherit it (calibrl.threads)
        call_nicer(config.serving.compute_nice, _load_embedder_if_needed, config)
    except CalibrlError as exc:
        return _fail(str(exc))

    async def run() -> None:
        stop_requested = stop_on_signals()  # before the port is announced: a SIGTERM from then on drains
        running = await start(config)
        freeze_loaded_objects()
        print(f"judge server listening on {config.serving.host}:{running.port}", flush=True)
        await serve_until_signal(running, config.serving.grace_seconds, stop_requested, exit_watchdog=True)

    try:
        asyncio.run(run())
    except CalibrlError as exc:
        return _fail(str(exc))
    from calibrl.serving import exit_after_shutdown

    exit_after_shutdown(0)  # skips the slow interpreter teardown: exit within drain + grace + 1 s
    return 0


def _load_embedder_if_needed(config) -> None:
    """Load the judge's MiniLM encoder before serving when a rubric scores intent similarity,
    so its ONNX export and self-test run at start, not inside the first caller's Score (the
    judge then finds the same encoder: ``load_embedder`` keeps one per arguments)."""
    from calibrl.embedding import load_embedder
    from calibrl.judge_server import programmatic
    from calibrl.judge_server.rubric import load_rubric_dir

    judge = config.judge
    if judge.embedder != "minilm":
        return
    criteria = [c for rubric in load_rubric_dir(config.rubrics) for c in rubric.criteria if c.kind == "programmatic"]
    if any(programmatic.SCORERS[c.scorer].needs_embedder for c in criteria if c.scorer in programmatic.SCORERS):
        embedder = load_embedder(judge.embedder, judge.embedder_device, judge.embedder_backend,
                                 judge.embedder_cache_size)
        logging.getLogger(__name__).info("intent-similarity encoder: %s", embedder.describe())


def _server_config_cls() -> type:
    from calibrl.judge_server.config import JudgeServerConfig

    return JudgeServerConfig


# --------------------------------------------------------------------------- distill

def distill(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl rubric distill",
        description="Distil SME feedback (JSONL) into a rubric (YAML) and a golden hold-out set (JSONL). "
        "Deterministic: the same feedback gives the same files, byte for byte.",
    )
    parser.add_argument("--feedback", required=True, help="SME feedback JSONL (docs/guides/rubric-from-feedback.md)")
    parser.add_argument("--out", required=True, help="rubric YAML to write")
    parser.add_argument("--golden-out", required=True, help="golden hold-out JSONL to write")
    parser.add_argument("--id", help="rubric id (default: the feedback file's stem)")
    parser.add_argument("--version", default="1", help="rubric version (default 1)")
    parser.add_argument("--golden-fraction", type=float, default=0.3, help="share of records held out (0.3)")
    parser.add_argument("--criteria", choices=("both", "programmatic", "llm"), default="both",
                        help="criteria kinds for known tags (unknown tags always need an LLM)")
    parser.add_argument("--llm-share", type=float, default=0.5,
                        help="share of a tag's weight on its LLM criterion when it gets both kinds (0.5)")
    parser.add_argument("--min-count", type=int, default=2, help="least occurrences of a non-critical tag (2)")
    parser.add_argument("--critical", action="append", default=[], metavar="TAG",
                        help="extra critical tag, becomes a penalty criterion (repeatable)")
    parser.add_argument("--glossary", help="text file of domain terms, one a line")
    parser.add_argument("--field-map", default="", metavar="DOCUMENTED=THEIRS,...",
                        help="feedback written with other field names, e.g. grade=score,output=rewrite,"
                        "error_tags=issues (docs/guides/rubric-from-feedback.md)")
    args = parser.parse_args(argv)

    from calibrl.judge_server.authoring.distill import DistillOptions
    from calibrl.judge_server.authoring.distill import distill as run_distill
    from calibrl.judge_server.authoring.feedback import normalize_tag, parse_field_map, read_feedback, write_feedback
    from calibrl.judge_server.rubric import dump_rubric, parse_rubric

    try:
        records = read_feedback(args.feedback, parse_field_map(args.field_map))
        glossary: tuple[str, ...] = ()
        if args.glossary:
            path = pathlib.Path(args.glossary)
            if not path.is_file():
                return _fail(f"--glossary {path} does not exist")
            glossary = tuple(line.strip() for line in path.read_text().splitlines()
                             if line.strip() and not line.lstrip().startswith("#"))
        options = DistillOptions(
            rubric_id=args.id or _safe_id(pathlib.Path(args.feedback).stem), version=args.version,
            golden_fraction=args.golden_fraction, criteria_mode=args.criteria, llm_share=args.llm_share,
            min_count=args.min_count, critical_tags=tuple(normalize_tag(t) for t in args.critical),
            glossary=glossary,
        )
        result = run_distill(records, options)
        text = dump_rubric(result.rubric)
        parse_rubric(text, args.out)  # what we write must load
    except CalibrlError as exc:
        return _fail(str(exc))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text, encoding="utf-8")
    pathlib.Path(args.golden_out).parent.mkdir(parents=True, exist_ok=True)
    write_feedback(args.golden_out, result.golden)
    print(f"rubric {result.rubric.id} v{result.rubric.version} hash {result.rubric.hash}")
    print(f"  {len(records)} records: {len(result.train)} distilled, {len(result.golden)} golden -> {args.golden_out}")
    print(f"  baseline grade (error-free records): {result.baseline_grade:.2f}")
    print(f"  {'tag':<22} {'n':>4} {'freq':>6} {'mean':>5} {'drop':>5}  criteria")
    for s in result.tags:
        what = ", ".join(s.criteria) if s.criteria else f"left out: {s.skipped}"
        print(f"  {s.tag:<22} {s.count:>4} {s.frequency:>6.3f} {s.mean_grade:>5.2f} {s.severity:>5.2f}  "
              f"{what}{' [critical]' if s.critical else ''}")
    print(f"  criteria: " + ", ".join(f"{c.name}={c.weight:g}{'(penalty)' if c.penalty else ''}"
                                      for c in result.rubric.criteria))
    print(f"wrote {args.out}")
    return 0


def _safe_id(stem: str) -> str:
    import re

    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._") or "distilled"
    return cleaned[:128]


# --------------------------------------------------------------------------- validate

def validate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl rubric validate",
        description="Check a rubric + judge against the SME golden set and write a validation record "
        "(<rubric>.validation.json). Exit 0 when the gate passes, 1 when it fails, 2 on bad input.",
    )
    parser.add_argument("--rubric", required=True, help="rubric YAML")
    parser.add_argument("--golden", required=True, help="golden JSONL (from 'calibrl rubric distill')")
    parser.add_argument("--judge", required=True, help="judge SPEC: programmatic | transformers:PATH | vllm:PATH")
    parser.add_argument("--min-kappa", type=float, default=0.6, help="gate: least Cohen's kappa on pass/fail (0.6)")
    parser.add_argument("--pass-threshold", type=_threshold_arg, default=0.6, metavar="VALUE|auto",
                        help="judge pass = total >= this (0.6: the lower edge of judge grade 4); 'auto' picks "
                        "the best-kappa threshold on the non-golden records of --feedback (never the golden set)")
    parser.add_argument("--feedback", help="the feedback JSONL the rubric was distilled from (for "
                        "--pass-threshold auto; its golden records are left out)")
    parser.add_argument("--field-map", default="", metavar="DOCUMENTED=THEIRS,...",
                        help="read --feedback with other field names, e.g. grade=score,output=rewrite")
    parser.add_argument("--pass-grade", type=int, default=4,
                        help="expert pass = grade >= this, for records without a verdict (4)")
    parser.add_argument("--flag-threshold", type=float, default=0.5,
                        help="a criterion flags an item when its score is below this (0.5)")
    parser.add_argument("--min-items", type=int, default=10, help="least golden items for the gate to pass (10)")
    parser.add_argument("--gate", choices=("estimate", "lower-bound"), default="estimate",
                        help="what must reach --min-kappa: the kappa estimate (default), or the lower bound of its "
                        "95%% bootstrap interval (golden items resampled by query)")
    parser.add_argument("--config", help="YAML of judge options (JudgeConfig), e.g. embedder, device")
    parser.add_argument("--out", help="validation file (default: <rubric>.validation.json)")
    parser.add_argument("--no-record", action="store_true", help="print the report, write no record")
    parser.add_argument("overrides", nargs="*", help="JudgeConfig key=value overrides, e.g. embedder=hashed-ngrams")
    args = parser.parse_args(argv)

    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.rubric import load_rubric
    from calibrl.judge_server.authoring.feedback import parse_field_map
    from calibrl.judge_server.authoring.validation import ValidationOptions, validate_judge, validation_path, write_record

    try:
        config = load_config(JudgeConfig, args.config,
                             [*args.overrides, f"backend={args.judge}", "allow_unvalidated=true", "cache_size=0"])
        auto = args.pass_threshold == "auto"
        if auto and not args.feedback:
            return _fail("--pass-threshold auto needs --feedback FILE: the threshold is picked on the feedback "
                         "records that are not in the golden set")
        options = ValidationOptions(args.min_kappa, 0.6 if auto else args.pass_threshold, args.pass_grade,
                                    args.flag_threshold, args.min_items, gate=args.gate.replace("-", "_"))
        options.validate()
        calibration = read_feedback(args.feedback, parse_field_map(args.field_map)) if auto else None
        record = validate_judge(load_rubric(args.rubric), read_feedback(args.golden), config, options, calibration)
        choice = record.metrics.get("threshold_selection") if auto else None
        if choice:
            print(f"--pass-threshold auto: {record.pass_threshold:g} (kappa {_fmt(choice.get('kappa'))} on "
                  f"{choice.get('n_items', '?')} non-golden feedback records; the golden set was not used)")
    except CalibrlError as exc:
        return _fail(str(exc))
    if not args.no_record:
        out = pathlib.Path(args.out) if args.out else validation_path(args.rubric)
        write_record(out, record)
    print(json.dumps(_summary(record), indent=2))
    verdict = "PASSED" if record.passed else "FAILED"
    print(f"gate {verdict}: {record.reason} (rubric {record.rubric_id} hash {record.rubric_hash[:12]}, "
          f"judge {record.model_id}, {record.n_items} golden items)")
    if not args.no_record:
        print(f"validation record written to {out}")
    return 0 if record.passed else 1


def _threshold_arg(text: str) -> float | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number in [0, 1] or 'auto'") from None


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _summary(record) -> dict:
    m = record.metrics
    return {
        "passed": record.passed,
        "kappa": record.kappa,
        "kappa_95_interval": [record.kappa_low, record.kappa_high],
        "gate": record.gate,
        "min_kappa": record.min_kappa,
        "pass_threshold": record.pass_threshold,
        "pass_threshold_source": record.pass_threshold_source,
        "agreement": m["pass_fail"]["agreement"],
        "pass_fail_confusion(expert x judge, [pass, fail])": m["pass_fail"]["confusion"]["matrix"],
        "quadratic_weighted_kappa": m["grades"]["quadratic_weighted_kappa"],
        "spearman": m["grades"]["spearman"],
        "spearman_total": m["grades"]["spearman_total"],
        "criteria": {name: {k: v for k, v in c.items() if k in ("precision", "recall", "support")}
                     for name, c in m["criteria"].items()},
    }


# --------------------------------------------------------------------------- train-judge

def train_judge(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl rubric train-judge",
        description="Fine-tune a Hugging Face causal LM to answer a rubric's LLM criteria, on the training part "
        "of the SME feedback (never the golden part), with the exact prompts and answer tokens the transformers "
        "and vLLM judges score. Writes a model folder plus calibrl_judge.json; validate it with "
        "'calibrl rubric validate --judge transformers:OUT'.",
    )
    parser.add_argument("--feedback", required=True, help="SME feedback JSONL (the file the rubric was distilled from)")
    parser.add_argument("--rubric", required=True, help="rubric YAML with llm criteria")
    parser.add_argument("--base", required=True, help="Hugging Face causal LM folder to start from")
    parser.add_argument("--out", required=True, help="new folder for the trained model (must not exist or be empty)")
    parser.add_argument("--golden", help="golden JSONL whose records are excluded too (the distil split always is)")
    parser.add_argument("--golden-fraction", type=float, default=0.3,
                        help="the distil hold-out share used to cut the feedback (0.3, distil's default)")
    parser.add_argument("--criteria", action="append", default=[], metavar="NAME",
                        help="train only this llm criterion (repeatable; default: all of them)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training examples (3)")
    parser.add_argument("--lr", type=float, help="AdamW learning rate (default 2e-5, or 2e-4 with --lora)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per optimiser step (8)")
    parser.add_argument("--seed", type=int, default=0, help="shuffling and LoRA initialisation seed (0)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) and save merged weights")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (8)")
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (16)")
    parser.add_argument("--pass-grade", type=int, default=4,
                        help="expert pass = grade >= this, for records without a verdict (4)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, ...")
    parser.add_argument("--use-chat-template", choices=("auto", "true", "false"), default="auto",
                        help="as the judge's use_chat_template; serve with the same value (auto)")
    parser.add_argument("--max-docs", type=int, default=5, help="as the judge's max_docs (5)")
    parser.add_argument("--max-doc-chars", type=int, default=600, help="as the judge's max_doc_chars (600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from tqdm.auto import tqdm

    from calibrl.judge_server.authoring.train_judge import TrainJudgeOptions
    from calibrl.judge_server.authoring.train_judge import train_judge as run_training

    options = TrainJudgeOptions(
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed, lora=args.lora,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, golden_fraction=args.golden_fraction,
        pass_grade=args.pass_grade, criteria=tuple(args.criteria), device=args.device,
        use_chat_template=args.use_chat_template, max_docs=args.max_docs, max_doc_chars=args.max_doc_chars,
    )
    try:
        run_training(args.feedback, args.rubric, args.base, args.out, options, golden_path=args.golden,
                     progress=not args.no_progress, echo=lambda line: tqdm.write(line, file=sys.stdout))
    except CalibrlError as exc:
        return _fail(str(exc))
    return 0
