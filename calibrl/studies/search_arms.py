"""`calibrl study`: the search-agent arms over several seeds, with intervals.

    calibrl study                       # seeds 6-10, the full demo's sizes, normal + stress + long setting
    calibrl study --seeds 6,7 --jobs 2  # two worker processes at a time
    calibrl study --quick               # every stage with few steps (the test's size)

For each seed the study builds what ``calibrl demo --seed N`` builds for its search
agent, with the demo's own functions: the domain (so every seed has its own corpus
and questions), the index, the retrieval service and the base search agent. A judge
service serves the search-step rubric (``configs/rubrics/search-steps.yaml``) for the
step-rewarded arms. From that one base it trains the arms with the demo's search
settings, differing only in what the arm names:

* ``grpo``: GRPO advantages, reward answer F1 x format;
* ``calibadv``: CalibAdv, gold documents as silver (``advantage.use_gold=true``);
* ``calibadv_silver``: CalibAdv, silver documents from the group's best well-formed
  rollouts, as its authors take them (``advantage.use_gold=false``);
* ``grpo_steps`` / ``calibadv_steps`` (``--arms``, not run by default): GRPO and CalibAdv
  with per-step dense rewards from both services in the trajectory reward
  (``reward.w_steps``; the one way both estimators take);

under the demo's learning rate (``normal``), under a stress setting, the same for every
arm (``stress``: the learning rate times ``STRESS_LR_FACTOR``), and over a longer run at
the normal learning rate (``long``: ``LONG_STEPS_FACTOR`` times the steps, with held-out
search recall and answer F1 at ``LONG_CHECKPOINTS`` checkpoints: does an arm degrade?).
When the long setting runs, the normal run is not trained apart: the long run's first steps
are the normal run (the same seed, questions in the same order and a constant learning rate),
so its checkpoint at the normal run's last step is the normal run's final policy, and its
per-step metrics up to there are the normal run's (:meth:`StudyPlan.normal_from_long`).
Every final policy and the base answer every held-out question greedily; the
per-question answer F1 feeds ``calibrl.stats``: each arm's mean with a 95% bootstrap
interval over questions (resampled within each seed: the seeds have different
questions) and the paired bootstrap of every pair of arms and of each arm vs the base.

Each seed writes ``seed_<N>/seed_result.json``. ``--jobs 2`` runs the study as tasks, two
worker processes at a time (``calibrl study --worker``): each seed's base, then each of its
runs (the long runs first, the short ones last, so both workers end together); a seed's
record is put together in run order as its runs end, the same record one process writes.
The parent then writes ``results.json``, ``report.md`` and ``plots/``
(:mod:`calibrl.studies.search_arms_report`). A study
too long for one sitting can run its seeds apart (``--seeds 6,7`` now, ``--seeds 8,9``
later or elsewhere); ``calibrl study --out DIR --merge A --merge B`` then writes one
report over all their records, naming each study's command and wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Iterator, Sequence

from calibrl.errors import CalibrlError
from calibrl.json_types import JsonObject

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.api.retrieval import Hit
    from calibrl.demo.domain import Domain, DomainFiles
    from calibrl.demo.error_analysis import SearchRecord
    from calibrl.demo.policy import PolicySpec
    from calibrl.demo.search_design import SearchDesign
    from calibrl.demo.settings import DemoSettings
    from calibrl.demo.training import Clients
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.tasks import Task

DEFAULT_SEEDS = "6,7,8,9,10"  # no design knob was chosen on these seeds (experiments/LOG.md, D11)
STUDY_MARKER = ".calibrl-study"  # marks a folder as a study's output, which a later study may replace
STEP_RUBRIC_ID = "search-steps"
STEP_RUBRIC = pathlib.Path(__file__).resolve().parents[2] / "configs" / "rubrics" / f"{STEP_RUBRIC_ID}.yaml"
STRESS_LR_FACTOR = 5.0  # the stress setting's learning rate, in multiples of the demo's search_lr
LONG_STEPS_FACTOR = 4  # the long setting's steps, in multiples of the demo's (same learning rate)
LONG_CHECKPOINTS = 4  # held-out evaluations along the long run
W_STEPS = 0.5  # weight of the mean step reward in the step-rewarded arms' trajectory reward
SEED_RESULT = "seed_result.json"
CURVE_METRICS = ("f1", "em", "recall", "bridge_found", "well_formed")  # kept per checkpoint of the long run
STUDY_FILE = "study.json"  # the command, the plan and the start time (calibrl study --report-only reads it)
# Per-step metrics kept from each run's metrics.jsonl (the collapse signals and the reward).
KEPT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "grad_norm", "policy/ref_ppl",
                "search/well_formed", "search/answered", "search/searches_per_trajectory", "search/repeated_share",
                "search/first_gold_found", "search/all_gold_found",
                "steps/reward/mean", "steps/new_gold_share", "completions/mean_length",
                "calibadv/frac_tokens_softened", "calibadv/frac_groups_answer_zeroed", "calibadv/mean_step_score",
                "calibadv/neg_search_steps", "calibadv/frac_neg_search_steps_softened",
                "calibadv/frac_neg_search_steps_found_gold", "calibadv/frac_softened_found_gold",
                "calibadv/adv_change_search", "calibadv/adv_change_answer")


@dataclass(frozen=True)
class Arm:
    """One training recipe of the comparison."""

    name: str
    label: str
    estimator: str  # advantage.type, as the demo's search arms take it
    step_rewards: bool


ARMS = (
    Arm("grpo", "GRPO", "grpo", False),
    Arm("calibadv", "CalibAdv (gold as silver)", "calibadv", False),
    Arm("calibadv_silver", "CalibAdv (authors' silver)", "calibadv_silver", False),
    Arm("grpo_steps", "GRPO + step rewards", "grpo", True),
    Arm("calibadv_steps", "CalibAdv + step rewards", "calibadv", True),
)
DEFAULT_ARMS = ("grpo", "calibadv", "calibadv_silver")
SETTINGS = ("normal", "stress", "long")


@dataclass(frozen=True)
class StudyPlan:
    """What one study runs."""

    demo: "DemoSettings"  # FULL or QUICK; its ``search`` design is every arm's
    seeds: tuple[int, ...]
    heldout_limit: int = 0  # evaluate only the first N held-out questions (0 = all; tests use a few)
    arms: tuple[Arm, ...] = tuple(a for a in ARMS if a.name in DEFAULT_ARMS)
    settings: tuple[str, ...] = SETTINGS

    @property
    def design(self) -> "SearchDesign":
        """The demo's search design (``calibrl.demo.search_design.SearchDesign``)."""
        return self.demo.search

    def design_for(self, setting: str) -> "SearchDesign":
        """The design under ``setting`` (stress: the learning rate times ``STRESS_LR_FACTOR``)."""
        if setting == "stress":
            return self.design.with_overrides(lr=self.design.lr * STRESS_LR_FACTOR)
        if setting == "long":
            return self.design.with_overrides(steps=self.design.steps * LONG_STEPS_FACTOR,
                                              checkpoints=LONG_CHECKPOINTS)
        return self.design

    @property
    def normal_from_long(self) -> bool:
        """Whether the normal setting is read off the long run instead of trained apart: the
        long run at the normal learning rate takes the same first steps as the normal run
        (same seed, same questions in the same order, a constant learning rate) and keeps a
        checkpoint at the normal run's last step (``LONG_STEPS_FACTOR`` equals
        ``LONG_CHECKPOINTS``), so that checkpoint is the normal run's final policy. The
        D18 study's records bear it out: in every seed and arm, the long run's first steps'
        metrics and its first checkpoint's held-out figures equal the normal run's."""
        return "normal" in self.settings and "long" in self.settings

    def run_order(self) -> list[tuple[str, Arm]]:
        """(setting, arm) of the runs trained, in the order they run: the plain arms first
        under every setting (GRPO vs CalibAdv, normal and stress: the headline), then the
        step-rewarded ones, so a study stopped part way has the headline in every seed. With
        :attr:`normal_from_long`, the long runs give the normal setting too: they run first and
        no normal run is trained."""
        settings = list(self.settings)
        if self.normal_from_long:  # the long runs carry the headline (normal), so they go first
            settings = ["long", *(s for s in settings if s not in ("normal", "long"))]
        return [(setting, arm) for group in (False, True) for setting in settings
                for arm in self.arms if arm.step_rewards == group]

    def describe(self) -> JsonObject:
        from calibrl.demo.search_design import describe_design

        design = self.design
        return {
            "mode": self.demo.name, "seeds": list(self.seeds), "arms": [a.name for a in self.arms],
            "settings": list(self.settings), "search_steps": design.steps,
            "long_steps": design.steps * LONG_STEPS_FACTOR, "long_checkpoints": LONG_CHECKPOINTS,
            "questions_per_step": design.prompts_per_step, "group_size": design.group_size,
            "lr": design.lr, "stress_lr": design.lr * STRESS_LR_FACTOR, "kl_beta": design.kl_beta,
            "max_turns": design.max_turns, "search_top_k": design.top_k, "w_steps": W_STEPS,
            "warm_agent_steps": design.warm_steps, "heldout_limit": self.heldout_limit,
            "design": describe_design(design),
        }


