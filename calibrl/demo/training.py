"""Stages 6-9 of ``calibrl demo``: the base policies, their held-out evaluation, every arm's
training (:data:`calibrl.demo.arms.ARMS`) and the held-out evaluation of its checkpoints.

Each stage is a function that takes what the stages before it made and returns a frozen
hand-off (:class:`HeldOut`, :class:`BaseEvaluation`, :class:`TrainingTimes`,
:class:`CheckpointEvaluation`); :func:`train_and_evaluate` runs them in order and
assembles the report's runs. The stages read arms as data: the agent an arm trains picks
its base policy, its tasks and its shared overrides; the arm adds its own.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from calibrl.demo.arms import AGENTS, ARMS, Agent, AgentKind, Arm, arm_fields, labels
from calibrl.demo.search_design import RECORDED_FORWARD, describe_design
from calibrl.demo.search_design import eval_settings as search_eval_settings
from calibrl.demo.search_design import train_overrides as search_train_overrides
from calibrl.demo.settings import (CONCURRENT_PAIR, RETRIEVAL_MODE, RUBRIC_ID, STEP_RUBRIC, STEP_RUBRIC_ID,
                                   EVAL_THREADS, WARM_THREADS, DemoSettings)
from calibrl.demo.context import DemoError, RunContext

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.api.retrieval import Hit
    from calibrl.demo.domain import Domain, DomainFiles
    from calibrl.demo.error_analysis import SearchRecord
    from calibrl.demo.judge_report import RubricServerStats
    from calibrl.demo.policy import BasePolicies
    from calibrl.demo.report import DemoReport, RunResult
    from calibrl.demo.services import RunSpan
    from calibrl.tracking import Tracker
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.eval import EvalResult, EvalSettings
    from calibrl.trainer.tasks import Task

Curve = list[tuple[int, dict[str, float]]]  # (checkpoint step, held-out metrics)


class Clients:
    """gRPC clients of the two services, bound to the demo's background event loop, and
    their targets (what the training processes reach)."""

    def __init__(self, retrieval_target: str, judge_target: str, background: "BackgroundLoop") -> None:
        from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient

        self.background = background
        self.retrieval_target = retrieval_target
        self.judge_target = judge_target
        self.retrieval = GrpcRetrievalClient(retrieval_target, timeout_s=60.0)
        self.judge = GrpcJudgeClient(judge_target, timeout_s=60.0)

    def search_many(self, queries: Sequence[str], top_k: int) -> list[list["Hit"]]:
        from calibrl.api.retrieval import SearchMode

        results: list[list[Hit]] = []
        for start in range(0, len(queries), 128):
            chunk = list(queries[start : start + 128])
            results += self.background.run(
                self.retrieval.search(chunk, top_k, SearchMode(RETRIEVAL_MODE), include_text=True))
        return results

    def close(self) -> None:
        for client in (self.retrieval, self.judge):
            with contextlib.suppress(Exception):
                self.background.run(client.close(), timeout=10)


# --- hand-offs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeldOut:
    """The held-out tasks of both agents and how each is decoded."""

    rewrites: list["Task"]
    search: list["Task"]
    rewrite_eval: "EvalSettings"
    search_eval: "EvalSettings"


@dataclass(frozen=True)
class BaseEvaluation:
    """Stage 7: the raw query, the untrained rewriter and the untrained search agent."""

    raw: Mapping[str, float]  # the raw query's held-out retrieval metrics (no rewrite)
    base: Mapping[str, float]  # the base rewriter's
    base_agent: Mapping[str, float]  # the base search agent's summary metrics
    rewrite_hits: dict[str, list[float]]  # task-by-task hits: raw, base
    search_records: dict[str, list["SearchRecord"]]  # question by question: base_agent

    def of(self, agent: Agent) -> Mapping[str, float]:
        """The untrained base's metrics for ``agent``."""
        return {"rewrite": self.base, "search": self.base_agent}[agent.kind]


@dataclass
class Concurrency:
    """The training stage: when and where each run trained, and the judge server's per-rubric
    figures while both runs of ``CONCURRENT_PAIR`` ran (None without /metrics)."""

    spans: dict[str, "RunSpan"]
    during_pair: dict[str, "RubricServerStats"] | None = None  # rubric id -> its figures while the pair ran


