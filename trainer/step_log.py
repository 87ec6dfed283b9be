"""A step's metrics: assembled from the stages, reduced over ranks, checked, written.

Metric names follow TRL where TRL has one (see ``calibrl.trainer.diagnostics``); the
per-phase seconds are ``timing/*`` and the health counters ``health/*``.
:meth:`StepLog.record` is the one place a step's metrics are written (the JSONL +
report_to trackers' run log on rank 0, the progress bar, the caller's ``on_step``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from calibrl import tracking
from calibrl.config import to_dict
from calibrl.trainer import diagnostics as diag
from calibrl.trainer import distributed as dist_util
from calibrl.trainer.checkpoint import TrainState
from calibrl.sme.queue import ReviewQueue
from calibrl.trainer.rubric_versions import RubricVersionLog
from calibrl.trainer.config import TrainConfig
from calibrl.trainer.task_kinds import task_kind
from calibrl.trainer.training_batch import TrainingBatch
from calibrl.trainer.update import UpdateResult

if TYPE_CHECKING:  # pragma: no cover
    from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Seconds spent in each phase of a step."""

    generation: float = 0.0  # sampling this step's (and, off-policy, the next step's) rollouts
    overlap_forward: float = 0.0  # forward passes run while the rewards were computed
    reward_wait: float = 0.0  # waiting for rewards after those forward passes
    update: float = 0.0  # loss, backward, optimizer step, engine weight sync
    step: float = 0.0  # the whole step

    def metrics(self) -> dict[str, float]:
        return {
            "timing/generation": self.generation,
            "timing/overlap_forward": self.overlap_forward,
            "timing/reward_wait": self.reward_wait,
            "timing/update": self.update,
            "timing/step": self.step,
            "timing/reward_wait_share": self.reward_wait / self.step if self.step > 0 else 0.0,
        }


def rank_step_metrics(training: TrainingBatch, update: UpdateResult, times: StepTimes,
                      health: diag.HealthConfig | None = None,
                      sampling: dict[str, float] | None = None) -> dict[str, float]:
    """This rank's metrics of one step, before the reduction over ranks. ``health``: its
    ``rubric_high`` sets the judge/retrieval disagreement threshold (default config's
    when None); ``sampling``: the ``sampling/*`` metrics of dynamic sampling."""
    batch = training.batch
    rubric_high = (health or diag.HealthConfig()).rubric_high
    return {
        **update.metrics,
        **training.metrics,
        **(sampling or {}),
        **diag.component_metrics([b.components for b in training.breakdowns]),
        **diag.judge_retrieval_disagreement(training.breakdowns, rubric_high),
        **kind_step_metrics(training),
        **diag.completion_metrics(batch.completion_mask),
        **times.metrics(),
        "rollout/staleness": 0.0 if training.behaviour_logp is None else 1.0,
    }


def kind_step_metrics(training: TrainingBatch) -> dict[str, float]:
    """The task kind's own metrics of the step (``TaskKind.step_metrics``; none when it has none)."""
    rollouts = training.batch.rollouts
    metrics_of = task_kind(rollouts[0].task.kind).step_metrics if rollouts else None
    return metrics_of(rollouts, training.breakdowns) if metrics_of is not None else {}


class StepLog:
    """Reduces, checks and writes each step's metrics; keeps this process's history."""

    def __init__(self, config: TrainConfig, ctx: dist_util.DistContext, resume_step: int,
                 on_step: Callable[[int, dict[str, float]], None] | None = None,
                 tracker: "tracking.Tracker | None" = None) -> None:
        """``tracker``: experiment trackers to log to (``calibrl.tracking.open_trackers``), left
        open for the caller to add to and close; by default ``config.report_to``'s are opened
        here and closed by :meth:`close`."""
        self.config, self.ctx, self.on_step = config, ctx, on_step
        self.history: list[dict[str, float]] = []
        self.run_log = None
        if ctx.is_main:
            own_tracker = tracker is None
            if own_tracker:
                tracker = tracking.open_trackers(config.trackers(), config.run_dir, project=config.tracking_project,
                                                 config=to_dict(config), resume_step=resume_step)
            self.run_log = diag.RunLog(config.run_dir, resume_step=resume_step, tracker=tracker,
                                       close_tracker=own_tracker)
        self.progress = _progress_bar(config, ctx, initial=resume_step)
        # the rubric version of every step, rubric_changed when it moves (rank 0 writes the file)
        self.rubric_versions = RubricVersionLog(config.run_dir if ctx.is_main else None, resume_step)
        # every review.every_steps steps, recent rollouts sampled into the experts' review queue (rank 0)
        self.review = ReviewQueue(config.review, config.run_dir, write=ctx.is_main)

    @property
    def tracker(self) -> "tracking.Tracker | None":
        """The trackers this log writes to (rank 0), for other records of the run; None elsewhere."""
        return self.run_log.tracker if self.run_log is not None else None

    def record(self, step: int, metrics: dict[str, float], state: TrainState) -> dict[str, float]:
        """Average ``metrics`` over ranks, add the health warnings, write them everywhere."""
        metrics = dist_util.reduce_metrics(metrics, self.ctx)
        warnings = diag.health_warnings(metrics, self.config.health)
        for warning in warnings:
            log.warning("step %d: %s", step, warning)
        state.warnings_total += len(warnings)
        metrics["health/warnings"] = float(len(warnings))
        metrics["health/warnings_total"] = float(state.warnings_total)
        metrics["health/skipped_updates_total"] = float(state.skipped_updates)
        if self.run_log is not None:
            self.run_log.write(step, metrics)
        self.history.append(metrics)
        if self.progress is not None:
            self.progress.set_postfix_str(diag.progress_postfix(metrics))
            self.progress.update(1)
        if self.on_step is not None:
            self.on_step(step, metrics)
        return metrics

    def observe_rollouts(self, step: int, training: TrainingBatch) -> dict[str, float]:
        """The step's rubric-version and review-queue metrics (calibrl.trainer.rubric_versions,
        calibrl.sme.queue)."""
        metrics = self.rubric_versions.observe(step, [b.rubric for b in training.breakdowns])
        metrics.update(self.review.observe(step, training.batch.rollouts, training.breakdowns))
        return metrics

    def close(self) -> None:
        if self.run_log is not None:
            self.run_log.close()
        if self.progress is not None:
            self.progress.close()


def _progress_bar(config: TrainConfig, ctx: dist_util.DistContext, initial: int) -> "tqdm | None":
    if not (config.progress_bar and ctx.is_main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=initial, desc="train", unit="step", dynamic_ncols=True)


__all__ = ["StepLog", "StepTimes", "kind_step_metrics", "rank_step_metrics"]
