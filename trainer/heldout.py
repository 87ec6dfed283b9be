"""Held-out evaluation during training (the ``eval.*`` section of the train config).

When: after step N when ``eval.every`` divides N, after the last step, and before the
first step as step 0 with ``eval.on_start``. Each evaluation runs after that step's
checkpoint (when one is due) is written, so a crash during it loses no training; a
run stopped (SIGTERM, ``stop_after``, a crash) at a step whose evaluation was due and
not recorded evaluates it first thing when it is resumed from that step.

How: :func:`calibrl.trainer.eval.evaluate_policy`, the library behind ``calibrl eval``,
on the live policy (no reload): greedy decoding, the run's own prompt
(``rollout.prompt_template`` / ``chat_template``, as ``calibrl eval`` reads them from a
checkpoint's config.yaml) and decode limits (``rollout.max_new_tokens``, ``max_turns``,
``search_top_k``, ``max_obs_tokens``). The RNG state is saved and restored around it,
so a run's training numbers are the same with or without evaluation.

Where, on rank 0 (the other ranks wait at the next collective):

- one JSON line per evaluation in ``<output_dir>/heldout.jsonl``, beside metrics.jsonl:
  ``{"step", "tasks", "num_tasks", "seconds", "metrics": {...}}`` (an undefined metric,
  such as ``gold_doc_recall`` without gold ids, is null); a resumed run keeps the lines
  of the steps up to the one it resumes from, as metrics.jsonl does. An evaluation
  that fails (a service error after its retries) is a line ``{"step", ..., "error"}``
  and an error in the log, and training goes on: a held-out row is a report, not a
  reward, and none is made up;
- the metrics as ``eval/<name>`` scalars at that step in the ``report_to`` trackers;
- when the run completes, the trackers' table ``heldout`` (the demo's layout:
  ``step`` and every metric; :func:`calibrl.tracking.log_heldout_table`), with every
  evaluated step of the run, those of earlier processes of a resumed run included.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import time
from typing import TYPE_CHECKING, Any

from calibrl.errors import CalibrlError, ConfigError
from calibrl.tracking import log_heldout_table
from calibrl.trainer import checkpoint as ckpt
from calibrl.trainer.eval import EvalSettings, evaluate_policy, PromptChoice
from calibrl.trainer.tasks import load_tasks, split_tasks

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.task_kinds import RunAsync
    from calibrl import tracking
    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.eval import EvalSettings, PromptChoice
    from calibrl.trainer.policy import Policy
    from calibrl.trainer.tasks import Task

log = logging.getLogger(__name__)

HELDOUT_FILE = "heldout.jsonl"
METRIC_PREFIX = "eval/"  # tracker scalars of the held-out metrics (TRL's eval namespace)

Curve = list[tuple[int, dict[str, Any]]]  # (step, held-out metrics), in step order


def load_heldout_tasks(config: "TrainConfig", training_kind: str) -> tuple[list["Task"], str]:
    """The held-out tasks of ``config.eval`` and a description of where they came from.
    They must be of the kind the run trains (``training_kind``)."""
    forced = None if config.tasks.kind == "auto" else config.tasks.kind
    if config.eval.heldout_split:
        # exactly the split training made (calibrl.trainer.run_setup.load_training_tasks): limit, then split
        tasks = load_tasks(config.tasks.path, kind=forced, fmt=config.tasks.format)
        if config.tasks.limit:
            tasks = tasks[: config.tasks.limit]
        _, tasks = split_tasks(tasks, config.tasks.heldout_fraction, config.seed)
        source, field = f"{config.tasks.path} (held-out split {config.tasks.heldout_fraction:g})", "eval.heldout_split"
    else:
        tasks = load_tasks(config.eval.tasks, kind=forced)
        source, field = config.eval.tasks, "eval.tasks"
    if config.eval.limit:
        tasks = tasks[: config.eval.limit]
    if not tasks:
        raise ConfigError(f"{field}: {source} holds no tasks to evaluate")
    kinds = sorted({t.kind for t in tasks})
    if kinds != [training_kind]:
        raise ConfigError(f"{field}: {source} holds {'/'.join(kinds)} tasks but the run trains a {training_kind} "
                          "agent; give held-out tasks of the same kind")
    return tasks, source


def read_heldout(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of a run's ``heldout.jsonl``, in order (none when it has no file)."""
    path = pathlib.Path(run_dir) / HELDOUT_FILE
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def heldout_curve(records: list[dict[str, Any]]) -> Curve:
    """``(step, metrics)`` of each evaluation that succeeded, in step order."""
    return sorted(((int(r["step"]), dict(r["metrics"])) for r in records if "metrics" in r),
                  key=lambda pair: pair[0])