@dataclass(frozen=True)
class CheckpointEvaluation:
    """Stage 9: every run's held-out curve, and the final checkpoints' task-by-task figures."""

    curves: dict[str, Curve]
    rewrite_hits: dict[str, list[float]] = field(default_factory=dict)  # the rewriter arms'
    search_records: dict[str, list["SearchRecord"]] = field(default_factory=dict)  # the search agent's arms'


# --- the stages -------------------------------------------------------------------------------------------------


def train_and_evaluate(run: RunContext, domain: "Domain", files: "DomainFiles", clients: Clients,
                       dense_rubric: str = RUBRIC_ID, metrics_port: int = 0) -> "DemoReport":
    """Stages 6-9, in order; the report's runs, settings and analyses."""
    from calibrl.trainer.tasks import load_tasks

    bases = build_policies(run, domain, clients)
    heldout = HeldOut(rewrites=load_tasks(files.heldout_tasks),
                      search=load_tasks(files.multistep_heldout)[: run.settings.search.eval_questions or None],
                      rewrite_eval=rewrite_eval_settings(run.settings),
                      search_eval=search_eval_settings(run.settings.search))
    base_eval = evaluate_bases(run, clients, bases, heldout)
    runs = {arm.name: arm_overrides(run, arm, bases, files, clients, dense_rubric) for arm in ARMS}
    concurrency = train_arms(run, runs, clients, metrics_port, dense_rubric)
    checkpoints = evaluate_checkpoints(run, clients, heldout)
    return assemble_report(run, domain, heldout, base_eval, checkpoints, concurrency, dense_rubric)


def build_policies(run: RunContext, domain: "Domain", clients: Clients) -> "BasePolicies":
    """Stage 6: one tokenizer, then the two warm starts one after the other, each on
    ``WARM_THREADS`` torch threads (or the demo's ``--threads`` when more): the models are
    those of one thread, bit for bit (``build_base_policies``), and the agent's warm start,
    the demo's longest stage, gets both cores."""
    import torch

    from calibrl.demo.policy import PolicySpec, RewriteMix, build_base_policies

    settings = run.settings
    threads = max(WARM_THREADS, torch.get_num_threads())
    with run.stages.stage(f"build the tiny policies: tokenizer, then the two warm starts one after the other, "
                          f"each on {threads} threads"):
        bases = build_base_policies(
            domain, run.out / "policies", lambda queries: clients.search_many(queries, settings.search.top_k),
            spec=PolicySpec(), agent_spec=settings.search.agent_spec(),
            rewriter_steps=settings.warm_rewriter_steps, agent_steps=settings.search.warm_steps,
            rewrite_count=settings.rewrite_examples, teacher=settings.search.teacher(), mix=RewriteMix(),
            seed=run.seed, progress=run.progress, warm_threads=threads,
        )
        for name, result in (("base rewriter", bases.rewriter_result), ("base search agent", bases.agent_result)):
            print(f"    {name}: {result.parameters / 1e6:.2f}M parameters, {result.examples} examples, "
                  f"loss {result.losses[0]:.2f} -> {result.losses[-1]:.3f} in {result.seconds:.0f}s")
    return bases


def evaluate_bases(run: RunContext, clients: Clients, bases: "BasePolicies", heldout: HeldOut) -> BaseEvaluation:
    """Stage 7: the untrained bases (and the raw query) on the held-out tasks."""
    from calibrl.demo.error_analysis import summary_metrics

    hit_k = run.settings.hit_k
    with run.stages.stage("evaluate the untrained bases on held-out tasks"):
        raw, base = _evaluate(clients, [str(bases.rewriter)], heldout.rewrites, heldout.rewrite_eval, ["base"],
                              raw_query=True)
        rewrite_hits = {"raw": _rewrite_hits(clients, None, heldout.rewrites, heldout.rewrite_eval),
                        "base": _rewrite_hits(clients, bases.rewriter, heldout.rewrites, heldout.rewrite_eval)}
        search_records = {"base_agent": _search_records(clients, bases.agent, heldout.search, heldout.search_eval)}
        base_agent = summary_metrics(search_records["base_agent"])
        _check_task_hits(rewrite_hits, {"raw": raw.metrics["hit@k"], "base": base.metrics["hit@k"]})
        print(f"    raw query (no rewrite): hit@{hit_k} {raw.metrics['hit@k']:.3f}; base rewriter: "
              f"hit@{hit_k} {base.metrics['hit@k']:.3f}; base search agent: answer F1 "
              f"{base_agent['f1']:.3f}, well-formed {base_agent['well_formed']:.3f} on {len(heldout.search)} questions")
    return BaseEvaluation(raw=raw.metrics, base=base.metrics, base_agent=base_agent, rewrite_hits=rewrite_hits,
                          search_records=search_records)


