"""`calibrl demo`: the whole loop on the built-in domain, with nothing downloaded.

    calibrl demo                   # about 7-10 minutes on two CPU cores
    calibrl demo --quick           # a smoke run of every stage with few steps: 1-2 minutes
    calibrl demo --out DIR         # where everything goes (default calibrl_demo_out/)

Stages, in order (each prints what it did; the report lists their times):

1. generate the domain (corpus, tasks, two-search questions, SME feedback, glossary);
2. ``calibrl rubric distill`` the SME feedback into a rubric and a golden set;
3. ``calibrl rubric validate`` the rubric + programmatic judge on the golden set;
   then build the LLM judge (tokenizer, warm start, ``calibrl rubric train-judge`` on
   the training reviews) and validate its rubric with ``--judge transformers:...``;
4. ``calibrl index build`` the corpus (dense MiniLM + BM25);
5. start ``calibrl serve retrieval`` and ``calibrl serve judge`` as subprocesses on
   loopback and wait for their gRPC health checks (one judge server for every rubric:
   the LLM one, the programmatic one and the search agent's step rubric);
6. build the tiny policies (tokenizer, model, supervised warm start); the search
   agent's reference observations come from the retrieval service;
7. evaluate the untrained bases on held-out tasks;
8. train the rewriter with GRPO three times, binary hit@1 reward, binary + dynamic
   sampling, and the blended dense reward (0.7 MRR@10 + 0.3 rubric, the LLM rubric when
   it passed its gate), and the search agent three times, GRPO, CalibAdv with gold documents
   as silver and CalibAdv with the authors' silver documents (its search steps scored on the
   step rubric): the dense rewriter and the GRPO search agent first, as two
   ``calibrl train`` processes at once (two agents, two rubrics, one judge server), then
   the other four; each run's metrics are what it gives alone;
9. evaluate every checkpoint on held-out tasks (the table goes into each run's own
   tracker runs); write the table, plots and report, with when each run trained and
   what the judge server did per rubric while the two agents ran at once.

The stages are typed functions with frozen hand-offs: 1-5 in :mod:`calibrl.demo.preparation`,
6-9 in :mod:`calibrl.demo.training`, the report's judge part here; :func:`run_demo` lists
them in order. The training runs are data (:data:`calibrl.demo.arms.ARMS`), the sizes
:mod:`calibrl.demo.settings`. Stages 2-4 and 6-9 call the library in this process (the functions behind the CLI
commands: ``calibrl.judge_server.authoring.distill``, ``calibrl.judge_server.authoring.validation``, ``calibrl.retrieval_server.index``,
``calibrl.trainer.loop.train``, ``calibrl.trainer.eval``); the services are the real servers, and
two training runs the real ``calibrl train``, each in its own process, reaching the services
over gRPC.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import sys
import time
from typing import TYPE_CHECKING, Sequence

from calibrl import kernels
from calibrl.demo.arms import DYNAMIC_SAMPLING_COMPARISON, arms_of
from calibrl.demo.context import DemoError, RunContext, Stages, log_to_file, machine_description
from calibrl.demo.preparation import (Generated, Rubrics, Served, Stoppable, build_demo_index, build_llm_judge,
                                      distill_rubric, validate_rubric)
from calibrl.demo.settings import (CONCURRENT_PAIR, DEFAULT_SEED, FULL, GATE, MARKER, OTHER_RUNS, PASS_THRESHOLD,
                                   QUICK, RETRIEVAL_MODE, REWRITE_ARMS, RUBRIC_ID, SEARCH_ARMS, STEP_RUBRIC,
                                   STEP_RUBRIC_ID, DemoSettings)
from calibrl.demo.training import Clients, Concurrency, rewrite_clusters, search_aspects
from calibrl.errors import CalibrlError

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.judge_model import JudgeModel
    from calibrl.demo.judge_report import RubricServerStats
    from calibrl.demo.report import DemoReport, RunResult
    from calibrl.judge_server.validation_records import ValidationRecord


# --- the run --------------------------------------------------------------------------------------------------------


def run_demo(settings: DemoSettings, out: pathlib.Path, *, seed: int = DEFAULT_SEED, threads: int = 1, progress: bool = True,
             command: str = "calibrl demo", report_to: Sequence[str] = ("tensorboard",)) -> pathlib.Path:
    """Run every stage; returns the path of report.md. ``report_to``: the experiment
    trackers each training run logs to (project calibrl-demo, one run per training run)."""
    from calibrl.demo import preparation as prep

    run = _start(settings, out, seed, threads, progress, command, report_to)
    started: list[Stoppable] = []  # every subprocess, stopped on the way out
    try:
        generated = prep.generate(run)
        index_build = prep.start_index_build(run, generated)
        started.append(index_build)
        rubrics = prep.distil(run, generated)
        validation = prep.validate(run, generated, rubrics)
        judge_model = prep.llm_judge(run, generated, rubrics)
        prep.join_index(run, index_build)
        served = prep.serve(run, rubrics, judge_model, not validation.passed, started)
        report, sme_section = _train_evaluate_and_study(run, generated, rubrics, validation, judge_model, served)
    finally:
        for service in started:
            service.stop()
    return _write_report(run, report, sme_section)


def _start(settings: DemoSettings, out: pathlib.Path, seed: int, threads: int, progress: bool, command: str,
           report_to: Sequence[str]) -> RunContext:
    """The output folder (marked as a demo's), the log file and the run's context."""
    import torch

    torch.set_num_threads(max(1, threads))
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(f"{command}\n", encoding="utf-8")
    (out / "logs").mkdir(exist_ok=True)
    log_to_file(out / "logs" / "demo.log")
    return RunContext(settings=settings, out=out, seed=seed, progress=progress, report_to=tuple(report_to),
                      command=command, machine=machine_description(), stages=Stages(total=12))


def _train_evaluate_and_study(run: RunContext, generated: Generated, rubrics: Rubrics, validation: "ValidationRecord",
                              judge_model: "JudgeModel", served: Served) -> tuple["DemoReport", str]:
    """Stages 6-9 and the SME-time study, over gRPC clients of both services; the report
    (less its stage times) and the study's Markdown section."""
    from calibrl.demo import training
    from calibrl.demo.judge_model import LLM_RUBRIC_ID
    from calibrl.trainer.aio import BackgroundLoop

    dense_rubric = LLM_RUBRIC_ID if judge_model.validation.passed else RUBRIC_ID
    with BackgroundLoop(name="calibrl-demo") as background:
        clients = Clients(served.retrieval.target, served.judge.target, background)
        try:
            report = training.train_and_evaluate(run, generated.domain, generated.files, clients,
                                                 dense_rubric=dense_rubric, metrics_port=served.metrics_port)
            sme_section = _sme_study(run, generated, clients)
            add_judge_sections(report, {"programmatic judge": validation, "LLM judge": judge_model.validation},
                               judge_model, dense_rubric, served.metrics_port, rubrics.folder, run.out)
        finally:
            clients.close()
    report.command = run.command
    report.machine = run.machine
    report.notes = _gate_notes(validation, judge_model) + report.notes
    report.settings = {**report.settings,
                       f"validation kappa (judge pass = total >= {validation.pass_threshold:g}, picked on the "
                       f"non-golden reviews)": f"{validation.kappa_text()} on {validation.n_items} items"}
    return report, sme_section


def _gate_notes(validation: "ValidationRecord", judge_model: "JudgeModel") -> list[str]:
    notes = []
    if not validation.passed:
        notes.append("The rubric FAILED its validation gate in this run; the judge was started with "
                     "--allow-unvalidated so the demo could go on. Do not trust its rewards.")
    if not judge_model.validation.passed:
        notes.append(f"The LLM rubric FAILED its validation gate ({judge_model.validation.reason}); the "
                     f"dense reward used the programmatic rubric {RUBRIC_ID} instead.")
    return notes


def _sme_study(run: RunContext, generated: Generated, clients: Clients) -> str:
    """The SME-time experiment (:mod:`calibrl.studies.sme_time`) on the demo's domain and retrieval service."""
    with run.stages.stage("SME time: validation kappa vs expert reviews, representative vs random sampling"):
        from calibrl.studies.sme_time import run_demo_study

        return run_demo_study(
            generated.domain, lambda qs: [[h.doc_id for h in hits] for hits in clients.search_many(qs, 1)], run.out,
            seed=run.seed, quick=run.settings.quick, progress=lambda line: print(f"    {line}"))


def _write_report(run: RunContext, report: "DemoReport", sme_section: str) -> pathlib.Path:
    """The last stage: report.md, results.json and the plots."""
    from calibrl.demo import report as rep

    with run.stages.stage("write the report"):
        report.stages = list(run.stages.done)
        path = rep.write_report(report, run.out)
        path.write_text(path.read_text(encoding="utf-8") + "\n" + sme_section, encoding="utf-8")
        rep.print_tables(report)
        print(f"\n    report: {path}\n    plots:  {run.out / 'plots'}\n    results: {run.out / 'results.json'}")
    return path


# --- the report's judge part ----------------------------------------------------------------------------------------


def add_judge_sections(report: "DemoReport", validations: dict[str, "ValidationRecord"], judge_model: "JudgeModel",
                       dense_rubric: str, metrics_port: int, rubrics: pathlib.Path, out: pathlib.Path) -> None:
    """The report's judge part (:mod:`calibrl.demo.judge_report`): both validations side by
    side, which judge scored which run, the server's per-rubric figures, the
    judge/retrieval disagreement plot and the dynamic-sampling verdict."""
    from calibrl.demo import judge_report as jr
    from calibrl.demo.experts import panel_agreement, read_panel
    from calibrl.judge_server.rubric import load_rubric_dir

    served = {r.id: ("LLM judge " + judge_model.model_id if r.llm_criteria else "programmatic criteria")
              for r in load_rubric_dir(rubrics)}
    panel = panel_agreement(read_panel(out / "data" / "sme_panel.jsonl"))
    lines = jr.validation_section(validations, min(v.min_kappa for v in validations.values()), panel)
    lines += ["Which judge scored which run: " + "; ".join(_scored_by(report, dense_rubric, served)) + ".", ""]
    stats: dict[str, RubricServerStats] = {}
    if metrics_port:
        try:
            stats = jr.scrape_judge_stats(metrics_port)
        except OSError as exc:
            report.notes.append(f"The judge server's /metrics could not be read ({exc}); no per-rubric figures.")
        lines += jr.server_section(stats, served, _callers(report, dense_rubric))
    concurrency = report.concurrency
    if concurrency is not None:
        labels = {r.name: f"{r.name}: {r.label}" for r in [*report.rewrite_runs, *report.search_runs]}
        lines += jr.concurrency_section(concurrency.spans, CONCURRENT_PAIR, labels, concurrency.during_pair)
    if not metrics_port:
        report.notes.append("The judge server's per-rubric calls, batch sizes and cache hits come from its Prometheus "
                            "/metrics, which needs the prometheus extra: pip install 'calibrl[prometheus]'.")
    report.judge_sections = lines + _reward_lines(report, out)
    report.judge_results = {
        "validation": jr.validation_rows(validations),
        "dense_rubric": dense_rubric,
        "served": served,
        "server": {rubric_id: entry.to_json() for rubric_id, entry in stats.items()},
        "judge_model_seconds": {k: round(v, 2) for k, v in judge_model.seconds.items()},
        **(_concurrency_json(concurrency) if concurrency is not None else {}),
    }


def _step_callers(report: "DemoReport") -> list[str]:
    """The runs whose search steps the step rubric scored."""
    return [r.name for r in report.search_runs if any("steps/reward/mean" in s for s in r.steps)]


def _callers(report: "DemoReport", dense_rubric: str) -> dict[str, list[str]]:
    """Rubric id -> the runs that called the judge server with it."""
    judged = [arm.name for arm in arms_of("rewrite") if arm.judged]
    callers = {dense_rubric: judged}
    if _step_callers(report):
        callers[STEP_RUBRIC_ID] = _step_callers(report)
    return callers


def _scored_by(report: "DemoReport", dense_rubric: str, served: dict[str, str]) -> list[str]:
    """One phrase per rewriter run (what scored it), then one for the search-agent runs."""
    runs = {r.name: r for r in report.rewrite_runs}
    scored_by = [f"{runs[arm.name].label}: rubric {dense_rubric}, {served.get(dense_rubric, '?')}" if arm.judged
                 else f"{runs[arm.name].label}: no judge (retrieval only)"
                 for arm in arms_of("rewrite") if arm.name in runs]
    step_callers = _step_callers(report)
    scored_by.append(f"the search-agent runs ({', '.join(step_callers)}): trained on answer F1 x format; each "
                     f"search step scored by rubric {STEP_RUBRIC_ID} (programmatic criteria) and retrieval, logged "
                     "as steps/* with weight 0" if step_callers else "the search-agent runs: no judge (answer F1)")
    return scored_by


def _reward_lines(report: "DemoReport", out: pathlib.Path) -> list[str]:
    """Markdown: the judge/retrieval disagreement of the judged runs, and the dynamic-sampling verdict."""
    from calibrl.demo import judge_report as jr
    from calibrl.trainer.diagnostics import HealthConfig

    judged = {arm.name for arm in arms_of("rewrite") if arm.judged}
    runs: dict[str, RunResult] = {r.name: r for r in report.rewrite_runs}
    band = HealthConfig().max_judge_retrieval_disagreement
    dense_runs = [r for r in report.rewrite_runs if r.name in judged]
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    path = jr.plot_disagreement(dense_runs, band, plots / "rewrite_judge_retrieval_disagreement.png")
    lines = ["## Judge vs retrieval", ""] + [f"- {line}" for line in jr.disagreement_lines(dense_runs, band)]
    if path:
        lines += ["", f"![Judge vs retrieval disagreement](plots/{path.name})"]
    lines += ["", "## Does dynamic sampling rescue the binary reward?", ""]
    compared = [runs.get(name) for name in DYNAMIC_SAMPLING_COMPARISON]
    lines += [f"- {line}" for line in jr.dynamic_sampling_lines(*compared, report.top_k,
                                                                 report.rewrite_analysis)] + [""]
    return lines


def _concurrency_json(concurrency: Concurrency) -> dict[str, object]:
    """results.json: when each training process ran and the server's figures while the pair did."""
    from calibrl.demo.services import overlap_seconds

    spans = concurrency.spans
    pair = [spans[n] for n in CONCURRENT_PAIR if n in spans]
    return {
        "training_processes": {name: span.to_json() for name, span in spans.items()},
        "pair": list(CONCURRENT_PAIR),
        "pair_overlap_s": round(overlap_seconds(*pair), 2) if len(pair) == 2 else None,
        "server_during_pair": ({r: e.to_json() for r, e in concurrency.during_pair.items() if e.calls}
                               if concurrency.during_pair is not None else None),
    }


# --- entry point ----------------------------------------------------------------------------------------------------


def prepare_out(out: pathlib.Path, overwrite: bool) -> str | None:
    """Empty ``out`` for a new run; the reason it may not, or None. An earlier demo run
    (it leaves a marker file) is replaced; any other non-empty folder needs ``overwrite``."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    if out.exists() and any(out.iterdir()):
        if not (overwrite or (out / MARKER).exists()):
            return (f"--out {out} is not empty and holds no earlier demo run; pass --overwrite to replace it, "
                    "or choose another folder")
        shutil.rmtree(out)
    return None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl demo",
        description="Run the whole loop on the built-in domain, with nothing downloaded: distil a rubric from "
        "simulated SME feedback, validate it, build, train and validate a tiny LLM judge, build the index, start "
        "both services on loopback, warm-start a tiny policy, train it with GRPO (binary vs binary + dynamic "
        "sampling vs blended dense reward; GRPO vs CalibAdv with gold and with the authors' silver documents), "
        "evaluate, and write a report with plots.",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run with few steps (under 3 minutes)")
    parser.add_argument("--out", default="calibrl_demo_out", help="output folder (default: calibrl_demo_out)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"seed of the domain, the models and training ({DEFAULT_SEED}: a seed no design "
                             "choice was made on; see experiments/LOG.md)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the demo process; each service and training process gets one "
                        "(default 1)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out even if it holds something other than an earlier demo run")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--native-kernels", action="store_true",
                        help="run torch with this CPU's fastest float kernels instead of kernels pinned to AVX2 "
                        "(calibrl.kernels); trained figures then depend on the CPU")
    parser.add_argument("--report-to", default="tensorboard", metavar="TRACKERS",
                        help="experiment trackers of the six training runs, comma-separated: tensorboard, wandb, "
                        "mlflow, trackio, or none (default tensorboard); project calibrl-demo, one run per "
                        "training run, with its held-out table")
    args = parser.parse_args(list(argv) if argv is not None else None)

    pinned = kernels.pin(native=args.native_kernels)  # before torch loads (calibrl.kernels)
    print(f"float kernels: {pinned.reason}")
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)
    if args.threads < 1:
        print(f"error: --threads={args.threads}: must be >= 1", file=sys.stderr)
        return 2
    from calibrl.tracking import check_report_to

    try:
        report_to = check_report_to(args.report_to.split(","), field="--report-to")
    except CalibrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    problem = prepare_out(out, args.overwrite)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    settings = QUICK if args.quick else FULL
    command = ("calibrl demo" + (" --quick" if args.quick else "")
               + (f" --seed {args.seed}" if args.seed != DEFAULT_SEED else ""))
    started = time.perf_counter()
    if args.no_progress:
        from calibrl.retrieval_server.cli import hide_library_progress_bars

        hide_library_progress_bars()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # stop the children and services on the way out
    try:
        run_demo(settings, out, seed=args.seed, threads=args.threads, progress=not args.no_progress,
                 command=command, report_to=report_to)
    except CalibrlError as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndemo interrupted: training processes and services stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"\ncalibrl demo ({settings.name}) finished in {time.perf_counter() - started:.0f}s")
    return 0


# The demo's settings and stage functions, importable from its entry point as before the split.
__all__ = ["CONCURRENT_PAIR", "DEFAULT_SEED", "DemoError", "DemoSettings", "FULL", "GATE", "MARKER", "OTHER_RUNS",
           "PASS_THRESHOLD", "QUICK", "RETRIEVAL_MODE", "REWRITE_ARMS", "RUBRIC_ID", "SEARCH_ARMS", "STEP_RUBRIC",
           "STEP_RUBRIC_ID", "add_judge_sections", "build_demo_index", "build_llm_judge", "distill_rubric",
           "machine_description", "main", "prepare_out", "rewrite_clusters", "run_demo", "search_aspects",
           "validate_rubric"]
