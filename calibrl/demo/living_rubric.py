"""`calibrl demo living-rubric`: a rubric the policy games, caught by fresh expert grades and
fixed while the run goes on. Opt-in, separate from `calibrl demo`; a few minutes on two CPU cores.

    calibrl demo living-rubric                 # default sizes
    calibrl demo living-rubric --out DIR       # where everything goes (default calibrl_living_rubric_out/)

The story, on the built-in domain (:mod:`calibrl.demo.domain`, nothing downloaded):

1. **A weak rubric.** Version 1 of the rewriter's rubric pays mostly for content words
   (``specificity`` with a high ``min_terms``). On the base policy's rewrites it roughly agrees with
   the experts (specific queries are the ones that find their passage); piling up names and terms
   raises it whether or not the rewrite still finds what the user asked for. The rubric carries a
   high weight in the reward (:attr:`LivingSettings.w_rubric`), as when a team trusts its judge:
   the policy follows the judge more than the search.
   Each run checks this before use (:func:`base_agreement`): the experts grade the base policy's
   greedy rewrites of every training task, and the report gives version 1's kappa on them.
2. **Two runs from one base policy, same seed.** The *uncorrected* run trains on that rubric to
   its end (``review.on_alarm=warn``); the *corrected* run trains on a second id served by the
   same judge server, with ``review.on_alarm=downweight``.
3. **Fresh expert grades.** Every ``review_every`` steps each run queues rollouts for review
   (:mod:`calibrl.sme.queue`) and the simulated experts of :mod:`calibrl.demo.fresh_grades`
   grade them at once: they search the catalogue with the rewrite and grade the gold passage's
   rank, a rule that shares no word list, count or threshold with the judge. The trainer's drift
   check reads them on the next review step.
4. **The exploit's onset and the drift alarm.** The onset is read from each run's metrics by a rule
   written in code, not fitted to the run it reads (:func:`exploit_onset`: the rollouts' mean
   length stays above :data:`LENGTH_RISE` x its first review window's mean); the report gives the
   first alarm's step minus the onset's. Below the gate the trainer's drift check names the criteria that disagree;
   in the corrected run the alarm lowers the rubric's weight, and the demo builds the next version
   from the judge's own programmatic scorers (:func:`candidate_versions`, one or two of
   :data:`CANDIDATE_CRITERIA`): each candidate is scored on the fresh grades of the last
   :data:`SELECTION_REVIEWS` reviews with the trainer's check (:func:`rubric_kappa`), and the best
   is published, by a rename into the judge's folder, only when its kappa clears the gate and beats
   the current version's (a version is served only when it passes the gate). The judge server's
   poller loads it and the run continues on it without a restart; the weight is restored on the
   first step it scores. Otherwise the run goes on with the lowered weight and the next alarm tries
   again on newer grades. The grades of later rollouts, which chose nothing, check the published version against
   version 1 in both runs (:func:`check_published`).
5. **Retrieval.** The base, uncorrected and corrected policies' greedy rewrites of the
   held-out tasks are searched (BM25, hit@1); the corrected-minus-uncorrected difference gets a
   paired bootstrap interval that resamples whole (product, topic) clusters
   (:func:`calibrl.stats.paired_difference`); so is every policy on the *validation* tasks, training
   (product, topic) pairs set aside (:func:`task_splits`) that the runs never train on. The sizes
   (:class:`LivingSettings`) were chosen on the training records and the validation tasks by rules
   written before the runs that applied them (experiments/LOG.md, L2-L4); ``--validation-only``
   runs leave the held-out (test) tasks unread.

Everything the report and figures show is read from the run records (``metrics.jsonl``,
``review/drift.jsonl``, ``rubric_versions.jsonl``) and ``results.json`` by
:mod:`calibrl.demo.living_rubric_report`, never typed in. The judge is served with
``judge.allow_unvalidated=true``: the demo's gate is the drift check on fresh grades, not the
validation record of a golden set (docs/concepts/rubric-lifecycle.md has the full cycle).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from calibrl.demo.living_rubric_report import report_markdown, run_records, write_figures

RUBRIC_IDS = {"uncorrected": "rewriter-frozen", "corrected": "rewriter-living"}
RETRIEVAL_MODE = "bm25"
WEAK_RUBRIC = """\
id: {id}
version: "1"
description: The demo's weak rewriter rubric; it pays for piling content words.
glossary: {glossary}
criteria:
  - name: stuffing_pays
    kind: programmatic
    scorer: specificity
    params: {{min_terms: 14}}
    weight: 0.7
  - name: keeps_entities
    kind: programmatic
    scorer: entity_coverage
    weight: 0.3