# --------------------------------------------------------------------------- one seed


def run_seed(plan: StudyPlan, seed: int, out: pathlib.Path, progress: bool = False) -> JsonObject:
    """Everything of one seed; writes and returns its ``seed_result.json`` record."""
    with _seed_world(seed, out) as (domain, files, clients, timings, started):
        record = _train_and_score(plan, seed, out, domain, files, clients, timings, progress)
    timings["seed_s"] = time.perf_counter() - started
    record["complete"] = True
    save_seed_result(out, record)
    return record


@contextlib.contextmanager
def _seed_world(seed: int, out: pathlib.Path) -> Iterator[tuple["Domain", "DomainFiles", "Clients", dict[str, float],
                                                                 float]]:
    """A seed's domain, files and index (timed as ``domain_and_index_s``), its services and
    their clients, one torch thread and the log in ``out/study.log``: (domain, files, clients,
    timings, start time)."""
    import torch

    from calibrl.demo.context import log_to_file
    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.demo.preparation import build_demo_index
    from calibrl.demo.training import Clients
    from calibrl.trainer.aio import BackgroundLoop

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    log_to_file(out / "study.log")
    timings: dict[str, float] = {}
    started = time.perf_counter()
    domain = generate_domain(seed)
    files = write_domain(domain, out / "data")
    build_demo_index(files.corpus, out / "index")
    timings["domain_and_index_s"] = time.perf_counter() - started
    with _services(out) as (retrieval_target, judge_target), BackgroundLoop(name=f"study-{seed}") as background:
        clients = Clients(retrieval_target, judge_target, background)
        try:
            yield domain, files, clients, timings, started
        finally:
            clients.close()


def save_seed_result(out: pathlib.Path, record: JsonObject) -> None:
    """Write ``seed_result.json`` (after the base and after every arm, so a study stopped
    part way still reports the arms every seed finished: ``calibrl study --report-only``)."""
    partial = out / f"{SEED_RESULT}.partial"
    partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
    partial.replace(out / SEED_RESULT)


