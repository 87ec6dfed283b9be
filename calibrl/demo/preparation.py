"""Stages 1-5 of ``calibrl demo``: the domain, the rubrics and their validation, the LLM
judge, the index and the two services.

Each stage is a function that takes what the stages before it made and returns a frozen
hand-off (:class:`Generated`, :class:`Rubrics`, :class:`Served`) or a library record
(the validation record, :class:`calibrl.demo.judge_model.JudgeModel`).
"""

from __future__ import annotations

import math
import pathlib
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from calibrl.demo.context import DemoError, RunContext
from calibrl.demo.settings import (GATE, PASS_THRESHOLD, RETRIEVAL_MODE, RUBRIC_ID, STEP_RUBRIC, STEP_RUBRIC_ID,
                                   DemoSettings)

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.domain import Domain, DomainFiles
    from calibrl.demo.judge_model import JudgeModel
    from calibrl.demo.services import IndexBuild, Service
    from calibrl.judge_server.authoring.feedback import FeedbackRecord
    from calibrl.judge_server.rubric import Rubric
    from calibrl.judge_server.validation_records import ValidationRecord


class Stoppable(Protocol):
    """A subprocess the demo started (a service, the index build): stopped on the way out."""

    def stop(self) -> object: ...


@dataclass(frozen=True)
class Generated:
    """Stage 1: the domain and where its files are."""

    domain: "Domain"
    files: "DomainFiles"


@dataclass(frozen=True)
class Rubrics:
    """Stage 2: the programmatic rubric, the LLM rubric and the golden set, in ``folder``."""

    folder: pathlib.Path  # every rubric the judge server serves
    rubric: "Rubric"  # the programmatic one
    rubric_path: pathlib.Path
    llm_rubric: "Rubric"
    llm_rubric_path: pathlib.Path
    golden: list["FeedbackRecord"]
    golden_path: pathlib.Path


@dataclass(frozen=True)
class Served:
    """Stage 5: both services, SERVING on loopback."""

    retrieval: "Service"
    judge: "Service"
    metrics_port: int  # the judge server's Prometheus port, 0 without the prometheus extra


def generate(run: RunContext) -> Generated:
    """Stage 1: the built-in domain, written as the files a user would bring."""
    from calibrl.demo.domain import generate_domain, write_domain
    from calibrl.demo.experts import agreement_line, panel_agreement

    with run.stages.stage("generate the built-in domain (seeded, no download)"):
        domain = generate_domain(run.seed)
        files = write_domain(domain, run.out / "data")
        glossary = run.out / "data" / "glossary.txt"
        glossary.write_text("\n".join(domain.glossary_terms()) + "\n", encoding="utf-8")
        print(f"    {len(domain.passages)} passages, {len(domain.tasks('train'))} train / "
              f"{len(domain.tasks('heldout'))} held-out rewrite tasks, {len(domain.multistep('train'))} train / "
              f"{len(domain.multistep('heldout'))} held-out two-search questions, "
              f"{len(domain.sme_feedback)} SME reviews -> {files.root}")
        print(f"    {agreement_line(panel_agreement(domain.sme_panel))}")
    return Generated(domain, files)


def start_index_build(run: RunContext, generated: Generated) -> "IndexBuild":
    """Stage 4, started now: `calibrl index build` runs as a process beside stages 2-3b (one torch
    thread each, so the two use both cores; a separate process shares no state), joined at stage 4."""
    from calibrl.demo.services import IndexBuild

    return IndexBuild(generated.files.corpus, run.out / "index", run.logs / "index_build.log")


def distil(run: RunContext, generated: Generated) -> Rubrics:
    """Stage 2: the SME feedback into the programmatic rubric + golden set, and the LLM rubric."""
    from calibrl.demo.judge_model import LLM_RUBRIC_ID, distill_llm_rubric

    files, glossary = generated.files, generated.domain.glossary_terms()
    folder = run.out / "rubrics"
    rubric_path = folder / f"{RUBRIC_ID}.yaml"
    golden_path = run.out / "golden.jsonl"
    with run.stages.stage("calibrl rubric distill: SME feedback -> rubric + golden set"):
        rubric, golden = distill_rubric(files.sme_feedback, glossary, rubric_path, golden_path)
        llm_rubric_path = folder / f"{LLM_RUBRIC_ID}.yaml"
        llm_rubric = distill_llm_rubric(files.sme_feedback, glossary, llm_rubric_path)
        print(f"    LLM rubric {llm_rubric.id} hash {llm_rubric.hash[:12]}: "
              + ", ".join(f"{c.name}={c.weight:g}" for c in llm_rubric.criteria))
        if STEP_RUBRIC.is_file():  # the search agent's step rubric, served by the same judge
            shutil.copy(STEP_RUBRIC, folder / STEP_RUBRIC.name)
    return Rubrics(folder, rubric, rubric_path, llm_rubric, llm_rubric_path, golden, golden_path)