"""

# The judge's programmatic scorers a next version is built from (name: the criterion's YAML): every
# scorer that reads a rewrite and its query alone (not a search step's context, not a compliance
# pattern), at its registered defaults. Each candidate is one of them or two, equally weighted, and
# keeps the rubric's glossary; the fresh grades choose.
CANDIDATE_CRITERIA = {
    "keeps_entities": {"kind": "programmatic", "scorer": "entity_coverage"},
    "keeps_intent": {"kind": "programmatic", "scorer": "intent_similarity"},
    "specific": {"kind": "programmatic", "scorer": "specificity"},
    "within_length": {"kind": "programmatic", "scorer": "length"},
    "well_formed": {"kind": "programmatic", "scorer": "format"},
    "no_new_names": {"kind": "programmatic", "scorer": "invented_entities"},
    "catalogue_terms": {"kind": "programmatic", "scorer": "glossary_terms"},
}
# A candidate is chosen on the grades of the rollouts of the last SELECTION_REVIEWS review windows
# before the alarm: what the experts say about what the policy writes now.
SELECTION_REVIEWS = 2
# The exploit's onset, read from a run's metrics (exploit_onset): the first step from which the
# rollouts' mean generated length stays above LENGTH_RISE x its mean over the first review window
# for ONSET_SUSTAIN steps. Fixed in code, not fitted to the run it reads: piling words makes
# rewrites longer.
LENGTH_RISE = 1.25
ONSET_SUSTAIN = 3
# The training tasks' (product, topic) pairs set aside to choose the demo's sizes on (never trained
# on): a pair goes to validation when the first 8 bytes of sha256("<product>/<topic>"), read as a
# fraction of 2**64, fall below VALIDATION_FRACTION. The held-out (test) pairs are the domain's own.
VALIDATION_FRACTION = 0.25


@dataclass(frozen=True)
class LivingSettings:
    """Sizes of one living-rubric demo run."""

    steps: int = 80
    review_every: int = 5
    review_n: int = 16
    drift_min_items: int = 10
    min_kappa: float = 0.6
    downweight_factor: float = 0.25
    group_size: int = 4
    prompts_per_step: int = 8
    warm_steps: int = 400  # a base on whose rewrites v1 roughly agrees with the experts (chosen on training tasks)
    rewrite_examples: int = 1500
    lr: float = 4e-4
    kl_beta: float = 0.08
    max_new_tokens: int = 24
    w_rubric: float = 0.7  # chosen on the validation tasks (experiments/LOG.md, L4)
    heldout_limit: int = 0  # 0: every held-out task
    resamples: int = 10_000


QUICK = LivingSettings(steps=6, review_every=2, review_n=8, drift_min_items=6, warm_steps=20, rewrite_examples=300,
                       prompts_per_step=4, heldout_limit=24, resamples=2000)


def weak_rubric(rubric_id: str, glossary: Sequence[str] = ()) -> str:
    """Version 1 of the demo's rewriter rubric, with the domain's ``glossary`` (its catalogue terms)."""
    return WEAK_RUBRIC.format(id=rubric_id, glossary=json.dumps(list(glossary)))


def is_validation_pair(product: str, topic: str) -> bool:
    """Whether a training (product, topic) pair is set aside for validation (:data:`VALIDATION_FRACTION`)."""
    import hashlib

    digest = hashlib.sha256(f"{product}/{topic}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < VALIDATION_FRACTION


def task_splits(domain: Any) -> dict[str, list[Any]]:
    """The rewrite tasks by split: ``train`` (the runs train on them), ``validation`` (training pairs
    set aside, :func:`is_validation_pair`) and ``heldout`` (the domain's held-out pairs: the test split)."""
    train = domain.tasks("train")
    return {"train": [t for t in train if not is_validation_pair(t.entity_key, t.aspect_key)],
            "validation": [t for t in train if is_validation_pair(t.entity_key, t.aspect_key)],
            "heldout": domain.tasks("heldout")}


def candidate_versions(text: str) -> list[tuple[tuple[str, ...], str]]:
    """(criteria, next version of the rubric ``text``) for every set of one or two
    :data:`CANDIDATE_CRITERIA`, equally weighted, except the current version's own set."""
    import itertools

    import yaml

    data = yaml.safe_load(text)
    current = tuple(sorted(c["name"] for c in data["criteria"]))
    glossary = {"glossary": data["glossary"]} if data.get("glossary") else {}
    version = str(int(data["version"]) + 1)
    candidates = []
    for size in (1, 2):
        for names in itertools.combinations(CANDIDATE_CRITERIA, size):
            if tuple(sorted(names)) == current:
                continue
            criteria = [{"name": n, **CANDIDATE_CRITERIA[n], "weight": round(1 / size, 4)} for n in names]
            candidate = {"id": data["id"], "version": version,
                         "description": f"The rewriter rubric, version {version}: {', '.join(names)}, chosen on "
                                        "fresh expert grades.", **glossary, "criteria": criteria}
            candidates.append((names, yaml.safe_dump(candidate, sort_keys=False)))
    return candidates


def exploit_onset(metrics: Sequence[dict[str, Any]], baseline_steps: int, rise: float = LENGTH_RISE,
                  sustain: int = ONSET_SUSTAIN) -> dict[str, Any]:
    """The exploit's onset in a run's step metrics: the first step after the first ``baseline_steps``
    from which ``completions/mean_length`` stays above ``rise`` x its mean over those steps for
    ``sustain`` steps (``step`` None: it never does)."""
    lengths = {int(m["step"]): float(m["completions/mean_length"]) for m in metrics}
    baseline = sum(lengths[s] for s in range(1, baseline_steps + 1)) / baseline_steps
    threshold = rise * baseline
    onset = next((s for s in sorted(lengths) if s > baseline_steps
                  and all(lengths.get(s + k, 0.0) > threshold for k in range(sustain))), None)
    return {"step": onset, "baseline_length": baseline, "threshold": threshold, "rise": rise, "sustain": sustain}


# --------------------------------------------------------------------------- the run


def run_living_rubric(out: pathlib.Path, settings: LivingSettings = LivingSettings(), seed: int = 6,
                      progress: bool = False, read_test: bool = True) -> dict[str, Any]:
    """Every stage (module doc); writes ``out/results.json``, the figures and ``out/report.md``.
    ``read_test`` False: the held-out (test) tasks are not evaluated, only the validation tasks."""
    import torch

    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.demo.policy import PolicySpec, _warm_start_and_save, rewrite_examples, tokenizer_corpus, train_tokenizer
    from calibrl.demo.services import IndexBuild

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def stage(name: str) -> None:
        timings[name] = round(time.perf_counter() - started - sum(timings.values()), 1)
        print(f"    {name}: {timings[name]:.1f}s", flush=True)

    domain = generate_domain(seed)
    files = write_domain(domain, out / "data")
    splits = task_splits(domain)
    split_files = {name: out / "data" / f"living_{name}.jsonl" for name in splits}
    for name, tasks in splits.items():
        split_files[name].write_text("".join(json.dumps(t.record()) + "\n" for t in tasks), encoding="utf-8")
    index_dir = out / "index"
    build = IndexBuild(files.corpus, index_dir, out / "logs" / "index_build.log")  # beside the warm start
    try:
        examples = rewrite_examples(domain, settings.rewrite_examples, seed=seed)
        tokenizer = train_tokenizer(tokenizer_corpus(domain, examples))
        base = out / "base_rewriter"
        _warm_start_and_save(base, tokenizer, PolicySpec(), examples, settings.warm_steps, 32, seed, progress=progress)
        stage("warm start")
        build.wait()
    finally:
        build.stop()
    stage("index")

    rubrics = out / "rubrics"
    rubrics.mkdir(exist_ok=True)
    glossary = domain.glossary_terms()
    for rubric_id in RUBRIC_IDS.values():
        (rubrics / f"{rubric_id}.yaml").write_text(weak_rubric(rubric_id, glossary), encoding="utf-8")
    with _Services(rubrics, index_dir) as services:
        runs = {}
        for name in ("uncorrected", "corrected"):
            runs[name] = _train(name, base, split_files["train"], domain, services, out, settings, seed, progress)
            runs[name]["version_1"] = weak_rubric(runs[name]["rubric_id"], glossary)
            stage(f"train {name}")
        agreement = base_agreement(runs["uncorrected"]["version_1"], base, split_files["train"], domain, settings)
        stage("version 1 on the base policy")
        evaluations = {"validation": _evaluate(domain, splits["validation"], out, base, runs, services, settings)}
        stage("validation evaluation")
        evaluations["heldout"] = (_evaluate(domain, splits["heldout"][: settings.heldout_limit or None], out, base,
                                            runs, services, settings) if read_test else None)
        if read_test:
            stage("held-out evaluation")
    for name, run in runs.items():
        run["onset"] = exploit_onset(run_records(out, name)["metrics"], settings.review_every)
    results = {"settings": asdict(settings), "seed": seed, "runs": runs, **evaluations, "timings": timings,
               "check": check_published(out, runs, settings), "selection_reviews": SELECTION_REVIEWS,
               "split_sizes": {name: len(tasks) for name, tasks in splits.items()}, "base_agreement": agreement}
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    figures = write_figures(out)
    (out / "report.md").write_text(report_markdown(out, figures), encoding="utf-8")
    return results


class _Services:
    """A real judge server (gRPC on loopback, its folder polled) and the in-process retrieval, on one
    background event loop."""

    def __init__(self, rubrics: pathlib.Path, index_dir: pathlib.Path) -> None:
        self.rubrics, self.index_dir = rubrics, index_dir

    def __enter__(self) -> "_Services":
        from calibrl.config import load_config
        from calibrl.judge_server.config import JudgeServerConfig
        from calibrl.judge_server.server import start
        from calibrl.retrieval_server.retriever import Retriever
        from calibrl.trainer.aio import BackgroundLoop
        from calibrl.trainer.grpc_clients import GrpcJudgeClient
        from calibrl.trainer.inprocess import InProcessRetrievalClient

        self.background = BackgroundLoop(name="living-rubric")
        config = load_config(JudgeServerConfig, None, [
            f"rubrics={self.rubrics}", "serving.port=0", "serving.host=127.0.0.1", "serving.grace_seconds=1",
            "judge.allow_unvalidated=true", "judge.embedder=hashed-ngrams", "rubric_poll_s=0.2"])
        self.judge_server = self.background.run(start(config))
        self.judge = GrpcJudgeClient(f"127.0.0.1:{self.judge_server.port}", timeout_s=60)
        self.retrieval = InProcessRetrievalClient(Retriever.load(self.index_dir, device="cpu"))
        return self

    def served_hash(self, rubric_id: str) -> str:
        rubrics = self.background.run(self.judge.list_rubrics())
        return next(r["hash"] for r in rubrics if r["id"] == rubric_id)

    def __exit__(self, *exc: object) -> None:
        self.background.run(self.judge.close())
        self.background.run(self.judge_server.stop(grace=1.0))
        self.background.close()


def _train(name: str, base: pathlib.Path, train_tasks: pathlib.Path, domain: Any, services: _Services, out: pathlib.Path,
           settings: LivingSettings, seed: int, progress: bool) -> dict[str, Any]:
    from calibrl.demo.fresh_grades import FreshGrader
    from calibrl.judge_server.authoring.feedback import read_feedback, write_feedback
    from calibrl.sme.items import read_items
    from calibrl.demo.search_design import RECORDED_FORWARD
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.loop import train

    rubric_id = RUBRIC_IDS[name]
    run_dir = out / "runs" / name
    config = load_train_config(None, [
        RECORDED_FORWARD, f"policy.path={base}", "policy.device=cpu", f"tasks.path={train_tasks}", f"seed={seed}",
        f"services.index_dir={services.index_dir}",
        f"steps={settings.steps}", f"output_dir={run_dir}", "checkpoint_every=0", "keep_checkpoints=1",
        f"loss.beta={settings.kl_beta}", f"optimizer.lr={settings.lr}", "max_grad_norm=0.5",
        f"rollout.group_size={settings.group_size}", f"rollout.prompts_per_step={settings.prompts_per_step}",
        f"rollout.max_new_tokens={settings.max_new_tokens}", f"reward.mode={RETRIEVAL_MODE}",
        "reward.retrieval_signal=mrr", "reward.top_k=10", f"reward.w_retrieval={1 - settings.w_rubric}",
        f"reward.w_rubric={settings.w_rubric}", f"reward.rubric_id={rubric_id}", f"services.judge=127.0.0.1:{services.judge_server.port}",
        f"review.every_steps={settings.review_every}", f"review.n={settings.review_n}",
        "review.embedder=hashed-ngrams", f"review.drift_min_items={settings.drift_min_items}",
        f"review.min_kappa={settings.min_kappa}", f"review.seed={seed}",
        f"review.on_alarm={'downweight' if name == 'corrected' else 'warn'}",
        f"review.downweight_factor={settings.downweight_factor}", "report_to=none",
        f"progress_bar={str(progress).lower()}"])
    grader = FreshGrader(domain.passages)
    feedback = run_dir / "review" / "feedback.jsonl"
    published: list[dict[str, Any]] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if step % settings.review_every:
            return
        queue = read_items(run_dir / "review" / "queue.jsonl") if (run_dir / "review" / "queue.jsonl").exists() else []
        graded = {r.id for r in read_feedback(feedback)} if feedback.exists() else set()
        fresh = [item for item in queue if f"{item.id}@{grader.reviewer}" not in graded]
        if fresh:  # graded at once: the next review step's drift check reads them
            old = read_feedback(feedback) if feedback.exists() else []
            write_feedback(feedback, [*old, *grader.feedback(fresh)])
        if name == "corrected" and metrics.get("drift/alarm") == 1.0:  # every alarm may bring the next version
            published.append(_publish_fix(rubric_id, run_dir, step, services, settings))

    train(config, retrieval=services.retrieval, judge=services.judge, on_step=on_step,
          background=services.background)
    return {"rubric_id": rubric_id, "run_dir": str(run_dir.relative_to(out)), "published": published,
            "final_policy": str((run_dir / "checkpoints").relative_to(out))}


def base_agreement(rubric_text: str, base: pathlib.Path, tasks_path: pathlib.Path, domain: Any,
                   settings: LivingSettings) -> dict[str, Any]:
    """Version 1 validated before use: the experts grade the base policy's greedy rewrites of the
    training tasks in ``tasks_path``, and the trainer's drift check gives the rubric's kappa on those grades."""
    from calibrl.demo.fresh_grades import FreshGrader
    from calibrl.demo.rewrite_analysis import _greedy_rewrites
    from calibrl.sme.items import SampleItem
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.tasks import load_tasks

    tasks = load_tasks(tasks_path)
    rewrites = _greedy_rewrites(str(base), tasks, EvalSettings(top_k=1, mode=RETRIEVAL_MODE,
                                                                max_new_tokens=settings.max_new_tokens, device="cpu"))
    items = [SampleItem(id=f"base-{t.task_id}", query=t.query, output=r, gold_doc_ids=tuple(t.gold_doc_ids))
             for t, r in zip(tasks, rewrites)]
    records = FreshGrader(domain.passages).feedback(items)
    return {"items": len(records), "expert_pass": sum(r.expert_pass(4) for r in records),
            "kappa": rubric_kappa(rubric_text, records, settings)}


def rubric_kappa(rubric_text: str, records: Sequence[Any], settings: LivingSettings) -> float | None:
    """Cohen's kappa of the rubric ``rubric_text`` against the expert grades ``records``, by the
    trainer's own drift check (review.pass_threshold's default); None without a verdict."""
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.judge import Judge
    from calibrl.judge_server.rubric import parse_rubric
    from calibrl.sme.drift import DriftOptions, drift_report

    if not records:
        return None
    rubric = parse_rubric(rubric_text)
    judge = Judge([rubric], JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True))
    scores = judge.compute(rubric, [r.to_item() for r in records], record=False)
    options = DriftOptions(min_kappa=settings.min_kappa, pass_threshold=0.6, min_items=2)
    value = drift_report(rubric, records, scores, options, judge.scorer_id(rubric)).kappa
    return None if value is None or math.isnan(value) else float(value)


