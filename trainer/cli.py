"""`calibrl train` and `calibrl eval`.

    calibrl train --config configs/rewriter_grpo.yaml steps=20 optimizer.lr=1e-5
    calibrl train --config run.yaml --resume runs/rewriter            # continue the latest checkpoint
    calibrl train --print-config                                      # every field, default and doc
    torchrun --nproc_per_node 2 -m calibrl train --config run.yaml    # several processes

    calibrl eval --model runs/rewriter --model base/ --tasks heldout.jsonl --retrieval 127.0.0.1:50051
    calibrl eval --run-dir runs/rewriter --tasks heldout.jsonl --retrieval 127.0.0.1:50051   # table -> its trackers

This module only parses arguments and builds the service clients the loop
receives (gRPC clients, or in-process ones over a local index and rubric
folder); heavy imports happen after parsing, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import sys
import typing
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from calibrl.errors import CalibrlError, ConfigError
from calibrl.trainer.task_kinds import TASK_KINDS, record_formats

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.clients import JudgeClient, RetrievalClient
    from calibrl.trainer.config import ServicesConfig

log = logging.getLogger(__name__)


# =============================================================================== clients


def make_clients(services: "ServicesConfig", background: "BackgroundLoop | None" = None) -> tuple[
        "RetrievalClient", "JudgeClient | None", Callable[[], Awaitable[None]]]:
    """``(retrieval, judge, close)`` for a :class:`~calibrl.trainer.config.ServicesConfig`.

    gRPC targets become :mod:`calibrl.trainer.grpc_clients` clients (deadline, retries,
    API key, TLS); ``inprocess`` loads the index / rubric folder into this process.
    ``judge`` is None for ``services.judge=none``. ``close()`` is a coroutine
    function that closes the channels (run it on the loop that used them)."""
    # lazy: config imports the judge server; the CLI starts without it
    from calibrl.trainer.config import INPROCESS, NO_JUDGE

    knobs: dict[str, object] = {"timeout_s": services.timeout_s, "max_attempts": services.max_attempts}
    api_key = services.api_key or os.environ.get("CALIBRL_API_KEY", "")
    if api_key:
        knobs["metadata"] = (("authorization", f"Bearer {api_key}"),)
    if services.tls_ca_file:
        # lazy: security imports grpc; the CLI starts without it
        from calibrl.security import channel_credentials

        knobs["channel_credentials"] = channel_credentials(services.tls_ca_file)

    closers = []
    if services.retrieval == INPROCESS:
        # lazy: retriever imports the retrieval server; the CLI starts without them
        from calibrl.retrieval_server.retriever import Retriever
        from calibrl.trainer.inprocess import InProcessRetrievalClient

        retrieval = InProcessRetrievalClient(Retriever.load(services.index_dir, device=services.inprocess_device))
    else:
        # lazy: grpc_clients imports grpc; the CLI starts without it
        from calibrl.trainer.grpc_clients import GrpcRetrievalClient

        retrieval = GrpcRetrievalClient(services.retrieval, **knobs)
        closers.append(retrieval.close)

    judge = None
    if services.judge == INPROCESS:
        # lazy: judge imports grpc and the judge server; the CLI starts without them
        from calibrl.judge_server.judge import Judge
        from calibrl.trainer.inprocess import InProcessJudgeClient

        judge = InProcessJudgeClient(Judge.from_config(services.inprocess_judge, services.rubric_dir))
    elif services.judge != NO_JUDGE:
        # lazy: grpc_clients imports grpc; the CLI starts without it
        from calibrl.trainer.grpc_clients import GrpcJudgeClient

        judge = GrpcJudgeClient(services.judge, **knobs)
        closers.append(judge.close)

    async def close() -> None:
        for closer in closers:
            await closer()

    return retrieval, judge, close


# =============================================================================== train


def describe_config() -> str:
    """Every field of TrainConfig, ``key = default  # doc``, both advantage variants included."""
    # lazy: config imports the judge server; the CLI starts without them
    from calibrl.config import describe
    from calibrl.trainer.config import TrainConfig

    lines = []
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        hint = hints[f.name]
        variants = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint):
            lines.append(f"# {f.name}: {f.metadata.get('doc', '')}")
            lines.extend(describe(hint, f.name + "."))
        elif variants:
            lines.append(f"# {f.name}: {f.metadata.get('doc', '')} One of (chosen by {f.name}.type):")
            for variant in variants:
                lines.append(f"#   {variant.__name__}: {(variant.__doc__ or '').strip().splitlines()[0]}")
                lines.extend("  " + line for line in describe(variant, f.name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"{f.name} = {default!r}  # {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def train(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl train",
        description="GRPO / CalibAdv training of a query rewriter or a multi-step search agent against the "
        "retrieval and judge services. Every config field can be overridden as key=value "
        "(see --print-config). Under torchrun every rank runs this command.",
    )
    parser.add_argument("--config", help="YAML config file (fields: calibrl train --print-config)")
    parser.add_argument("--resume", help="checkpoint folder, or a run's output_dir to take its latest checkpoint")
    parser.add_argument("--print-config", action="store_true", help="print every field with its default and doc")
    parser.add_argument("--print-resolved", action="store_true", help="print the loaded config as YAML and exit")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optimizer.lr=1e-5 steps=10")
    args = parser.parse_args(argv)

    if args.print_config:
        print(describe_config())
        return 0
    _setup_logging(args.log_level)
    # lazy: config imports the judge server; the CLI starts without it
    from calibrl.trainer.config import load_train_config

    try:
        config = load_train_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.print_resolved:
        print(config.to_yaml(), end="")
        return 0

    # lazy: loop imports the judge server; the CLI starts without them
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.loop import train as run_training

    try:
        retrieval, judge, close = make_clients(config.services)
    except CalibrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    with BackgroundLoop(name="calibrl-services") as background:
        try:
            result = run_training(config, retrieval=retrieval, judge=judge, resume=args.resume, background=background)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        except CalibrlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            background.run(close())
    print(f"{result.stopped}: {result.steps_done} steps; checkpoint {result.last_checkpoint}", file=sys.stderr)
    if result.heldout:
        # lazy: CLI start-up (`--help` imports only what it needs)
        from calibrl.trainer.heldout import HELDOUT_FILE, format_heldout

        print(f"held-out ({config.run_dir / HELDOUT_FILE}):\n{format_heldout(result.heldout)}", file=sys.stderr)
    return 0


# =============================================================================== eval


def _eval_parser() -> argparse.ArgumentParser:
    """The arguments of ``calibrl eval``."""
    parser = argparse.ArgumentParser(
        prog="calibrl eval",
        description="Held-out evaluation, greedy decoding: a query rewriter's retrieval accuracy (hit@k, "
        "all-gold@k, recall@k, MRR, nDCG@k through the retrieval service) or a search agent's answer EM/F1. "
        "Several --model values are evaluated on the same tasks and printed side by side.",
    )
    parser.add_argument("--model", action="append", default=[],
                        help="policy folder, LoRA adapter folder, checkpoint folder or run dir (repeatable); "
                        "with --run-dir, default: every checkpoint of that run")
    parser.add_argument("--name", action="append", default=[], help="row label of each --model, in order")
    parser.add_argument("--tasks", required=True, help="JSONL tasks file")
    parser.add_argument("--format", default="auto", choices=["auto", *record_formats()])
    parser.add_argument("--kind", default="auto", choices=["auto", *TASK_KINDS])
    parser.add_argument("--heldout-fraction", type=float, default=0.0,
                        help="evaluate only the held-out part of a split made like training's (tasks.heldout_fraction)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of that split (the training seed)")
    parser.add_argument("--limit", type=int, default=0, help="evaluate the first N tasks only (0 = all)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--retrieval", help="retrieval service target host:port")
    target.add_argument("--index", help="index folder, searched in-process")
    parser.add_argument("--top-k", type=int, default=5, help="cut-off k of the retrieval metrics (default 5)")
    parser.add_argument("--mode", choices=["dense", "bm25", "hybrid"], default=None, help="retrieval mode")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per rewrite / per search turn")
    parser.add_argument("--max-turns", type=int, default=4, help="search agent: turns per trajectory")
    parser.add_argument("--search-top-k", type=int, default=3, help="search agent: documents per search")
    parser.add_argument("--batch-size", type=int, default=32, help="tasks generated together")
    parser.add_argument("--raw-query-baseline", action="store_true",
                        help="rewrite tasks: add a row that sends the original query unchanged")
    parser.add_argument("--prompt-template", metavar="TEXT_OR_@FILE", default=None,
                        help="prompt of every model: template text with {query} (and optionally {context}), or "
                        "@FILE; '' = the built-in one. Default: each checkpoint's training template (its "
                        "config.yaml), the built-in one for a base model")
    parser.add_argument("--chat-template", choices=["auto", "on", "off"], default=None,
                        help="wrap prompts in the tokenizer's chat template (auto: when it has one). Default: each "
                        "checkpoint's training choice, auto for a base model")
    parser.add_argument("--device", default="auto", help="policy device (default auto)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sme-items", metavar="FILE",
                        help="also write each model's outputs as items for 'calibrl sme sample' (docs/guides/sme-review.md)")
    parser.add_argument("--run-dir", metavar="RUN",
                        help="a `calibrl train` output_dir: add the results, one row per checkpoint of it, as a table "
                        "to the run's own tracker runs (ids in RUN/trackers.json; nothing they hold is dropped)")
    parser.add_argument("--report-to", metavar="TRACKERS",
                        help="with --run-dir: which of the run's trackers get the table, comma-separated "
                        "(default: every tracker the run logged to)")
    parser.add_argument("--table", default="heldout", help="with --run-dir: the table's name (default heldout)")
    parser.add_argument("--api-key", default="", help="API key for the retrieval service (or CALIBRL_API_KEY)")
    parser.add_argument("--log-level", default="WARNING")
    return parser


def evaluate(argv: Sequence[str]) -> int:
    args = _eval_parser().parse_args(argv)
    _setup_logging(args.log_level)

    # lazy: config imports the judge server; the CLI starts without them
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.config import ServicesConfig, resolve_prompt_template
    from calibrl.trainer.eval import EvalSettings, evaluate_models, format_table, load_eval_tasks

    try:
        steps, trackers, project = _run_dir_target(args)
    except CalibrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.model:
        print("error: give --model (or --run-dir to evaluate a training run's checkpoints)", file=sys.stderr)
        return 2
    if args.name and len(args.name) != len(args.model):
        print(f"error: {len(args.name)} --name for {len(args.model)} --model; give one per model or none",
              file=sys.stderr)
        return 2
    try:
        prompt_template = None
        if args.prompt_template is not None:
            prompt_template = resolve_prompt_template(args.prompt_template, "--prompt-template")
        tasks = load_eval_tasks(args.tasks, fmt=args.format, kind=args.kind, heldout_fraction=args.heldout_fraction,
                                seed=args.split_seed, limit=args.limit)
        settings = EvalSettings(
            top_k=args.top_k, mode=args.mode, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
            search_top_k=args.search_top_k, batch_size=args.batch_size, device=args.device,
        )
        services = ServicesConfig(
            retrieval=args.retrieval or "inprocess", judge="none", index_dir=args.index or "", api_key=args.api_key,
            inprocess_device="cpu" if args.device == "cpu" else "auto",
        )
        retrieval, _, close = make_clients(services)
    except CalibrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with BackgroundLoop(name="calibrl-eval") as background:
        try:
            rows = evaluate_models(args.model, tasks, retrieval, settings, run_async=background.run,
                                   names=args.name or None, raw_query_baseline=args.raw_query_baseline,
                                   prompt_template=prompt_template, chat_template=args.chat_template)
            if args.run_dir:
                # lazy: CLI start-up (`--help` imports only what it needs)
                from calibrl.trainer.eval_report import log_to_run

                model_rows = rows[len(rows) - len(args.model):]  # the raw-query row has no step
                log_to_run(args.run_dir, [(s, r.metrics) for s, r in zip(steps, model_rows)], trackers, project,
                           table=args.table)
                print(f"table {args.table!r} ({len(steps)} rows) added to the run's trackers: "
                      f"{', '.join(trackers) or 'none'}", file=sys.stderr)
            if args.sme_items:  # SME review: the outputs as sample-input items (calibrl/sme/eval_items.py)
                # lazy: eval_items imports the judge server; the CLI starts without it
                from calibrl.sme.eval_items import write_eval_items

                print(write_eval_items(args.sme_items, args.model, tasks, retrieval, settings, run_async=background.run,
                                       names=args.name or None, prompt_template=prompt_template,
                                       chat_template=args.chat_template))
        except CalibrlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            background.run(close())
    print(format_table(rows))
    if args.out:
        payload = {"tasks": args.tasks, "num_tasks": len(tasks), "settings": settings.as_dict(),
                   "results": [row.as_dict() for row in rows]}
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


def _run_dir_target(args: argparse.Namespace) -> tuple[list[int], list[str], str]:
    """With ``--run-dir``, checked before anything is evaluated: each ``--model``'s step
    (default models: every checkpoint of the run), the trackers that get the table and
    the run's tracking project. Without it: nothing (and ``--report-to`` is an error)."""
    if not args.run_dir:
        if args.report_to is not None:
            raise ConfigError("--report-to needs --run-dir (the training run whose tracker runs get the table)")
        return [], [], ""
    # lazy: CLI start-up (`--help` imports only what it needs)
    from calibrl.trainer.eval_report import checkpoint_step, run_checkpoints, run_trackers

    args.model = args.model or [str(p) for p in run_checkpoints(args.run_dir)]
    steps = [checkpoint_step(model, args.run_dir) for model in args.model]
    trackers, project = run_trackers(args.run_dir, args.report_to.split(",") if args.report_to is not None else None)
    return steps, trackers, project


def _setup_logging(level: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")
