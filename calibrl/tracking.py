"""Experiment trackers behind one interface, for the trainer's ``report_to``.

``report_to`` names any of TensorBoard, Weights & Biases, MLflow and trackio
(several at once, or ``none``), as TRL's does. :func:`open_trackers` opens one
:class:`Tracker` per name behind a fan-out; each logs

- the resolved config, once, when it opens;
- every step's metrics under the names ``metrics.jsonl`` uses (TRL's where TRL
  has one: ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``kl``, ...);
- tables (the held-out evaluation) through :meth:`Tracker.log_table`.

Where the data goes is each tool's own business and its own settings:
TensorBoard writes ``<run_dir>/tensorboard``; W&B follows ``WANDB_MODE`` (``offline``
keeps the run under ``<run_dir>/wandb`` for a later ``wandb sync``) and its login;
MLflow logs to ``MLFLOW_TRACKING_URI`` (a ``file:`` store, a server); trackio keeps
its local store (``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``).

Each tool but TensorBoard is an optional extra, imported only when named; a
missing one is a :class:`~calibrl.errors.ConfigError` naming the extra
(``pip install 'calibrl[wandb]'``), raised at config load. A resumed run continues
the same tracker runs (ids kept in ``<run_dir>/trackers.json``). A tracker that
fails while logging is reported in the log and dropped; the others and
``metrics.jsonl`` go on, so a dashboard outage never stops a training run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import pathlib
from typing import Any, Iterable, Mapping, Sequence

from calibrl.errors import ConfigError

log = logging.getLogger(__name__)

NONE = "none"
# tracker name -> (module that must import, the extra that installs it; None: a core dependency)
TRACKERS: dict[str, tuple[str, str | None]] = {
    "tensorboard": ("tensorboard", None),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
_IDS_FILE = "trackers.json"
HELDOUT_TABLE = "heldout"  # the table of held-out metrics by step (the demo's and `calibrl train`'s eval.*)


def check_report_to(names: Sequence[str], field: str = "report_to") -> list[str]:
    """The tracker names of ``names`` (``[]`` for ``none``), each checked to be known and
    installed; raises ConfigError naming ``field``, the value and the fix."""
    names = [n.strip().lower() for n in names]
    if NONE in names:
        if len(names) > 1:
            raise ConfigError(f"{field}={names}: 'none' cannot be combined with trackers; give one or the other")
        return []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"{field}: {name!r} is not a tracker; choose from {sorted(TRACKERS)} or 'none'")
    if len(set(names)) != len(names):
        raise ConfigError(f"{field}={names}: a tracker is named twice")
    for name in names:
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            fix = f"pip install 'calibrl[{extra}]'" if extra else f"pip install {module}"
            raise ConfigError(f"{field} includes {name!r} but {module} is not installed: {fix}")
    return names


class Tracker:
    """One experiment tracker's run. Subclasses log the config when they open."""

    name = "tracker"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Scalars per step; the config and tables as text (markdown) in ``<run_dir>/tensorboard``."""

    name = "tensorboard"

    def __init__(self, run_dir: pathlib.Path, config: Mapping[str, Any], resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = {"purge_step": resume_step + 1} if resume_step > 0 else {}
        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), **purge)
        if config:
            self._writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        lines = ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
        self._writer.add_text(name, "\n".join(lines), 0)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """A W&B run named after the run folder; ``WANDB_MODE=offline`` keeps it local."""

    name = "wandb"

    def __init__(self, run_dir: pathlib.Path, run_name: str, project: str, config: Mapping[str, Any],
                 run_id: str | None) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=dict(config),
                               id=run_id, resume="allow" if run_id else None, reinit="create_new")
        self.run_id = self._run.id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._run.log({name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``project`` (``MLFLOW_TRACKING_URI`` chooses the store):
    the config as flattened params plus ``config.json``, metrics by step, tables as
    JSON artifacts in ``mlflow.log_table``'s split layout (``columns`` + ``data``)."""

    name = "mlflow"
    _PARAMS_PER_CALL = 100  # MLflow's log_batch limit
    _PARAM_CHARS = 6000  # MLflow's param value limit

    def __init__(self, run_name: str, project: str, config: Mapping[str, Any], run_id: str | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        if run_id:
            self._client.update_run(run_id, status="RUNNING")
        else:
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[: self._PARAM_CHARS]) for k, v in sorted(_flatten(config).items())]
            for start in range(0, len(params), self._PARAMS_PER_CALL):
                self._client.log_batch(run_id, params=params[start : start + self._PARAMS_PER_CALL])
            self._client.log_dict(run_id, dict(config), "config.json")
        self.run_id = run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), float(v), stamp, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._client.log_dict(self.run_id, {"columns": list(columns), "data": [list(r) for r in rows]}, f"{name}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class TrackioTracker(Tracker):
    """A trackio run in project ``project``, in trackio's local store (``TRACKIO_DIR``)."""

    name = "trackio"

    def __init__(self, run_name: str, project: str, config: Mapping[str, Any], resume: bool) -> None:
        import trackio

        self._trackio = trackio
        self._run = trackio.init(project=project, name=run_name, config=dict(config),
                                 resume="allow" if resume else "never", auto_log_cpu=False, auto_log_gpu=False)
        self.run_id = run_name

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._run.log({name: self._trackio.Table(columns=list(columns), data=[list(r) for r in rows])})

    def close(self) -> None:
        self._run.finish()


class Trackers(Tracker):
    """Fan-out over the opened trackers (none at all is fine: every call is a no-op)."""

    name = "trackers"

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        finite = {k: float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self._each("log_metrics", finite, step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self._each("log_table", name, columns, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:  # noqa: BLE001 - close the others all the same
                log.exception("tracker %s failed to close", tracker.name)
        self.trackers = []

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception:  # noqa: BLE001 - one tracker's outage must not stop training
                log.exception("tracker %s failed in %s; it is dropped for the rest of the run "
                              "(metrics.jsonl and the other trackers go on)", tracker.name, method)
                self.trackers.remove(tracker)
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001 - it has failed already; the report above stands
                    pass


def open_trackers(report_to: Sequence[str], run_dir: str | pathlib.Path, *, run_name: str = "",
                  project: str = "calibrl", config: Mapping[str, Any] | None = None,
                  resume_step: int = 0, append: bool = False) -> Trackers:
    """Open every tracker of ``report_to`` for the run in ``run_dir`` (logging ``config``).

    ``resume_step`` > 0 continues the tracker runs recorded in ``run_dir`` (a resumed
    training run; TensorBoard drops what was logged after ``resume_step``); otherwise
    new ones are started. ``append`` reopens the tracker runs of a run that has
    ended, to add to them (``calibrl eval --run-dir``): nothing logged is dropped, the
    config is not logged again, and a tracker the run did not use is a ConfigError."""
    names = check_report_to(report_to)
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_name = run_name or run_dir.resolve().name
    config = dict(config or {})
    ids_path = run_dir / _IDS_FILE
    known: dict[str, str] = {}
    if (resume_step > 0 or append) and ids_path.exists():
        known = json.loads(ids_path.read_text(encoding="utf-8"))
    if append:
        config, resume_step = {}, 0  # TensorBoard: no purge step, no second config text
        _check_recorded(names, run_dir)
    opened = Trackers()
    try:
        for name in names:
            if name == "tensorboard":
                opened.trackers.append(TensorBoardTracker(run_dir, config, resume_step))
            elif name == "wandb":
                opened.trackers.append(WandbTracker(run_dir, run_name, project, config, known.get("wandb")))
            elif name == "mlflow":
                opened.trackers.append(MlflowTracker(run_name, project, config, known.get("mlflow")))
            elif name == "trackio":
                opened.trackers.append(TrackioTracker(run_name, project, config, resume="trackio" in known))
    except BaseException:
        opened.close()
        raise
    ids = {t.name: t.run_id for t in opened.trackers if getattr(t, "run_id", None)}
    if ids:
        ids_path.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    return opened


def log_heldout_table(tracker: Tracker, curve: Sequence[tuple[int, Mapping[str, Any]]],
                      name: str = HELDOUT_TABLE) -> None:
    """A run's held-out evaluation as the tracker table ``name`` (default ``heldout``): one
    row per evaluated step, columns ``step`` and every numeric metric name, sorted (a
    metric a row lacks, or that is undefined there (None), is an empty cell)."""
    names = sorted({k for _, metrics in curve for k, v in metrics.items()
                    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))})
    tracker.log_table(name, ["step", *names],
                      [[step, *(metrics.get(k) for k in names)] for step, metrics in curve])


def recorded_trackers(run_dir: str | pathlib.Path) -> list[str]:
    """The trackers the run in ``run_dir`` has runs in (``trackers.json``, ``tensorboard/``)."""
    run_dir = pathlib.Path(run_dir)
    ids_path = run_dir / _IDS_FILE
    known = json.loads(ids_path.read_text(encoding="utf-8")) if ids_path.exists() else {}
    return sorted([*known, *(["tensorboard"] if (run_dir / "tensorboard").is_dir() else [])])


def _check_recorded(names: Sequence[str], run_dir: pathlib.Path) -> None:
    """Every tracker of ``names`` has a run of ``run_dir`` to append to."""
    recorded = recorded_trackers(run_dir)
    for name in names:
        if name not in recorded:
            raise ConfigError(f"{name!r} is named but the run in {run_dir} has no {name} run to add to "
                              f"(it logged to: {', '.join(recorded) or 'no tracker'}; {_IDS_FILE} holds the ids)")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _mlflow_key(name: str) -> str:
    # MLflow keys allow letters, digits and _ - . space / only; '@' appears in hit@k-style names
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in name)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


__all__ = ["HELDOUT_TABLE", "NONE", "TRACKERS", "Tracker", "Trackers", "check_report_to", "log_heldout_table",
           "open_trackers", "recorded_trackers"]