def rollout_step(record_id: str) -> int:
    """The training step of the rollout a feedback record grades (its item id is ``s<step>-...``)."""
    return int(record_id.split("-", 1)[0][1:])


def _publish_fix(rubric_id: str, run_dir: pathlib.Path, step: int, services: _Services,
                 settings: LivingSettings) -> dict[str, Any]:
    """The next version: the candidate (:func:`candidate_versions`) that agrees best with the fresh
    grades of the last :data:`SELECTION_REVIEWS` review windows' rollouts. It is published, by a
    rename into the judge's folder, only when its kappa there clears the drift gate and beats the
    current version's; then this returns once the judge serves it (the next step scores with it).
    The grades of later rollouts, which chose nothing, check it at the end (:func:`check_published`)."""
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.rubric import parse_rubric

    drift = [json.loads(line) for line in (run_dir / "review" / "drift.jsonl").read_text().splitlines() if line]
    path = services.rubrics / f"{rubric_id}.yaml"
    current = path.read_text(encoding="utf-8")
    first = step - SELECTION_REVIEWS * settings.review_every
    feedback = [r for r in read_feedback(run_dir / "review" / "feedback.jsonl") if rollout_step(r.id) > first]
    record: dict[str, Any] = {"step": step, "disagreeing": drift[-1]["disagreeing"], "published": False,
                              "chosen_on": {"items": len(feedback), "first_rollout_step": first + 1,
                                            "last_rollout_step": max(rollout_step(r.id) for r in feedback)},
                              "kappa_before": rubric_kappa(current, feedback, settings)}
    record["candidates"] = [{"criteria": list(names), "kappa": rubric_kappa(text, feedback, settings), "text": text}
                            for names, text in candidate_versions(current)]
    ranked = [c for c in record["candidates"] if c["kappa"] is not None]
    best = max(ranked, key=lambda c: c["kappa"], default=None)
    before = record["kappa_before"] if record["kappa_before"] is not None else -1.0
    if best is not None:
        record.update(best_criteria=best["criteria"], best_kappa=best["kappa"], best_text=best["text"])
    if best is None or best["kappa"] <= before or best["kappa"] < settings.min_kappa:
        # a version is served only when it passes the gate (docs/concepts/rubric-lifecycle.md)
        record["why_not"] = (f"the best candidate, {' + '.join(best['criteria'])}, has kappa {best['kappa']:.2f} on "
                             f"those grades (version 1: {before:.2f}; the gate: {settings.min_kappa:g})"
                             if best is not None else "no candidate reaches a verdict on those grades")
        return record
    text = best["text"]
    record.update(criteria=best["criteria"], kappa_after=best["kappa"], text=text)
    staged = path.with_name(path.name + ".next")
    staged.write_text(text, encoding="utf-8")
    staged.replace(path)
    new_hash = parse_rubric(text).hash
    deadline = time.monotonic() + 30
    while services.served_hash(rubric_id) != new_hash:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the judge did not load {rubric_id} version {new_hash[:12]} within 30 s")
        time.sleep(0.1)
    record.update(published=True, hash=new_hash, version=parse_rubric(text).version)
    return record