def arm_overrides(run: RunContext, arm: Arm, bases: "BasePolicies", files: "DomainFiles", clients: Clients,
                  dense_rubric: str = RUBRIC_ID) -> list[str]:
    """The trainer overrides of one arm: its agent's shared ones, then the arm's own."""
    progress = run.progress and arm.name in run.settings.in_process()
    policy = {"rewrite": bases.rewriter, "search": bases.agent}[arm.agent]
    tasks = {"rewrite": files.train_tasks, "search": files.multistep_train}[arm.agent]
    shared = _SHARED_OVERRIDES[arm.agent](run, arm, policy, tasks, clients, progress)
    return [*shared, *arm.overrides_for(arm_fields(run.settings, dense_rubric, clients.judge_target))]


def _rewrite_overrides(run: RunContext, arm: Arm, policy: pathlib.Path, tasks: pathlib.Path, clients: Clients,
                       progress: bool) -> list[str]:
    settings, steps = run.settings, run.settings.rewrite_steps
    return [
        RECORDED_FORWARD,
        f"policy.path={policy}", "policy.device=cpu", f"tasks.path={tasks}", f"seed={run.seed}", f"steps={steps}",
        f"services.retrieval={clients.retrieval_target}", f"reward.mode={RETRIEVAL_MODE}",
        f"output_dir={run.out / 'runs' / arm.name}", f"checkpoint_every={max(1, steps // settings.checkpoints)}",
        "keep_checkpoints=0", "max_grad_norm=0.5", f"loss.beta={settings.kl_beta}",
        f"progress_bar={str(progress).lower()}",
        f"rollout.group_size={settings.group_size}", f"rollout.prompts_per_step={settings.prompts_per_step}",
        f"rollout.max_new_tokens={settings.max_new_tokens}", f"optimizer.lr={settings.lr}",
    ]


def _search_overrides(run: RunContext, arm: Arm, policy: pathlib.Path, tasks: pathlib.Path, clients: Clients,
                      progress: bool) -> list[str]:
    # every search step is scored by both services and logged (steps/*), with weight 0: the trajectory
    # reward stays answer F1 x format, and the judge server serves a second agent's rubric
    step_scoring = [f"services.judge={clients.judge_target}", "reward.score_steps=true", "reward.w_steps=0",
                    f"reward.step_rubric_id={STEP_RUBRIC_ID}"] if STEP_RUBRIC.is_file() else []
    return search_train_overrides(run.settings.search, arm.name, policy=policy, tasks=tasks,
                                  output_dir=run.out / "runs" / arm.name, retrieval=clients.retrieval_target,
                                  seed=run.seed, progress=progress, extra=step_scoring)


# (run, arm, policy, tasks, clients, progress) -> the overrides every arm of the agent shares
SharedOverrides = Callable[[RunContext, Arm, pathlib.Path, pathlib.Path, Clients, bool], list[str]]
_SHARED_OVERRIDES: dict[AgentKind, SharedOverrides] = {
    "rewrite": _rewrite_overrides, "search": _search_overrides}