@contextlib.contextmanager
def _services(out: pathlib.Path) -> Iterator[tuple[str, str]]:
    """The demo's retrieval service over ``out/index`` and a judge serving the search-step
    rubric (no SME golden set exists for it, so it is served unvalidated)."""
    from calibrl.demo.settings import RETRIEVAL_MODE
    from calibrl.demo.services import Service, free_port

    if not STEP_RUBRIC.is_file():
        raise StudyError(f"{STEP_RUBRIC}: the search-step rubric is missing; the study runs from a source checkout "
                         "(pip install -e .), where configs/rubrics/ holds it")
    rubrics = out / "rubrics"
    rubrics.mkdir(exist_ok=True)
    shutil.copy(STEP_RUBRIC, rubrics / STEP_RUBRIC.name)
    retrieval_port, judge_port = free_port(), free_port()
    services = [
        Service("retrieval server", [
            "serve", "retrieval", "--index", str(out / "index"), "--port", str(retrieval_port),
            f"default_mode={RETRIEVAL_MODE}", "device=cpu", "torch_threads=1", "serving.grace_seconds=2",
            "serving.drain_seconds=0"], retrieval_port, out / "logs" / "serve_retrieval.log"),
        Service("judge server", [
            "serve", "judge", "--rubrics", str(rubrics), "--backend", "programmatic", "--allow-unvalidated",
            "--port", str(judge_port), "serving.grace_seconds=2", "serving.drain_seconds=0"],
            judge_port, out / "logs" / "serve_judge.log"),
    ]
    try:
        for service in services:
            service.start()
        for service in services:
            service.wait_healthy()
        yield services[0].target, services[1].target
    finally:
        for service in services:
            service.stop()


def _train_and_score(plan: StudyPlan, seed: int, out: pathlib.Path, domain: "Domain", files: "DomainFiles",
                     clients: "Clients", timings: dict[str, float], progress: bool) -> JsonObject:
    started = time.perf_counter()
    record, base_agent = _base_record(plan, seed, out, domain, files, clients, timings, progress)
    save_seed_result(out, record)
    heldout, passages = _heldout(plan, files), {p.doc_id: p.text for p in domain.passages}
    for setting, arm in plan.run_order():
        run, normal = _run_entry(plan, setting, arm, base_agent, files, clients, out, seed, heldout, passages,
                                 progress)
        _add_run(record, setting, arm.name, run, normal)
        timings["arms_s"] = time.perf_counter() - started - timings["base_agent_s"]
        save_seed_result(out, record)
        _print_run(seed, setting, arm.name, run, normal, len(heldout))
    return record


def _heldout(plan: StudyPlan, files: "DomainFiles") -> list["Task"]:
    """The held-out questions every policy of the seed answers (the first ``heldout_limit``)."""
    from calibrl.trainer.tasks import load_tasks

    return load_tasks(files.multistep_heldout)[: plan.heldout_limit or plan.design.eval_questions or None]


def _base_record(plan: StudyPlan, seed: int, out: pathlib.Path, domain: "Domain", files: "DomainFiles",
                 clients: "Clients", timings: dict[str, float], progress: bool) -> tuple[JsonObject, pathlib.Path]:
    """The seed's base agent (built and warm-started) and its record before any run: the
    held-out questions, the base's and the best constant's per-question scores."""
    from calibrl.demo.search_design import eval_settings as search_eval_settings
    from calibrl.trainer.tasks import load_tasks

    started = time.perf_counter()
    base_agent = build_base_agent(plan.demo, domain, out, clients, seed, progress)
    timings["base_agent_s"] = time.perf_counter() - started
    heldout = _heldout(plan, files)
    passages = {p.doc_id: p.text for p in domain.passages}
    record: JsonObject = {
        "seed": seed,
        "questions": [{"task_id": t.task_id, "question": t.query, "bridge": t.gold_doc_ids[0]} for t in heldout],
        "train_questions": len(load_tasks(files.multistep_train)),
        "base": question_scores(base_agent, heldout, clients, search_eval_settings(plan.design), passages),
        "constant": constant_scores(domain, heldout), "runs": {}, "timings": timings, "complete": False,
    }
    return record, base_agent


def _run_entry(plan: StudyPlan, setting: str, arm: Arm, base_agent: pathlib.Path, files: "DomainFiles",
               clients: "Clients", out: pathlib.Path, seed: int, heldout: Sequence["Task"],
               passages: dict[str, str], progress: bool) -> tuple[JsonObject, JsonObject | None]:
    """Train one run from the base and score it on the held-out questions: its record and,
    for a long run with :attr:`StudyPlan.normal_from_long`, the normal run read off it."""
    from calibrl.demo.search_design import eval_settings as search_eval_settings

    eval_settings = search_eval_settings(plan.design)
    normal_steps = plan.design.steps
    run = train_arm(plan, setting, arm, base_agent, files, clients, out, seed, progress)
    eval_started = time.perf_counter()
    checkpoints = run.pop("checkpoints")
    normal: JsonObject | None = None
    if setting == "long":  # held-out figures along the run (the last checkpoint is the final policy)
        run["curve"] = []
        for step, path in checkpoints:
            step_started = time.perf_counter()
            scores = question_scores(path, heldout, clients, eval_settings, passages)
            run["curve"].append({"step": step, **{k: scores[k] for k in CURVE_METRICS}})
            if plan.normal_from_long and step == normal_steps:
                normal = {"steps": run["steps"][:normal_steps], "from_long": True, "scores": scores,
                          "eval_s": time.perf_counter() - step_started}
        if plan.normal_from_long and normal is None:
            raise StudyError(f"seed {seed} long {arm.name}: no checkpoint at step {normal_steps} (checkpoints at "
                             f"{[step for step, _ in checkpoints]}), so the normal run cannot be read off it")
    run["scores"] = question_scores(run.pop("model"), heldout, clients, eval_settings, passages)
    run["eval_s"] = time.perf_counter() - eval_started
    return run, normal