def check_published(out: pathlib.Path, runs: dict[str, Any], settings: LivingSettings) -> list[dict[str, Any]]:
    """Each published version (or, when none was, the first alarm's best candidate) against version 1
    on the grades that chose nothing: those of rollouts after the last one its choice read, in each run."""
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.rubric import parse_rubric

    attempts = [f for run in runs.values() for f in run["published"] if "best_text" in f]
    chosen = [f for f in attempts if f["published"]] or attempts[:1]
    checks = []
    for fix in chosen:
        after = fix["chosen_on"]["last_rollout_step"]
        for name, run in runs.items():
            path = out / run["run_dir"] / "review" / "feedback.jsonl"
            later = [r for r in read_feedback(path) if rollout_step(r.id) > after] if path.exists() else []
            checks.append({"published": fix["published"], "criteria": fix["best_criteria"],
                           "version": parse_rubric(fix["best_text"]).version, "alarm_step": fix["step"],
                           "hash": parse_rubric(fix["best_text"]).hash, "run": name, "after_step": after,
                           "items": len(later), "expert_pass": sum(r.expert_pass(4) for r in later),
                           "kappa_v1": rubric_kappa(run["version_1"], later, settings),
                           "kappa_candidate": rubric_kappa(fix["best_text"], later, settings)})
    return checks