def train_arms(run: RunContext, runs: dict[str, list[str]], clients: Clients, metrics_port: int,
               dense_rubric: str = RUBRIC_ID) -> Concurrency:
    """Stage 8: the runs of ``settings.processes()`` as `calibrl train` processes, two at once
    (``CONCURRENT_PAIR`` first), then those of ``settings.in_process()`` one after another in
    this process; each logs to its own trackers. A failed process is a DemoError with its log's tail."""
    from calibrl.demo.arms import ARM_BY_NAME
    from calibrl.demo.services import RunSpan, TrainingFailed, TrainingProcesses

    settings, out = run.settings, run.out
    fields = arm_fields(settings, dense_rubric)
    others = ("then both CalibAdv arms, binary + dynamic sampling and binary as processes, each when a running one "
              "ends" if settings.more_processes else "then both CalibAdv arms, binary + dynamic sampling and binary")
    with run.stages.stage("GRPO training: the dense rewriter and the GRPO search agent as two `calibrl train` "
                          f"processes at once, {others}"):
        tracking = [f"report_to={','.join(run.report_to) or 'none'}", "tracking_project=calibrl-demo"]
        processes = TrainingProcesses({name: [*runs[name], *tracking] for name in settings.processes()},
                                      out / "logs", jobs=len(CONCURRENT_PAIR))
        result = Concurrency(spans={})
        on_exit = _PairWindow(out, metrics_port, result)
        for name in settings.processes():
            print(f"    {name} (`calibrl train` process, logs/train_{name}.log): "
                  f"{ARM_BY_NAME[name].describe_for(fields)}", flush=True)
        try:
            result.spans = processes.run(on_exit=on_exit, on_tick=_ProgressTicks(out, runs) if run.progress else None)
        except TrainingFailed as exc:
            raise DemoError(str(exc)) from None
        for name in settings.in_process():
            print(f"    {name} (in the demo process): {ARM_BY_NAME[name].describe_for(fields)}", flush=True)
            started = time.monotonic() - processes.started
            _, _, tracker = train_one(runs[name], clients, run.report_to)
            tracker.close()  # the held-out table is appended after evaluation, as for the processes
            result.spans[name] = RunSpan(name, started, time.monotonic() - processes.started, 0, where="demo process")
            _print_run(out, name, result.spans[name])
    return result


class _PairWindow:
    """Called as each training process exits: prints it, and when the first of the pair ends,
    closes the window of the judge server's figures while both ran."""

    def __init__(self, out: pathlib.Path, metrics_port: int, result: Concurrency) -> None:
        from calibrl.demo import judge_report as jr

        self.out, self.metrics_port, self.result = out, metrics_port, result
        self.before = jr.scrape_judge_stats(metrics_port) if metrics_port else None

    def __call__(self, name: str, span: "RunSpan") -> None:
        from calibrl.demo import judge_report as jr

        _print_run(self.out, name, span)
        if self.before is not None and self.result.during_pair is None:
            after = jr.scrape_judge_stats(self.metrics_port)  # the first of the pair ended: the window closes
            self.result.during_pair = {r: e.minus(self.before.get(r, jr.RubricServerStats())) for r, e in after.items()}


def evaluate_checkpoints(run: RunContext, clients: Clients, heldout: HeldOut) -> CheckpointEvaluation:
    """Stage 9: every checkpoint of every arm on the held-out tasks, ``EVAL_THREADS`` arms at
    a time (Python threads sharing the demo's torch threads; each arm's figures are those it
    gets evaluated alone: greedy decoding of its own models, and retrieval results that do
    not depend on what else the server batched); the curves go into each run's own tracker runs."""
    import concurrent.futures

    curves: dict[str, Curve] = {}
    finals: dict[AgentKind, dict[str, list]] = {"rewrite": {}, "search": {}}  # agent -> arm -> final figures
    with run.stages.stage(f"evaluate every checkpoint on held-out tasks ({EVAL_THREADS} arms at a time)"), \
            concurrent.futures.ThreadPoolExecutor(EVAL_THREADS, thread_name_prefix="evaluate") as pool:
        checkpoints_of = {arm.name: sorted((run.out / "runs" / arm.name / "checkpoints").glob("step_*"),
                                           key=lambda p: int(p.name.split("_")[1])) for arm in ARMS}
        evaluations = {arm.name: pool.submit(_EVALUATE_CHECKPOINTS[arm.agent], clients, arm, checkpoints_of[arm.name],
                                             heldout) for arm in ARMS}
        for arm in ARMS:
            run_dir = run.out / "runs" / arm.name
            checkpoints = checkpoints_of[arm.name]
            metrics, final = evaluations[arm.name].result()
            finals[arm.agent][arm.name] = final
            curve = [(int(c.name.split("_")[1]), m) for c, m in zip(checkpoints, metrics)]
            curves[arm.name] = curve
            key = AGENTS[arm.agent].headline
            print(f"    {arm.name}: held-out {key} by step " + ", ".join(f"{s}: {m[key]:.3f}" for s, m in curve)
                  + f" (final {curve[-1][1][key]:.3f})")
            _log_heldout(run_dir, curve)
    return CheckpointEvaluation(curves, rewrite_hits=finals["rewrite"], search_records=finals["search"])