def format_heldout(curve: Curve) -> str:
    """The held-out curve as an aligned text table: one row per evaluated step."""
    names = sorted({k for _, metrics in curve for k in metrics})
    header = ["step", *names]
    body = [[str(step), *("-" if metrics.get(k) is None else f"{metrics[k]:.3f}" for k in names)]
            for step, metrics in curve]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *body])


class HeldoutEvaluator:
    """Evaluates one run's policy on its held-out tasks and records the results."""

    def __init__(self, config: "TrainConfig", tasks: list["Task"], source: str, retrieval: "RetrievalClient",
                 run_async: "RunAsync", tracker: "tracking.Tracker | None", *, is_main: bool,
                 resume_step: int) -> None:
        self.config, self.tasks, self.source = config, tasks, source
        self.retrieval, self.run_async, self.tracker, self.is_main = retrieval, run_async, tracker, is_main
        rollout = config.rollout
        self.settings: EvalSettings = EvalSettings(
            top_k=config.eval.top_k, mode=config.reward.mode, max_new_tokens=rollout.max_new_tokens,
            max_turns=rollout.max_turns, search_top_k=rollout.search_top_k, max_obs_tokens=rollout.max_obs_tokens,
            batch_size=config.eval.batch_size,
        )
        self.prompt: PromptChoice = PromptChoice(template=rollout.prompt_template, chat_template=rollout.chat_template,
                                                 template_source="training config",
                                                 chat_template_source="training config")
        self.path = config.run_dir / HELDOUT_FILE
        self.records: list[dict[str, Any]] = []
        if is_main:
            kept = [r for r in read_heldout(config.run_dir) if resume_step > 0 and r["step"] <= resume_step]
            config.run_dir.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in kept)
            self.records = kept

    def evaluate_if_due(self, step: int, policy: "Policy") -> dict[str, float] | None:
        """Evaluate the policy after ``step`` steps when ``eval`` asks for it and it has not
        been evaluated yet; its metrics, or None (nothing due, or not rank 0)."""
        if not self.is_main or not self.config.eval.due(step, self.config.steps):
            return None
        if any(r["step"] == step and "metrics" in r for r in self.records):
            return None
        return self.evaluate(step, policy)

    def evaluate(self, step: int, policy: "Policy") -> dict[str, float] | None:
        """Evaluate now; the metrics, or None when the evaluation failed (recorded, logged)."""
        started = time.perf_counter()
        rng = ckpt.rng_state()  # greedy decoding draws nothing, but the run's numbers must not depend on that
        try:
            metrics = evaluate_policy(policy, self.tasks, self.retrieval, self.settings, run_async=self.run_async,
                                      prompt=self.prompt)
        except CalibrlError as exc:
            # Training goes on: a held-out row is a report, not a reward. The failure is kept in
            # heldout.jsonl (no row is made up) and a resume at this step tries again.
            self._append({"step": step, "tasks": self.source, "num_tasks": len(self.tasks), "error": str(exc)})
            log.error("held-out evaluation at step %d failed: %s; training goes on without this row (evaluate the "
                      "checkpoints later with `calibrl eval --run-dir %s`)", step, exc, self.config.run_dir)
            return None
        finally:
            ckpt.set_rng_state(rng)
        seconds = time.perf_counter() - started
        record = {"step": step, "tasks": self.source, "num_tasks": len(self.tasks), "seconds": round(seconds, 3),
                  "metrics": {k: (float(v) if math.isfinite(v) else None) for k, v in sorted(metrics.items())}}
        self._append(record)
        if self.tracker is not None:
            self.tracker.log_metrics({METRIC_PREFIX + k: v for k, v in metrics.items()}, step)
        log.info("held-out evaluation at step %d (%d tasks, %.1fs): %s", step, len(self.tasks), seconds,
                 ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())))
        return metrics

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        self.records.append(record)

    def curve(self) -> Curve:
        return heldout_curve(self.records)

    def finish(self, stopped: str) -> Curve:
        """At the end of this process's part of the run: the held-out curve so far; when the
        run is complete, also the trackers' ``heldout`` table."""
        curve = self.curve()
        if self.is_main and stopped == "completed" and self.tracker is not None and curve:
            log_heldout_table(self.tracker, curve)
        return curve


__all__ = ["HELDOUT_FILE", "METRIC_PREFIX", "HeldoutEvaluator", "format_heldout", "heldout_curve", "load_heldout_tasks",
           "read_heldout"]