def _evaluate(domain: Any, tasks: Sequence[Any], out: pathlib.Path, base: pathlib.Path, runs: dict[str, Any],
              services: _Services, settings: LivingSettings) -> dict[str, Any]:
    """Greedy rewrites of ``tasks`` by the base and each run's final policy, searched with BM25 (hit@1),
    and the corrected-minus-uncorrected difference, resampled by (product, topic) cluster."""
    from calibrl.demo.rewrite_analysis import greedy_rewrite_hits
    from calibrl.stats import paired_difference
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.tasks import load_tasks

    path = out / "data" / "living_evaluated.jsonl"
    path.write_text("".join(json.dumps(t.record()) + "\n" for t in tasks), encoding="utf-8")
    loaded = load_tasks(path)
    path.unlink()
    eval_settings = EvalSettings(top_k=1, mode=RETRIEVAL_MODE, max_new_tokens=settings.max_new_tokens, device="cpu")
    models = {"base": str(base)}
    for name, run in runs.items():
        models[name] = str(_latest_checkpoint(out / run["run_dir"]))
    hits = {name: greedy_rewrite_hits(model, loaded, services.retrieval, eval_settings, services.background.run)
            for name, model in models.items()}
    clusters = [[t.entity_key, t.aspect_key] for t in tasks]
    diff = paired_difference(hits["corrected"], hits["uncorrected"], clusters=[tuple(c) for c in clusters],
                             resamples=settings.resamples, seed=0)
    return {"tasks": [t.task_id for t in tasks], "clusters": clusters, "hits": hits, "top_k": 1,
            "difference": {"a": "corrected", "b": "uncorrected", **diff.as_dict()}}