def _rewriter_checkpoints(clients: Clients, arm: Arm, checkpoints: list[pathlib.Path],
                          heldout: HeldOut) -> tuple[list[dict[str, float]], list[float]]:
    """Each checkpoint's held-out metrics, and the final one's task-by-task hits."""
    rows = _evaluate(clients, [str(c) for c in checkpoints], heldout.rewrites, heldout.rewrite_eval,
                     [c.name for c in checkpoints])
    metrics = [row.metrics for row in rows]
    hits = _rewrite_hits(clients, checkpoints[-1], heldout.rewrites, heldout.rewrite_eval)
    _check_task_hits({arm.name: hits}, {arm.name: metrics[-1]["hit@k"]})
    return metrics, hits


def _agent_checkpoints(clients: Clients, arm: Arm, checkpoints: list[pathlib.Path],
                       heldout: HeldOut) -> tuple[list[dict[str, float]], list["SearchRecord"]]:
    """Each checkpoint's summary metrics, and the final one's records, one per question (so
    that the final checkpoint pairs with the base)."""
    from calibrl.demo.error_analysis import summary_metrics

    records = [_search_records(clients, c, heldout.search, heldout.search_eval) for c in checkpoints]
    return [summary_metrics(r) for r in records], records[-1]


_EVALUATE_CHECKPOINTS = {"rewrite": _rewriter_checkpoints, "search": _agent_checkpoints}


# --- the report's runs ------------------------------------------------------------------------------------------


def assemble_report(run: RunContext, domain: "Domain", heldout: HeldOut, base_eval: BaseEvaluation,
                    checkpoints: CheckpointEvaluation, concurrency: Concurrency, dense_rubric: str) -> "DemoReport":
    """The report of stages 6-9: one row per evaluated model, the settings, the analyses."""
    from calibrl.demo import report as rep
    from calibrl.demo.arms import REWRITER, SEARCH_AGENT
    from calibrl.demo.rewrite_analysis import rewrite_results

    names = labels(arm_fields(run.settings, dense_rubric))
    rows: dict[AgentKind, list[RunResult]] = {
        "rewrite": [rep.RunResult("raw", "raw query, no rewrite", "rewrite", REWRITER.heldout_row(base_eval.raw)),
                    rep.RunResult("base", names["base"], "rewrite", REWRITER.heldout_row(base_eval.base))],
        "search": [rep.RunResult("base_agent", names["base_agent"], "search",
                                 SEARCH_AGENT.heldout_row(base_eval.base_agent))],
    }
    for arm in ARMS:
        rows[arm.agent].append(_arm_result(run, arm, names[arm.name], base_eval, checkpoints.curves[arm.name],
                                           concurrency.spans[arm.name].seconds))
    rewrite_hits = {**base_eval.rewrite_hits, **checkpoints.rewrite_hits}
    search_records = {**base_eval.search_records, **checkpoints.search_records}
    _write_search_records(run.out / "search_records.jsonl", search_records)
    notes = []
    if run.settings.quick:
        notes.append("--quick runs every stage with very few steps: it checks that the system works, and its "
                     "numbers are not meant to show the effect; run `calibrl demo` for that.")
    return rep.DemoReport(
        title="calibrl demo: SME-calibrated rewards and calibrated advantages on a built-in domain",
        command="calibrl demo", machine="", settings=settings_table(run, domain, heldout, dense_rubric),
        rewrite_runs=rows["rewrite"], search_runs=rows["search"], top_k=run.settings.hit_k, stages=[], notes=notes,
        rewrite_analysis=rewrite_results(rewrite_hits, rewrite_clusters(domain, heldout.rewrites)),
        search_analysis=search_analysis(domain, search_records, names), concurrency=concurrency,
    )


def _arm_result(run: RunContext, arm: Arm, label: str, base_eval: BaseEvaluation, curve: Curve,
                seconds: float) -> "RunResult":
    from calibrl.demo import report as rep
    from calibrl.trainer.diagnostics import read_log

    agent = AGENTS[arm.agent]
    history = read_log(run.out / "runs" / arm.name / "metrics.jsonl")
    final = curve[-1][1]
    heldout_curve = [(0, base_eval.of(agent)[agent.headline])] + [(step, m[agent.headline]) for step, m in curve]
    return rep.RunResult(arm.name, label, arm.agent, agent.heldout_row(final), steps=history,
                         heldout_curve=heldout_curve, wall_s=seconds)


