"""``calibrl eval --run-dir``: a finished training run's checkpoints evaluated afterwards,
and the results added to that run's own tracker runs as a table.

The tracker runs are the ones the training run recorded in ``<run_dir>/trackers.json``
(TensorBoard: ``<run_dir>/tensorboard``), filed under the run's ``tracking_project``
(read from its latest checkpoint's config.yaml); they are reopened to append
(:func:`calibrl.tracking.open_trackers` with ``append=True``), so nothing they hold
is dropped. Each row is one checkpoint, keyed by its step, in the layout of the
trainer's own held-out table (:func:`calibrl.tracking.log_heldout_table`).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Sequence

from calibrl.errors import CalibrlError, ConfigError
from calibrl.tracking import check_report_to, log_heldout_table, open_trackers, recorded_trackers
from calibrl.trainer.checkpoint import load_train_state, MODEL_DIR, STATE_FILE
from calibrl.trainer.eval import CHECKPOINT_CONFIG

log = logging.getLogger(__name__)


def run_checkpoints(run_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The complete checkpoints of the run in ``run_dir``, oldest first."""
    folder = pathlib.Path(run_dir) / "checkpoints"
    found = sorted(p for p in folder.glob("step_*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp"))
    if not found:
        raise ConfigError(f"--run-dir {run_dir}: no checkpoints under {folder}; is this a `calibrl train` output_dir?")
    return found


def checkpoint_step(model: str | pathlib.Path, run_dir: str | pathlib.Path) -> int:
    """The step of ``model`` (a checkpoint of the run in ``run_dir``, its ``model/``
    folder, or the run dir itself: its latest checkpoint); ConfigError for anything else."""
    path, run = pathlib.Path(model).resolve(), pathlib.Path(run_dir).resolve()
    if path == run:
        checkpoint = run_checkpoints(run)[-1]
    elif (path / STATE_FILE).exists():
        checkpoint = path
    elif path.name == MODEL_DIR and (path.parent / STATE_FILE).exists():
        checkpoint = path.parent
    else:
        checkpoint = None
    if checkpoint is None or checkpoint.resolve().parent != run / "checkpoints":
        raise ConfigError(f"--model {model} is not a checkpoint of --run-dir {run_dir}: each row of the run's table "
                          f"is one of its checkpoints ({run / 'checkpoints'}/step_*)")
    return load_train_state(checkpoint).step


def run_trackers(run_dir: str | pathlib.Path, report_to: Sequence[str] | None = None) -> tuple[list[str], str]:
    """The trackers that get the table, and the run's ``tracking_project`` (from its latest
    checkpoint's config.yaml): ``report_to``, or by default every tracker the run logged
    to; each must hold a run of ``run_dir`` (ConfigError naming what it has)."""
    # lazy: config imports the judge server, which this module does not
    from calibrl.trainer.config import load_train_config

    path = run_checkpoints(run_dir)[-1] / CHECKPOINT_CONFIG
    try:
        config = load_train_config(path)
    except ConfigError as exc:
        raise ConfigError(f"--run-dir {run_dir}: cannot read the run's training config: {exc}") from None
    names = config.trackers() if report_to is None else check_report_to(report_to, field="--report-to")
    recorded = recorded_trackers(run_dir)
    for name in names:
        if name not in recorded:
            raise ConfigError(f"--report-to: the run in {run_dir} has no {name} run to add the table to (it logged "
                              f"to: {', '.join(recorded) or 'no tracker'})")
    return names, config.tracking_project


def log_to_run(run_dir: str | pathlib.Path, curve: Sequence[tuple[int, dict[str, Any]]], names: Sequence[str],
               project: str, *, table: str = "heldout") -> None:
    """Add ``curve`` ((step, metrics) rows) as the table ``table`` to the run's tracker runs
    ``names`` (filed under ``project``; :func:`run_trackers` gives both). A tracker that
    fails to take it is an error, not a skip."""
    if not names:
        return
    trackers = open_trackers(names, run_dir, project=project, append=True)
    try:
        log_heldout_table(trackers, sorted(curve, key=lambda row: row[0]), name=table)
        failed = sorted(set(names) - set(trackers.names))
    finally:
        trackers.close()
    if failed:
        raise CalibrlError(f"could not add the table to the run's {', '.join(failed)} run (the log above says why)")
    log.info("table %r (%d rows) added to the tracker runs of %s: %s", table, len(curve), run_dir, ", ".join(names))


__all__ = ["checkpoint_step", "log_to_run", "run_checkpoints", "run_trackers"]