def _latest_checkpoint(run_dir: pathlib.Path) -> pathlib.Path:
    from calibrl.trainer.checkpoint import find_checkpoint

    return find_checkpoint(run_dir)


# --------------------------------------------------------------------------- the command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="calibrl demo living-rubric", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="calibrl_living_rubric_out", help="output folder (made if missing)")
    parser.add_argument("--seed", type=int, default=6, help="seed of the domain, the policies and the runs (6)")
    parser.add_argument("--quick", action="store_true", help="a smoke run with few steps (about a minute)")
    parser.add_argument("--progress", action="store_true", help="progress bars")
    parser.add_argument("--validation-only", action="store_true",
                        help="evaluate the validation tasks only, not the held-out (test) tasks: for choosing sizes")
    parser.add_argument("--w-rubric", type=float, default=None,
                        help=f"the rubric's weight in the reward (default {LivingSettings.w_rubric})")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.w_rubric is not None and not 0.0 < args.w_rubric < 1.0:
        parser.error(f"--w-rubric must be in (0, 1), got {args.w_rubric}")
    out = pathlib.Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} is not empty; give a new folder", file=sys.stderr)
        return 2
    from calibrl.errors import CalibrlError

    try:
        settings = QUICK if args.quick else LivingSettings()
        if args.w_rubric is not None:
            settings = replace(settings, w_rubric=args.w_rubric)
        results = run_living_rubric(out, settings, seed=args.seed, progress=args.progress,
                                    read_test=not args.validation_only)
    except CalibrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    split = "validation" if args.validation_only else "heldout"
    diff = results[split]["difference"]
    print(f"report: {out / 'report.md'}; {split} hit@1 corrected - uncorrected {diff['estimate']:+.3f} "
          f"[{diff['low']:+.3f}, {diff['high']:+.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