def settings_table(run: RunContext, domain: "Domain", heldout: HeldOut, dense_rubric: str) -> dict[str, object]:
    """The report's settings table."""
    settings = run.settings
    return {
        "mode": settings.name,
        "seed": run.seed,
        "retrieval": f"BM25 over {len(domain.passages)} passages (index also holds MiniLM dense vectors)",
        "policy": "Llama-architecture causal LM, 3 layers, hidden 96, byte-level BPE trained on the domain",
        "warm start (rewriter / agent)": f"{settings.warm_rewriter_steps} / {settings.search.warm_steps} steps",
        "rewriter GRPO": f"{settings.rewrite_steps} steps x {settings.prompts_per_step} tasks x "
                         f"G={settings.group_size}, lr {settings.lr:g}, KL beta {settings.kl_beta:g}, grad norm clip 0.5",
        "binary reward": f"hit@{settings.hit_k} (0 or 1); no judge call",
        "binary + dynamic sampling": f"hit@{settings.hit_k}; up to {settings.max_sampling_rounds} rounds of "
                                     f"{settings.prompts_per_step} tasks per step, groups with unequal rewards kept "
                                     "(DAPO); same number of policy updates",
        "dense reward": f"0.7 x MRR@{settings.dense_k} + 0.3 x rubric total ({dense_rubric}, "
                        f"{'LLM judge' if dense_rubric != RUBRIC_ID else 'programmatic judge'})",
        "search agent GRPO / CalibAdv (gold as silver) / CalibAdv (authors' silver)": describe_design(settings.search),
        "held-out": f"{len(heldout.rewrites)} rewrite tasks ((product, topic) pairs never seen in training), "
                    f"{len(heldout.search)} two-search questions of the test split (one phrasing each; no plan, fund, "
                    "company or fund family of theirs is in a training or validation question; comparisons "
                    "resample whole bridge clusters); greedy decoding",
    }


def search_aspects() -> list[str]:
    """Every aspect a two-search question may ask about (the last part of its answer document id)."""
    from calibrl.demo.search_domain import SEARCH_ASPECTS

    return [a.key for a in SEARCH_ASPECTS]


def search_analysis(domain: "Domain", records: Mapping[str, Sequence["SearchRecord"]],
                    names: dict[str, str]) -> dict[str, object]:
    """The error analysis of the held-out search records, beside the two shortcuts: the best
    constant answer per aspect (fitted on the training questions) and answering a constant."""
    from calibrl.demo.error_analysis import analysis_results, best_constant_answers

    aspects = search_aspects()
    constants = best_constant_answers(domain.multistep("train"), aspects)
    return analysis_results(dict(records), names, constants=constants, aspects=aspects,
                            passages={p.doc_id: p.text for p in domain.passages})


def rewrite_clusters(domain: "Domain", tasks: Sequence["Task"]) -> list[tuple[str, str]]:
    """The (product, topic) pair of each held-out rewrite task: its resampling cluster."""
    by_id = {t.task_id: (t.entity_key, t.aspect_key) for t in domain.tasks("heldout")}
    return [by_id[t.task_id] for t in tasks]


# --- helpers ----------------------------------------------------------------------------------------------------


def rewrite_eval_settings(settings: DemoSettings) -> "EvalSettings":
    from calibrl.trainer.eval import EvalSettings

    return EvalSettings(top_k=settings.hit_k, mode=RETRIEVAL_MODE, max_new_tokens=settings.max_new_tokens,
                        device="cpu")


def _write_search_records(path: pathlib.Path, records: Mapping[str, Sequence["SearchRecord"]]) -> None:
    """Every evaluated agent's greedy trajectory of every held-out question, one JSON line
    each (``model``, question, queries, answer, F1, category): what a study pairs."""
    import json

    with path.open("w", encoding="utf-8") as out:
        for model, recs in records.items():
            for record in recs:
                out.write(json.dumps({"model": model, **record.as_dict()}, ensure_ascii=False) + "\n")


def _rewrite_hits(clients: Clients, model: pathlib.Path | None, tasks: list["Task"],
                  eval_settings: "EvalSettings") -> list[float]:
    from calibrl.demo.rewrite_analysis import greedy_rewrite_hits

    return greedy_rewrite_hits(None if model is None else str(model), tasks, clients.retrieval, eval_settings,
                               clients.background.run)