def _add_run(record: JsonObject, setting: str, arm: str, run: JsonObject, normal: JsonObject | None) -> None:
    """Put a run (and the normal run read off it) into the seed's record."""
    if normal is not None:
        record["runs"].setdefault("normal", {})[arm] = normal
    record["runs"].setdefault(setting, {})[arm] = run


def _print_run(seed: int, setting: str, arm: str, run: JsonObject, normal: JsonObject | None, questions: int) -> None:
    for name, done in (("normal", normal), (setting, run)):
        if done is not None:
            how = "read off the long run" if done.get("from_long") else f"trained in {done['wall_s']:.0f}s"
            print(f"    seed {seed} {name} {arm}: {how}, held-out F1 {sum(done['scores']['f1']) / questions:.3f}",
                  flush=True)


def build_base_agent(demo: "DemoSettings", domain: "Domain", out: pathlib.Path, clients: "Clients", seed: int,
                     progress: bool, spec: "PolicySpec | None" = None, warm_lr: float = 3e-3) -> pathlib.Path:
    """The demo's base search agent of this seed, without the demo's rewriter: the same
    tokenizer (trained on the rewrite and search examples, as ``build_base_policies``
    trains it), the same seeded model and the same warm start; the rewriter's own
    warm start (which the agent does not depend on) is skipped. ``spec``: another policy
    size (a probe's; default the design's ``agent_spec()``); ``warm_lr``: the warm start's
    peak learning rate (a probe's; default the design's, 3e-3)."""
    from calibrl.demo.policy import (
        RewriteMix,
        rewrite_examples,
        search_examples,
        tokenizer_corpus,
        train_tokenizer,
    )
    from calibrl.demo.policy import build_base_agent as warm_start_agent

    design = demo.search
    spec = spec or design.agent_spec()

    def search_many(queries: Sequence[str]) -> list[list["Hit"]]:
        return clients.search_many(queries, design.top_k)

    rewrites = rewrite_examples(domain, demo.rewrite_examples, RewriteMix(), seed)
    trajectories = search_examples(domain, search_many, design.teacher(), seed)
    tokenizer = train_tokenizer(tokenizer_corpus(domain, rewrites + trajectories), spec.vocab_size)
    agent, _ = warm_start_agent(domain, out / "policies", search_many, tokenizer=tokenizer, spec=spec,
                                steps=design.warm_steps, teacher=design.teacher(), seed=seed, progress=progress,
                                lr=warm_lr)
    return agent


def arm_overrides(plan: StudyPlan, setting: str, arm: Arm, base_agent: pathlib.Path, files: "DomainFiles",
                  clients: "Clients", run_dir: pathlib.Path, seed: int, progress: bool) -> list[str]:
    """The demo's training overrides of the arm's estimator (``search_design.train_overrides``)
    under the setting's design, plus the arm's step rewards; only the final checkpoint is
    written (the study evaluates the final policy)."""
    from calibrl.demo.search_design import train_overrides

    extra = [] if setting == "long" else ["checkpoint_every=0"]  # the long run keeps its checkpoints
    if arm.step_rewards:
        extra += [f"reward.w_steps={W_STEPS}", f"reward.step_rubric_id={STEP_RUBRIC_ID}",
                  f"services.judge={clients.judge_target}"]
    return train_overrides(plan.design_for(setting), arm.estimator, policy=base_agent, tasks=files.multistep_train,
                           output_dir=run_dir, retrieval=clients.retrieval_target, seed=seed, progress=progress,
                           extra=extra)


def train_arm(plan: StudyPlan, setting: str, arm: Arm, base_agent: pathlib.Path, files: "DomainFiles",
              clients: "Clients", out: pathlib.Path, seed: int, progress: bool) -> JsonObject:
    """Train one arm; its kept per-step metrics, wall time and final checkpoint."""
    from calibrl.demo.training import train_one
    from calibrl.trainer.checkpoint import find_checkpoint

    run_dir = out / "runs" / setting / arm.name
    overrides = arm_overrides(plan, setting, arm, base_agent, files, clients, run_dir, seed, progress)
    history, seconds, tracker = train_one(overrides, clients, ("none",))
    tracker.close()
    planned = plan.design_for(setting).steps
    if len(history) < planned:  # the trainer caught a SIGTERM: it checkpointed and returned early
        raise StudyError(f"{run_dir}: training stopped after {len(history)} of {planned} steps (SIGTERM)")
    steps = [{"step": n + 1, **{k: float(h[k]) for k in KEPT_METRICS if k in h}} for n, h in enumerate(history)]
    checkpoints = sorted(((int(p.name.split("_")[1]), str(p)) for p in (run_dir / "checkpoints").glob("step_*")),
                         key=lambda c: c[0]) if (run_dir / "checkpoints").is_dir() else []
    return {"steps": steps, "wall_s": seconds, "model": str(find_checkpoint(run_dir)), "checkpoints": checkpoints}