def validate(run: RunContext, generated: Generated, rubrics: Rubrics) -> "ValidationRecord":
    """Stage 3: the programmatic judge vs the SME golden set."""
    with run.stages.stage("calibrl rubric validate: programmatic judge vs the SME golden set"):
        validation = validate_rubric(rubrics.rubric, rubrics.golden, rubrics.rubric_path,
                                     generated.files.sme_feedback)
        print(f"    gate {'PASSED' if validation.passed else 'FAILED'}: {validation.reason}")
    return validation


def llm_judge(run: RunContext, generated: Generated, rubrics: Rubrics) -> "JudgeModel":
    """Stage 3b: the LLM judge of the LLM rubric (:func:`build_llm_judge`)."""
    with run.stages.stage("the LLM judge: tokenizer, warm start, calibrl rubric train-judge, validate --judge "
                          "transformers:..."):
        return build_llm_judge(run.settings, generated.domain, generated.files.sme_feedback, rubrics.llm_rubric,
                               rubrics.llm_rubric_path, rubrics.golden, rubrics.golden_path, run.out, run.seed,
                               run.progress)


def join_index(run: RunContext, index_build: "IndexBuild") -> None:
    """Stage 4: wait for the index build started beside stages 2-3b."""
    with run.stages.stage("calibrl index build: corpus -> dense (MiniLM) + BM25 index (built beside stages 2-3b)"):
        index_build.wait()
        print(index_summary(run.out / "index"), flush=True)


def serve(run: RunContext, rubrics: Rubrics, judge_model: "JudgeModel", allow_unvalidated: bool,
          started: list[Stoppable]) -> Served:
    """Stage 5: `calibrl serve retrieval` and `calibrl serve judge` on loopback (each appended to
    ``started`` as it starts, so that the caller stops it), healthy before this returns."""
    from calibrl.demo.services import Service, free_port

    with run.stages.stage("start calibrl serve retrieval + calibrl serve judge (loopback), wait for health"):
        retrieval_port, judge_port = free_port(), free_port()
        retrieval = Service("retrieval server", [
            "serve", "retrieval", "--index", str(run.out / "index"), "--port", str(retrieval_port),
            f"default_mode={RETRIEVAL_MODE}", "device=cpu", "torch_threads=1", "serving.grace_seconds=2",
            "serving.drain_seconds=0",  # loopback, no load balancer to tell
        ], retrieval_port, run.logs / "serve_retrieval.log")
        metrics_port = free_port() if _has_prometheus() else 0
        judge_args = _judge_args(rubrics, judge_model, judge_port, metrics_port, allow_unvalidated)
        judge = Service("judge server", judge_args, judge_port, run.logs / "serve_judge.log")
        for service in (retrieval, judge):
            service.start()
            started.append(service)
        for service in (retrieval, judge):
            seconds = service.wait_healthy()
            print(f"    {service.name} SERVING on {service.target} after {seconds:.1f}s: "
                  f"{' '.join(service.command[-len(service.args):])}")
    return Served(retrieval, judge, metrics_port)


def _judge_args(rubrics: Rubrics, judge_model: "JudgeModel", port: int, metrics_port: int,
                allow_unvalidated: bool) -> list[str]:
    from calibrl.demo.judge_model import serve_overrides

    args = ["serve", "judge", "--rubrics", str(rubrics.folder), "--backend", judge_model.spec,
            "--port", str(port), "serving.grace_seconds=2", "serving.drain_seconds=0", *serve_overrides()]
    if STEP_RUBRIC.is_file():  # no SME golden set exists for search steps: served unvalidated, by name
        args.append(f"judge.unvalidated_rubrics={STEP_RUBRIC_ID}")
    if metrics_port:  # the report's per-rubric calls, batch sizes and cache hits come from /metrics
        args += ["serving.telemetry.enabled=true", f"serving.telemetry.prometheus_port={metrics_port}"]
    if allow_unvalidated:
        args.append("--allow-unvalidated")
    return args


def _has_prometheus() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("opentelemetry.exporter.prometheus",
                                                                  "prometheus_client"))


# --- the library calls behind the stages (also used by the study and the probes) -------------------------------


def distill_rubric(feedback: pathlib.Path, glossary: Sequence[str], rubric_path: pathlib.Path,
                   golden_path: pathlib.Path) -> tuple["Rubric", list["FeedbackRecord"]]:
    """Stage 2: distil the SME feedback into the demo's rubric (programmatic criteria) and a
    golden hold-out set; write both. Returns (rubric, golden records)."""
    from calibrl.judge_server.authoring.distill import DistillOptions, distill
    from calibrl.judge_server.authoring.feedback import read_feedback, write_feedback
    from calibrl.judge_server.rubric import dump_rubric

    records = read_feedback(feedback)
    options = DistillOptions(rubric_id=RUBRIC_ID, criteria_mode="programmatic", glossary=tuple(glossary))
    result = distill(records, options)
    rubric_path.parent.mkdir(parents=True, exist_ok=True)
    rubric_path.write_text(dump_rubric(result.rubric), encoding="utf-8")
    write_feedback(golden_path, result.golden)
    print(f"    rubric {result.rubric.id} v{result.rubric.version} hash {result.rubric.hash}\n"
          f"    {len(records)} records: {len(result.train)} distilled, {len(result.golden)} golden -> {golden_path}\n"
          f"    criteria: " + ", ".join(f"{c.name}={c.weight:g}{'(penalty)' if c.penalty else ''}"
                                       for c in result.rubric.criteria))
    return result.rubric, list(result.golden)