def _check_task_hits(hits: Mapping[str, list[float]], aggregated: Mapping[str, float]) -> None:
    """The task-by-task hits must average to the evaluation's hit@k: both decode greedily and
    score through the same service, so any difference is a bug, not noise."""
    for name, values in hits.items():
        mean = math.fsum(values) / len(values)
        if abs(mean - aggregated[name]) > 1e-9:
            raise RuntimeError(f"{name}: task-by-task hit@k {mean:.6f} differs from the evaluation's "
                               f"{aggregated[name]:.6f}")


def _search_records(clients: Clients, model: pathlib.Path, tasks: list["Task"],
                    eval_settings: "EvalSettings") -> list["SearchRecord"]:
    from calibrl.demo.error_analysis import greedy_search_records

    return greedy_search_records(str(model), tasks, clients.retrieval, eval_settings, clients.background.run)


def _evaluate(clients: Clients, models: list[str], tasks: list["Task"], eval_settings: "EvalSettings",
              names: list[str], raw_query: bool = False) -> list["EvalResult"]:
    from calibrl.trainer.eval import evaluate_models

    return evaluate_models(models, tasks, clients.retrieval, eval_settings, run_async=clients.background.run,
                           names=names, raw_query_baseline=raw_query)


def train_one(overrides: list[str], clients: Clients,
              report_to: Sequence[str]) -> tuple[list[dict[str, float | str]], float, "Tracker"]:
    """Train one run in this process; returns its metrics, its seconds and its trackers (still open)."""
    from calibrl.config import to_dict
    from calibrl.tracking import open_trackers
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.loop import train

    config = load_train_config(None, [*overrides, f"report_to={','.join(report_to) or 'none'}",
                                      "tracking_project=calibrl-demo"])
    tracker = open_trackers(config.trackers(), config.run_dir, project=config.tracking_project,
                            config=to_dict(config))
    judge = clients.judge if config.services.judge != "none" else None
    started = time.perf_counter()
    try:
        result = train(config, retrieval=clients.retrieval, judge=judge, background=clients.background,
                       tracker=tracker)
    except BaseException:
        tracker.close()
        raise
    return list(result.history), time.perf_counter() - started, tracker


def _print_run(out: pathlib.Path, name: str, span: "RunSpan") -> None:
    from calibrl.trainer.diagnostics import read_log

    history = read_log(out / "runs" / name / "metrics.jsonl")
    zero_std = [float(h["frac_reward_zero_std"]) for h in history]
    print(f"      {name} done at {span.end_s:.0f}s: {len(history)} steps in {span.seconds:.0f}s; reward "
          f"{float(history[0]['reward']):.3f} -> {float(history[-1]['reward']):.3f}; mean frac_reward_zero_std "
          f"{sum(zero_std) / len(history):.2f}", flush=True)


class _ProgressTicks:
    """Every ``every_s``, one line of steps done per running training run (from its metrics.jsonl)."""

    def __init__(self, out: pathlib.Path, runs: Mapping[str, list[str]], every_s: float = 20.0) -> None:
        self.out, self.every_s, self.next_s = out, every_s, every_s
        self.steps = {name: next(o.split("=", 1)[1] for o in overrides if o.startswith("steps="))
                      for name, overrides in runs.items()}

    def __call__(self, seconds: float, running: list[str]) -> None:
        if seconds < self.next_s or not running:
            return
        self.next_s = seconds + self.every_s
        done = {}
        for name in running:
            path = self.out / "runs" / name / "metrics.jsonl"
            done[name] = len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0
        print(f"    {seconds:.0f}s: " + ", ".join(f"{n} {d}/{self.steps[n]} steps" for n, d in done.items()),
              flush=True)


def _log_heldout(run_dir: pathlib.Path, curve: Curve) -> None:
    """The held-out table into the run's own tracker runs (reopened to append, as
    ``calibrl eval --run-dir`` does), under the run's tracking project."""
    from calibrl.trainer.eval_report import log_to_run, run_trackers

    names, project = run_trackers(run_dir)
    if names:
        log_to_run(run_dir, curve, names, project)


__all__ = ["BaseEvaluation", "CheckpointEvaluation", "Clients", "Concurrency", "HeldOut", "arm_overrides",
           "assemble_report", "build_policies", "evaluate_bases", "evaluate_checkpoints", "rewrite_clusters",
           "search_aspects", "settings_table", "train_and_evaluate", "train_arms", "train_one"]