def question_scores(model: str | pathlib.Path, tasks: Sequence["Task"], clients: "Clients", settings: "EvalSettings",
                    passages: dict[str, str] | None = None) -> dict[str, list]:
    """Per held-out question, the demo's greedy record (``error_analysis.greedy_search_records``):
    answer ``f1`` and ``em``, ``well_formed`` (0/1), ``searches``, the error ``category``, the
    normalised ``answer`` and ``found_answer_doc`` (0/1); with ``passages`` (doc id -> text) also
    ``grounded`` (0/1: a retrieved passage states the gold value). Their means are
    ``calibrl.trainer.kinds.search.metrics.evaluate_search``'s."""
    from calibrl.demo.error_analysis import found_answer_doc, greedy_search_records, grounded
    from calibrl.text import normalize_answer
    from calibrl.trainer.eval import resolve_model_path

    records = greedy_search_records(str(resolve_model_path(model)), tasks, clients.retrieval, settings,
                                    clients.background.run)
    scores = {"f1": [r.f1 for r in records], "em": [float(r.em) for r in records],
              "well_formed": [float(r.well_formed) for r in records], "searches": [len(r.queries) for r in records],
              "category": [_category(r) for r in records],
              "answer": [normalize_answer(r.answer) if r.answer is not None else "" for r in records],
              "found_answer_doc": [float(found_answer_doc(r)) for r in records],
              "bridge_found": [r.bridge_found for r in records], "recall": [r.recall for r in records]}
    if passages is not None:
        scores["grounded"] = [float(grounded(r, passages)) for r in records]
    return scores


def constant_scores(domain: "Domain", tasks: Sequence["Task"]) -> JsonObject:
    """The best-constant baseline on the held-out ``tasks``: per aspect the most frequent answer
    of the training questions, its per-question ``f1`` and ``em``, and the ``aspect`` of each."""
    from calibrl.demo.training import search_aspects
    from calibrl.demo.error_analysis import aspect_of, best_constant_answers
    from calibrl.text import exact_match, token_f1

    aspects = search_aspects()
    constants = best_constant_answers(domain.multistep("train"), aspects)
    answers = [constants.get(aspect_of(t.gold_doc_ids[-1], aspects)) for t in tasks]
    return {"answers": constants, "aspect": [aspect_of(t.gold_doc_ids[-1], aspects) for t in tasks],
            "f1": [token_f1(a, t.answers) if a else 0.0 for a, t in zip(answers, tasks)],
            "em": [exact_match(a, t.answers) if a else 0.0 for a, t in zip(answers, tasks)]}


def _category(record: "SearchRecord") -> str:
    """The record's error category; ``unclassified`` for a question without two gold documents."""
    try:
        return record.category
    except ValueError:
        return "unclassified"


# --------------------------------------------------------------------------- the study


def run_study(plan: StudyPlan, out: pathlib.Path, *, jobs: int = 1, progress: bool = False,
              command: str = "calibrl study", native_kernels: bool = False) -> pathlib.Path:
    """Every seed, then the report; returns the path of report.md. ``jobs`` 1: everything
    in this process, seed after seed; more: each seed's base and then each of its runs as a
    task of its own, ``jobs`` worker processes at a time (``native_kernels``: theirs)."""
    from calibrl.studies import search_arms_report as study_report

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / STUDY_MARKER).write_text(f"{command}\n", encoding="utf-8")
    import torch

    from calibrl.demo.context import machine_description

    torch.set_num_threads(1)  # as every seed process runs
    machine = machine_description().replace("in the demo process", "in each study process")
    (out / STUDY_FILE).write_text(json.dumps({"command": command, "plan": plan.describe(), "started": time.time(),
                                              "jobs": jobs, "machine": machine}, indent=1), encoding="utf-8")
    if jobs == 1:
        records = [run_seed(plan, seed, out / f"seed_{seed}", progress) for seed in plan.seeds]
    else:
        records = _run_tasks_in_processes(plan, out, jobs, native_kernels)
    wall = time.perf_counter() - started
    return study_report.write_study(plan.describe(), records, out, command=command, wall_s=wall,
                                    arm_labels={a.name: a.label for a in plan.arms}, machine=machine)


def report_only(out: pathlib.Path) -> pathlib.Path:
    """The report of a study stopped part way (or finished): every seed's latest
    ``seed_result.json``; the wall time runs from the start to the last result written."""
    from calibrl.studies import search_arms_report as study_report

    meta_path = out / STUDY_FILE
    if not meta_path.is_file():
        raise StudyError(f"{meta_path} is missing: --out {out} holds no study started by this version")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    paths = [out / f"seed_{seed}" / SEED_RESULT for seed in meta["plan"]["seeds"]]
    found = [path for path in paths if path.is_file()]
    if not found:
        raise StudyError(f"no seed of {out} has written {SEED_RESULT} yet (the base agent comes first)")
    records = [json.loads(path.read_text(encoding="utf-8")) for path in found]
    wall = max(path.stat().st_mtime for path in found) - meta["started"]
    return study_report.write_study(meta["plan"], records, out, command=meta["command"], wall_s=wall,
                                    arm_labels={a.name: a.label for a in ARMS}, machine=meta.get("machine", ""))