def validate_rubric(rubric: "Rubric", golden: Sequence["FeedbackRecord"], rubric_path: pathlib.Path,
                    feedback: pathlib.Path) -> "ValidationRecord":
    """Stage 3: the programmatic judge against the golden set (pass threshold picked on the
    non-golden reviews of ``feedback``); the validation record is written beside the rubric
    (the judge server reads it) and returned."""
    from calibrl.config import load_config
    from calibrl.demo.judge_model import validation_options
    from calibrl.judge_server.authoring.validation import (find_record, read_records, validate_judge,
                                                           validation_path, write_record)
    from calibrl.judge_server.config import JudgeConfig

    config = load_config(JudgeConfig, None, ["backend=programmatic", "allow_unvalidated=true", "cache_size=0"])
    record = validate_judge(rubric, golden, config, *validation_options(PASS_THRESHOLD, GATE, feedback))
    path = validation_path(rubric_path)
    write_record(path, record)
    stored = find_record(read_records(path), record.rubric_hash, record.model_id)
    if stored is None:  # the judge server would refuse the rubric
        raise DemoError(f"{path} holds no validation record for rubric {rubric.id} and judge {record.model_id}")
    return stored


def build_llm_judge(settings: DemoSettings, domain: "Domain", feedback: pathlib.Path, rubric: "Rubric",
                    rubric_path: pathlib.Path, golden: Sequence["FeedbackRecord"], golden_path: pathlib.Path,
                    out: pathlib.Path, seed: int, progress: bool) -> "JudgeModel":
    """Stage 3b: build, fine-tune (training reviews only) and validate the LLM judge
    (:mod:`calibrl.demo.judge_model`) under ``out/judge_model``; its validation record lands
    beside its rubric."""
    from calibrl.demo.judge_model import JudgeModelSettings, build_and_validate_judge

    judge = build_and_validate_judge(
        domain, feedback, rubric, rubric_path, golden, golden_path, out / "judge_model",
        JudgeModelSettings(warm_steps=settings.judge_warm_steps, epochs=settings.judge_epochs),
        pass_threshold=PASS_THRESHOLD, gate=GATE, seed=seed, progress=progress)
    first, last = judge.warm_losses
    print(f"    judge model {judge.model_id}: warm-start loss {first:.2f} -> {last:.2f}; "
          f"trained on {len(judge.training.train)} reviews (golden {len(judge.training.held_out)} never); "
          + ", ".join(f"{k} {v:.0f}s" for k, v in judge.seconds.items()))
    print("    held-in agreement after training: " + ", ".join(
        f"{name} {figures['final'].get('agreement', math.nan):.2f}"
        for name, figures in judge.training.record["criteria"].items()))
    print(f"    gate {'PASSED' if judge.validation.passed else 'FAILED'}: {judge.validation.reason}")
    return judge


def build_demo_index(corpus: pathlib.Path, index_dir: pathlib.Path, echo: bool = True) -> str:
    """Stage 4 in this process (the study and the probes): the dense (MiniLM) + BM25 index of
    the corpus, on the CPU; returns (and with ``echo`` prints) its one-line summary."""
    from calibrl.retrieval_server.corpus import file_sha256, read_corpus
    from calibrl.retrieval_server.index import build_index

    passages = read_corpus(corpus, "beir")
    build_index(passages, index_dir, corpus_sha256=file_sha256(corpus), corpus_format="beir",
                device="cpu", overwrite=True, show_progress=False)
    line = index_summary(index_dir)
    if echo:
        print(line, flush=True)
    return line


def index_summary(index_dir: pathlib.Path) -> str:
    """The one-line summary of a built index, from its manifest."""
    from calibrl.retrieval_server.manifest import read_manifest

    manifest = read_manifest(index_dir)
    return (f"    built {index_dir}: {manifest.doc_count} passages, {manifest.dimension}-d {manifest.index_type} "
            f"dense index ({manifest.embedder}) + BM25")


__all__ = ["Generated", "Rubrics", "Served", "Stoppable", "build_demo_index", "build_llm_judge", "distil",
           "distill_rubric", "generate", "index_summary", "join_index", "llm_judge", "serve", "start_index_build",
           "validate", "validate_rubric"]
