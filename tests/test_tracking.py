"""Experiment trackers (calibrl.tracking, report_to): each real tool in its offline or
local mode (TensorBoard event files, a W&B offline run, an MLflow file store,
trackio's local store), and what was logged read back: metric names, steps,
config, the held-out table. One real training run logs to several at once and is
resumed into the same tracker runs."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import pytest

from calibrl import tracking
from calibrl.errors import ConfigError
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)

# Names as metrics.jsonl has them (TRL's where TRL has one).
STEPS = {1: {"reward": 0.25, "kl": 0.0, "frac_reward_zero_std": 0.5, "rewards/retrieval/mean": 0.3},
         2: {"reward": 0.5, "kl": 0.01, "frac_reward_zero_std": 0.25, "rewards/retrieval/mean": 0.6}}
CONFIG = {"seed": 3, "optimizer": {"lr": 1e-5}, "report_to": ["tensorboard"]}
NO_JUDGE = ("services.judge=none", "reward.w_rubric=0", "reward.w_retrieval=1.0")
COLUMNS, ROWS = ["step", "hit@k", "mrr"], [[0, 0.25, 0.2], [2, 0.5, 0.45]]


def _log_everything(tracker: tracking.Tracker) -> None:
    for step, metrics in STEPS.items():
        tracker.log_metrics({**metrics, "grad_norm": float("nan")}, step)  # non-finite values are not sent
    tracker.log_table("heldout", COLUMNS, ROWS)
    tracker.close()


# --------------------------------------------------------------------------- readers of each tool's own files


def _tensorboard(run_dir: pathlib.Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    scalars = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    texts = {}
    for tag in accumulator.Tags()["tensors"]:
        event = accumulator.Tensors(tag)[-1]
        texts[tag.split("/")[0]] = event.tensor_proto.string_val[0].decode("utf-8")
    return scalars, texts


def _wandb_records(run_dir: pathlib.Path) -> list:
    """The protobuf records of every offline W&B run under ``run_dir`` (the .wandb file
    is a LevelDB-style log: 32 KiB blocks of chunks with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, parts = 7, []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:
                break
            parts.append(data[pos + 7 : pos + 7 + length])
            pos += 7 + length
            if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
                record = wandb_internal_pb2.Record()
                record.ParseFromString(b"".join(parts))
                records.append(record)
                parts = []
            elif kind == 2:
                parts = parts[-1:]
    return records


def _wandb(run_dir: pathlib.Path) -> tuple[set[str], dict[str, list[tuple[int, float]]], dict, list]:
    import time

    # wandb-core, a process of its own, may still be writing the file when finish() returns:
    # wait (bounded) until every run in it has its exit record.
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(run_dir)
        kinds = [r.WhichOneof("record_type") for r in records]
        if (kinds and kinds.count("exit") == kinds.count("run")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    run_ids, history, config, tables = set(), {}, {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_ids.add(record.run.run_id)
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_") and not key.startswith("heldout/"):
                    history.setdefault(key, []).append((record.history.step.num, value))
            if "heldout/path" in items:
                tables.append(items["heldout/path"])
    return run_ids, history, config, tables


def _mlflow(tracking_uri: str, run_id: str) -> tuple[dict[str, list[tuple[int, float]]], dict, dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    folder = pathlib.Path(client.download_artifacts(run_id, ""))
    config = json.loads((folder / "config.json").read_text())
    table = json.loads((folder / "heldout.json").read_text())
    return history, run.data.params, config, {"table": table, "status": run.info.status, "name": run.info.run_name}


def _assert_series(history: dict, name: str, expected: list[tuple[int, float]], rel: float = 1e-6) -> None:
    """``history[name]`` holds ``expected`` (step, value) pairs: steps exactly, values to
    ``rel`` (TensorBoard and trackers store float32; 1e-6 is float32's rounding)."""
    got = sorted(history[name])
    assert [s for s, _ in got] == [s for s, _ in expected], name
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=rel, abs=1e-9), name


# --------------------------------------------------------------------------- each tracker on its own


def test_tensorboard_logs_scalars_by_step_config_and_table(tmp_path):
    _log_everything(tracking.open_trackers(["tensorboard"], tmp_path, config=CONFIG))
    scalars, texts = _tensorboard(tmp_path)
    assert set(scalars) == set(STEPS[1])  # grad_norm=nan was left out, nothing else
    for name in STEPS[1]:
        _assert_series(scalars, name, [(s, STEPS[s][name]) for s in (1, 2)])
    assert json.loads(texts["config"].strip("`\n")) == CONFIG
    assert texts["heldout"].splitlines()[0] == "| step | hit@k | mrr |" and "| 2 | 0.5 | 0.45 |" in texts["heldout"]


def test_wandb_offline_run_holds_metrics_steps_config_and_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = tracking.open_trackers(["wandb"], tmp_path, run_name="dense", project="calibrl-test", config=CONFIG)
    run_id = trackers.trackers[0].run_id
    _log_everything(trackers)
    run_ids, history, config, tables = _wandb(tmp_path)
    assert run_ids == {run_id}
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": run_id}
    assert set(history) == set(STEPS[1])
    for name in STEPS[1]:
        _assert_series(history, name, [(s, STEPS[s][name]) for s in (1, 2)])
    assert config == CONFIG
    (table_path,) = tables
    table = json.loads(next(tmp_path.glob(f"wandb/offline-run-*/files/{table_path}")).read_text())
    assert table["columns"] == COLUMNS and table["data"] == ROWS


def test_mlflow_file_store_holds_metrics_steps_params_config_and_table(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; a file store is local
    trackers = tracking.open_trackers(["mlflow"], tmp_path / "run", run_name="dense", project="calibrl-test",
                                      config=CONFIG)
    run_id = trackers.trackers[0].run_id
    _log_everything(trackers)
    history, params, config, extra = _mlflow(uri, run_id)
    assert set(history) == set(STEPS[1])
    for name in STEPS[1]:
        _assert_series(history, name, [(s, STEPS[s][name]) for s in (1, 2)])
    assert params == {"seed": "3", "optimizer.lr": "1e-05", "report_to": "['tensorboard']"}
    assert config == CONFIG
    assert extra == {"table": {"columns": COLUMNS, "data": ROWS}, "status": "FINISHED", "name": "dense"}


def test_trackio_local_store_holds_metrics_steps_config_and_table(tmp_path):
    # trackio fixes its store folder (TRACKIO_DIR) when it is imported: a fresh process.
    script = textwrap.dedent(f"""
        import json
        from calibrl import tracking
        from tests.test_tracking import CONFIG, _log_everything
        _log_everything(tracking.open_trackers(["trackio"], {str(tmp_path / "run")!r}, run_name="dense",
                                               project="calibrl-test", config=CONFIG))
        from trackio.sqlite_storage import SQLiteStorage
        print("RESULT " + json.dumps({{
            "runs": SQLiteStorage.get_runs("calibrl-test"),
            "config": SQLiteStorage.get_run_config("calibrl-test", "dense"),
            "logs": SQLiteStorage.get_logs("calibrl-test", "dense"),
        }}, default=str))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=pathlib.Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["runs"] == ["dense"]
    assert {k: v for k, v in result["config"].items() if not k.startswith("_")} == CONFIG
    scalar_logs = [log for log in result["logs"] if "reward" in log]
    for name in STEPS[1]:
        _assert_series({name: [(log["step"], log[name]) for log in scalar_logs]}, name,
                       [(s, STEPS[s][name]) for s in (1, 2)])
    (table_log,) = [log for log in result["logs"] if "heldout" in log]
    table = table_log["heldout"]
    assert table["_type"] == "trackio.table" and [list(r.values()) for r in table["_value"]] == ROWS


# --------------------------------------------------------------------------- choosing trackers


@pytest.mark.parametrize(
    ("report_to", "message"),
    [
        (["tensorbord"], r"report_to: 'tensorbord' is not a tracker; choose from \['mlflow', 'tensorboard'"),
        (["none", "wandb"], "'none' cannot be combined"),
        (["wandb", "wandb"], "named twice"),
    ],
)
def test_bad_report_to_is_refused_with_the_choices(report_to, message):
    with pytest.raises(ConfigError, match=message):
        tracking.check_report_to(report_to)


def test_a_missing_tracker_package_names_its_extra_at_config_load(monkeypatch):
    from calibrl.trainer.config import load_train_config

    real_find_spec = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"report_to includes 'wandb' but wandb is not installed: "
                                          r"pip install 'calibrl\[wandb\]'"):
        load_train_config(None, ["policy.path=/models/policy", "tasks.path=t.jsonl", "services.index_dir=i", *NO_JUDGE,
                                 "report_to=tensorboard,wandb"])
    config = load_train_config(None, ["policy.path=/models/policy", "tasks.path=t.jsonl", "services.index_dir=i", *NO_JUDGE,
                                      "report_to=none"])
    assert config.trackers() == []
    legacy = load_train_config(None, ["policy.path=/models/policy", "tasks.path=t.jsonl", "services.index_dir=i", *NO_JUDGE,
                                      "report_to=tensorboard,mlflow", "tensorboard=false"])
    assert legacy.trackers() == ["mlflow"]


class _Recorder(tracking.Tracker):
    name = "recorder"

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls, self.closed = fail, [], False

    def log_metrics(self, metrics, step):
        if self.fail:
            raise ConnectionError("dashboard unreachable")
        self.calls.append((step, dict(metrics)))

    def log_table(self, name, columns, rows):
        self.calls.append((name, list(columns), [list(r) for r in rows]))

    def close(self):
        self.closed = True


def test_a_failing_tracker_is_dropped_and_reported_while_the_others_go_on(caplog):
    broken, healthy = _Recorder(fail=True), _Recorder()
    fan_out = tracking.Trackers([broken, healthy])
    fan_out.log_metrics({"reward": 1.0, "kl": float("inf"), "note": "text"}, 1)
    fan_out.log_metrics({"reward": 2.0}, 2)
    fan_out.log_table("heldout", COLUMNS, ROWS)
    fan_out.close()
    assert healthy.calls == [(1, {"reward": 1.0}), (2, {"reward": 2.0}), ("heldout", COLUMNS, ROWS)]
    assert broken.closed and healthy.closed
    assert "tracker recorder failed in log_metrics; it is dropped" in caplog.text


# --------------------------------------------------------------------------- a real training run


def test_training_logs_jsonl_names_to_several_trackers_and_a_resume_continues_their_runs(
        trainer_world, tmp_path, monkeypatch):
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.diagnostics import read_log
    from calibrl.trainer.loop import train

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; a file store is local
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    overrides = trainer_world.overrides(out, "steps=2", "checkpoint_every=0", "tensorboard=true",
                                        "report_to=tensorboard,mlflow,wandb", "tracking_project=calibrl-test")
    retrieval, judge = trainer_world.clients()
    first = train(load_train_config(None, overrides), retrieval=retrieval, judge=judge, stop_after=1)
    assert first.stopped == "stop_after" and first.steps_done == 1
    ids = json.loads((out / "trackers.json").read_text())
    second = train(load_train_config(None, overrides), retrieval=retrieval, judge=judge, resume=out)
    assert second.steps_done == 2
    assert json.loads((out / "trackers.json").read_text()) == ids, "the resume opened new tracker runs"

    records = read_log(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    logged = {name for record in records for name, value in record.items()
              if name != "step" and isinstance(value, (int, float))}
    assert {"reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "grad_norm"} <= logged

    scalars, texts = _tensorboard(out)
    mlflow_history, params, mlflow_config, extra = _mlflow_without_table(uri, ids["mlflow"])
    run_ids, wandb_history, wandb_config, _ = _wandb(out)
    for history in (scalars, mlflow_history, wandb_history):
        assert set(history) == logged
        for name in ("reward", "kl"):
            _assert_series(history, name, [(r["step"], r[name]) for r in records])
    assert run_ids == {ids["wandb"]}
    resolved = json.loads(texts["config"].strip("`\n"))
    assert resolved["report_to"] == ["tensorboard", "mlflow", "wandb"] and resolved["steps"] == 2
    assert mlflow_config == resolved == wandb_config
    assert params["rollout.group_size"] == "4" and extra["status"] == "FINISHED"


def _mlflow_without_table(uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    config = json.loads((pathlib.Path(client.download_artifacts(run_id, "config.json"))).read_text())
    return history, run.data.params, config, {"status": run.info.status}


# --------------------------------------------------------------------------- the demo's --report-to


def test_demo_refuses_an_unknown_tracker_before_doing_anything(tmp_path, capsys):
    from calibrl.demo import cli as demo_cli

    out = tmp_path / "demo"
    assert demo_cli.main(["--quick", "--out", str(out), "--report-to", "mlflow,tensorbord"]) == 2
    assert "--report-to: 'tensorbord' is not a tracker" in capsys.readouterr().err
    assert not out.exists()


def test_the_heldout_curve_goes_to_the_trackers_as_a_table():
    from calibrl.tracking import log_heldout_table

    recorder = _Recorder()
    log_heldout_table(recorder, [(2, {"hit@k": 0.25, "mrr": 0.2}), (4, {"hit@k": 0.5, "mrr": 0.45})])
    assert recorder.calls == [("heldout", ["step", "hit@k", "mrr"], [[2, 0.25, 0.2], [4, 0.5, 0.45]])]