def merge_reports(out: pathlib.Path, sources: Sequence[pathlib.Path]) -> pathlib.Path:
    """One report in ``out`` over the seed records of several studies of one plan that ran
    apart (in turns, or on several machines): each source is a study's ``--out`` or a
    folder an earlier report was written to (``results.json`` beside its ``seed_<N>``
    records). Only the seeds may differ between their plans, and no seed may come from two;
    the planned seeds are all of theirs, so a seed none of them ran is named as not run.
    The records are copied into ``out``, which then holds everything its report reads."""
    from calibrl.studies import search_arms_report as study_report

    plan: JsonObject | None = None
    parts: list[JsonObject] = []
    records: dict[int, tuple[JsonObject, pathlib.Path]] = {}
    for source in sources:
        source_plan, source_parts, paths = _study_part(source)
        if plan is None:
            plan = dict(source_plan)
        differ = sorted(key for key in set(plan) | set(source_plan)
                        if key != "seeds" and plan.get(key) != source_plan.get(key))
        if differ:
            raise StudyError(f"--merge {source}: its plan differs from {sources[0]}'s in {', '.join(differ)}; "
                             "only the seeds may differ")
        plan["seeds"] = sorted(set(plan["seeds"]) | set(source_plan["seeds"]))
        for path in paths:
            record = json.loads(path.read_text(encoding="utf-8"))
            if record["seed"] in records:
                raise StudyError(f"--merge {source}: seed {record['seed']} has records in {records[record['seed']][1]} "
                                 f"and {path}; give each seed from one study")
            records[record["seed"]] = (record, path)
        parts.extend(source_parts)
    assert plan is not None  # sources is not empty
    out.mkdir(parents=True, exist_ok=True)
    for seed, (_, path) in records.items():
        target = out / f"seed_{seed}" / SEED_RESULT
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.resolve() != path.resolve():
            shutil.copyfile(path, target)
    machines = sorted({part["machine"] for part in parts if part.get("machine")})
    return study_report.write_study(
        plan, [records[seed][0] for seed in sorted(records)], out, command=" + ".join(p["command"] for p in parts),
        wall_s=math.fsum(p["wall_s"] for p in parts), arm_labels={a.name: a.label for a in ARMS},
        machine=machines[0] if len(machines) == 1 else "", parts=parts)


def _study_part(source: pathlib.Path) -> tuple[JsonObject, list[JsonObject], list[pathlib.Path]]:
    """A merge source's plan, the studies that made its records (command, seeds, wall
    time, machine) and its seed records' paths."""
    meta_path, results_path = source / STUDY_FILE, source / "results.json"
    if meta_path.is_file():  # a study's --out: its records so far, timed from its start
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        paths = [source / f"seed_{seed}" / SEED_RESULT for seed in meta["plan"]["seeds"]]
        paths = [path for path in paths if path.is_file()]
        wall = max((path.stat().st_mtime for path in paths), default=meta["started"]) - meta["started"]
        parts = [{"command": meta["command"], "seeds": [int(path.parent.name.split("_")[1]) for path in paths],
                  "wall_s": wall, "machine": meta.get("machine", "")}]
        plan = meta["plan"]
    elif results_path.is_file():  # a report folder: the studies its results.json names
        results = json.loads(results_path.read_text(encoding="utf-8"))
        plan = results["plan"]
        paths = [source / f"seed_{seed}" / SEED_RESULT for seed in plan["seeds"]]
        paths = [path for path in paths if path.is_file()]
        parts = results.get("parts") or [{"command": results["command"], "wall_s": results["wall_s"],
                                          "machine": results.get("machine", ""),
                                          "seeds": [int(path.parent.name.split("_")[1]) for path in paths]}]
    else:
        raise StudyError(f"--merge {source}: neither {STUDY_FILE} (a study's --out) nor results.json (a report) is there")
    if not paths:
        raise StudyError(f"--merge {source}: no seed has written {SEED_RESULT} there")
    return plan, parts, paths


# --------------------------------------------------------------------------- tasks in processes
#
# With --jobs N > 1 the study is a set of tasks run by N worker processes at a time: each
# seed's base (domain, index, base agent, base and best-constant scores), then each of its
# runs once its base is done. A run's record depends only on its seed, base agent, setting
# and arm (and on the services' answers, pure functions of their inputs), so it is the one
# a single process would write; the parent puts the seed's record together in run order.

BASE_RESULT = "base_result.json"  # a seed's record before its runs, and where its base agent is
PLAN_FILE = "plan.pickle"  # the study's plan, for its worker processes
RUN_RESULTS = "run_results"  # a seed's finished runs, one file each


@dataclass(frozen=True)
class _Task:
    """One worker process's work: a seed's base (``setting`` empty) or one of its runs."""

    seed: int
    setting: str = ""
    arm: str = ""

    @property
    def name(self) -> str:
        return f"seed {self.seed} base" if not self.setting else f"seed {self.seed} {self.setting} {self.arm}"

    def priority(self, plan: StudyPlan) -> tuple[int, int, int]:
        """Bases first (each opens a seed's runs), then the long runs, then the rest, each in
        seed and run order: the short runs come last and even out the workers' ends."""
        if not self.setting:
            return (0, plan.seeds.index(self.seed), 0)
        order = [(s, a.name) for s, a in plan.run_order()]
        return (1 if self.setting == "long" else 2, plan.seeds.index(self.seed), order.index((self.setting, self.arm)))


def _run_file(seed_dir: pathlib.Path, setting: str, arm: str) -> pathlib.Path:
    return seed_dir / RUN_RESULTS / f"{setting}__{arm}.json"


def _write_json(path: pathlib.Path, record: JsonObject) -> None:
    """Write ``record`` to ``path`` whole or not at all (the parent reads it when the worker ends)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
    partial.replace(path)


def seed_base(plan: StudyPlan, seed: int, out: pathlib.Path, progress: bool = False) -> JsonObject:
    """A seed's base task: domain, index and base agent, with the services of the seed up
    meanwhile; writes ``base_result.json`` (the seed's record with no run yet, the base
    agent's path and the task's seconds) and ``seed_result.json``."""
    with _seed_world(seed, out) as (domain, files, clients, timings, started):
        record, base_agent = _base_record(plan, seed, out, domain, files, clients, timings, progress)
    save_seed_result(out, record)
    _write_json(out / BASE_RESULT, {"record": record, "base_agent": str(base_agent),
                                    "task_s": time.perf_counter() - started})
    return record


def seed_run(plan: StudyPlan, seed: int, out: pathlib.Path, setting: str, arm_name: str,
             targets: tuple[str, str], progress: bool = False) -> JsonObject:
    """One run of a seed whose base task is done, against the seed's services at
    ``targets`` (retrieval, judge); writes ``run_results/<setting>__<arm>.json``."""
    import torch

    from calibrl.demo.context import log_to_file
    from calibrl.demo.domain import domain_files, generate_domain
    from calibrl.demo.training import Clients
    from calibrl.trainer.aio import BackgroundLoop

    torch.set_num_threads(1)
    started = time.perf_counter()
    log_to_file(out / f"study-{setting}-{arm_name}.log")
    arm = next(a for a in plan.arms if a.name == arm_name)
    base = json.loads((out / BASE_RESULT).read_text(encoding="utf-8"))
    files = domain_files(out / "data")
    heldout = _heldout(plan, files)
    passages = {p.doc_id: p.text for p in generate_domain(seed).passages}
    with BackgroundLoop(name=f"study-{seed}-{setting}-{arm_name}") as background:
        clients = Clients(*targets, background)
        try:
            run, normal = _run_entry(plan, setting, arm, pathlib.Path(base["base_agent"]), files, clients, out, seed,
                                     heldout, passages, progress)
        finally:
            clients.close()
    result = {"setting": setting, "arm": arm_name, "run": run, "normal": normal,
              "task_s": time.perf_counter() - started}
    _write_json(_run_file(out, setting, arm_name), result)
    _print_run(seed, setting, arm_name, run, normal, len(heldout))
    return result


def assemble_seed(plan: StudyPlan, out: pathlib.Path) -> JsonObject:
    """A seed's record from its base and the runs finished so far, in run order (the record
    one process writes), saved as ``seed_result.json``; ``complete`` once every run is in.
    Its ``arms_s`` and ``seed_s`` are the seconds its tasks took, added up."""
    base = json.loads((out / BASE_RESULT).read_text(encoding="utf-8"))
    record = base["record"]
    tasks_s = 0.0
    done = 0
    for setting, arm in plan.run_order():
        path = _run_file(out, setting, arm.name)
        if path.is_file():
            result = json.loads(path.read_text(encoding="utf-8"))
            _add_run(record, setting, arm.name, result["run"], result["normal"])
            tasks_s += result["task_s"]
            done += 1
    if done:
        record["timings"]["arms_s"] = tasks_s
    record["timings"]["seed_s"] = base["task_s"] + tasks_s
    record["complete"] = done == len(plan.run_order())
    save_seed_result(out, record)
    return record


def _run_tasks_in_processes(plan: StudyPlan, out: pathlib.Path, jobs: int, native_kernels: bool) -> list[JsonObject]:
    """Every seed's base and runs as ``calibrl study --worker`` tasks, at most ``jobs`` at
    once; each seed's services run from its base's end to its last run's. Returns the seed
    records in seed order."""
    from calibrl.demo.services import calibrl_command, service_env

    with open(out / PLAN_FILE, "wb") as handle:
        pickle.dump(plan, handle)
    runs = plan.run_order()
    ready = [_Task(seed) for seed in plan.seeds]
    left = {seed: len(runs) for seed in plan.seeds}
    running: list[tuple[_Task, subprocess.Popen, IO[str]]] = []
    services: dict[int, tuple[contextlib.ExitStack, tuple[str, str]]] = {}
    command, env = calibrl_command(), service_env(1)
    try:
        while ready or running:
            while ready and len(running) < jobs:
                task = min(ready, key=lambda t: t.priority(plan))
                ready.remove(task)
                running.append(_start_task(plan, out, task, command, env, native_kernels,
                                           services[task.seed][1] if task.setting else None))
            time.sleep(1.0)
            for entry in list(running):
                task, process, log = entry
                if process.poll() is None:
                    continue
                running.remove(entry)
                log.close()
                seed_dir = out / f"seed_{task.seed}"
                if process.returncode != 0:
                    tail = pathlib.Path(log.name).read_text(encoding="utf-8", errors="replace")[-3000:]
                    raise StudyError(f"{task.name} failed (exit {process.returncode}); its log ends:\n{tail}")
                print(f"    {task.name} done", flush=True)
                if not task.setting:  # the seed's runs can start: its services come up for them
                    stack = contextlib.ExitStack()
                    services[task.seed] = (stack, stack.enter_context(_services(seed_dir)))
                    ready.extend(_Task(task.seed, setting, arm.name) for setting, arm in runs)
                    continue
                assemble_seed(plan, seed_dir)
                left[task.seed] -= 1
                if not left[task.seed]:
                    services.pop(task.seed)[0].close()
    finally:  # a failed task, or SIGTERM / Ctrl-C here: stop the workers, then the services
        for _, process, log in running:
            if process.poll() is None:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(60)
            log.close()
        for stack, _ in services.values():
            stack.close()
        (out / PLAN_FILE).unlink(missing_ok=True)
    return [json.loads((out / f"seed_{seed}" / SEED_RESULT).read_text(encoding="utf-8")) for seed in plan.seeds]


def _start_task(plan: StudyPlan, out: pathlib.Path, task: _Task, command: list[str], env: dict[str, str],
                native_kernels: bool, targets: tuple[str, str] | None) -> tuple[_Task, subprocess.Popen, IO[str]]:
    seed_dir = out / f"seed_{task.seed}"
    seed_dir.mkdir(parents=True, exist_ok=True)
    log = open(seed_dir / (f"worker-{task.setting}-{task.arm}.log" if task.setting else "worker-base.log"), "w",
               encoding="utf-8")
    args = [*command, "study", "--worker", "--plan-file", str(out / PLAN_FILE), "--seeds", str(task.seed),
            "--out", str(seed_dir), *(["--native-kernels"] if native_kernels else [])]
    if targets is not None:
        args += ["--run", f"{task.setting}:{task.arm}", "--services", ",".join(targets)]
    return task, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env), log


class StudyError(CalibrlError):
    """A seed of the study failed; the message shows its log."""


# --------------------------------------------------------------------------- entry point


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> (0, 1, 2); a clear error for anything else."""
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r}: give at least one seed, each >= 0 and once")
    return seeds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="calibrl study",
        description="Train the search agent's arms (GRPO, CalibAdv with gold documents as silver, CalibAdv with the "
        "authors' silver documents) from the demo's base over several seeds, under the demo's learning rate, a "
        "stress setting and a 4x longer run; report each arm's held-out search recall and answer F1 with 95% "
        "intervals (over questions, and over seeds then questions), and the collapse signals per step.",
    )
    parser.add_argument("--seeds", default=DEFAULT_SEEDS,
                        help=f"comma-separated seeds (default {DEFAULT_SEEDS}: seeds no design choice was made on; "
                             "experiments/LOG.md)")
    parser.add_argument("--quick", action="store_true", help="the demo's --quick sizes: a smoke run")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated arms of {[a.name for a in ARMS]} (default {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated settings of {list(SETTINGS)} (default all)")
    parser.add_argument("--out", default="calibrl_study_out", help="output folder (default calibrl_study_out)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes at once (default 1: everything in this process); each seed's base "
                        "agent, then each of its runs, is a task of its own")
    parser.add_argument("--heldout-limit", type=int, default=0,
                        help="evaluate only the first N held-out questions of each seed (0 = all; for smoke runs)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if it holds something else")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report of --out from the runs its seeds have finished so far (a study stopped "
                        "part way, or still running), and stop")
    parser.add_argument("--merge", action="append", default=[], metavar="DIR",
                        help="write one report in --out over the seed records of several studies of the same plan run "
                        "apart (repeat: each DIR a study's --out or an earlier report's folder), and stop")
    parser.add_argument("--native-kernels", action="store_true",
                        help="this CPU's fastest float kernels instead of kernels pinned to AVX2 (calibrl.kernels)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one task, no report
    parser.add_argument("--plan-file", help=argparse.SUPPRESS)  # the worker's plan (the parent's StudyPlan)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the worker's run, SETTING:ARM (none: the seed's base)
    parser.add_argument("--services", help=argparse.SUPPRESS)  # the run's retrieval and judge targets
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)

    from calibrl import kernels

    print(f"float kernels: {kernels.pin(native=args.native_kernels).reason}")  # before torch loads

    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for flag, value, low in (("--jobs", args.jobs, 1), ("--heldout-limit", args.heldout_limit, 0)):
        if value < low:
            print(f"error: {flag}={value}: must be >= {low}", file=sys.stderr)
            return 2
    from calibrl.demo.settings import FULL, QUICK
    from calibrl.retrieval_server.cli import hide_library_progress_bars

    hide_library_progress_bars()  # the study prints one line per run; its logs hold the rest

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [a for a in arms if a not in {arm.name for arm in ARMS}] + [s for s in settings if s not in SETTINGS]
    if unknown or not arms or not settings:
        print(f"error: --arms {args.arms!r} / --settings {args.settings!r}: unknown or empty: {unknown}; arms are "
              f"{[a.name for a in ARMS]}, settings {list(SETTINGS)}", file=sys.stderr)
        return 2
    plan = StudyPlan(QUICK if args.quick else FULL, seeds, heldout_limit=args.heldout_limit,
                     arms=tuple(a for a in ARMS if a.name in arms), settings=tuple(s for s in SETTINGS if s in settings))
    out = pathlib.Path(args.out)
    if args.report_only or args.merge:
        try:
            path = merge_reports(out, [pathlib.Path(d) for d in args.merge]) if args.merge else report_only(out)
            print(f"report: {path}")
        except CalibrlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if not args.worker:
        problem = _prepare_out(out, args.overwrite)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    command = "calibrl study " + " ".join(a for a in (argv if argv is not None else sys.argv[2:]))
    started = time.perf_counter()
    # SIGTERM unwinds like Ctrl-C, so the services and workers are stopped on the way out
    # (during training the trainer's own handler checkpoints first; train_arm then raises).
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if args.worker:
            return _worker(args, plan, seeds[0], out)
        path = run_study(plan, out, jobs=args.jobs, command=command.strip(), native_kernels=args.native_kernels)
    except CalibrlError as exc:
        print(f"\nstudy failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"\ncalibrl study finished in {time.perf_counter() - started:.0f}s; report: {path}")
    return 0


def _worker(args: argparse.Namespace, plan: StudyPlan, seed: int, out: pathlib.Path) -> int:
    """One task of a study run with --jobs > 1 (:func:`_run_tasks_in_processes`)."""
    if args.plan_file:
        with open(args.plan_file, "rb") as handle:  # written by this study's parent process
            plan = pickle.load(handle)
    if not args.run:
        seed_base(plan, seed, out)
        return 0
    setting, _, arm = args.run.partition(":")
    retrieval, _, judge = (args.services or "").partition(",")
    seed_run(plan, seed, out, setting, arm, (retrieval, judge))
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _prepare_out(out: pathlib.Path, overwrite: bool) -> str | None:
    """Empty ``out`` for a new study; the reason it may not, or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    if out.exists() and any(out.iterdir()):
        if not (overwrite or (out / STUDY_MARKER).exists()):
            return f"--out {out} is not empty and holds no earlier study; pass --overwrite or choose another folder"
        shutil.rmtree(out)
    return None


__all__ = ["ARMS", "Arm", "DEFAULT_ARMS", "SETTINGS", "StudyPlan", "main", "parse_seeds", "question_scores", "run_seed", "run_study"]
