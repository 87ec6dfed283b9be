"""The held-out table of a plain `calibrl train` run (``eval.*``): evaluated with the
library behind `calibrl eval`, written to ``heldout.jsonl`` beside metrics.jsonl, and
read back from each tracker's own store (TensorBoard event files, a W&B offline run,
an MLflow file store, trackio's local store) after a short real run on tiny models,
with every logged training step still there. Resuming evaluates what a stopped run
left due and logs each row once; evaluation does not change the training numbers."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from calibrl import tracking
from calibrl.errors import ConfigError
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.heldout import HELDOUT_FILE, format_heldout, heldout_curve, read_heldout
from tests.test_tracking import _Recorder, _assert_series, _mlflow, _tensorboard, _wandb
from tests.test_trainer_support import one_torch_thread, trainer_world  # noqa: F401  (fixtures)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_JUDGE = ("services.judge=none", "reward.w_rubric=0", "reward.w_retrieval=1.0")
REWRITE_METRICS = {"hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k", "empty_rewrite_rate"}


def _table_rows(curve: list[tuple[int, dict]]) -> tuple[list[str], list[list]]:
    """The columns and rows the ``heldout`` table must hold for ``curve``."""
    names = sorted(REWRITE_METRICS)
    return ["step", *names], [[step, *(metrics[k] for k in names)] for step, metrics in curve]


def _training_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Every finite numeric metric of metrics.jsonl as (step, value) pairs."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(name, []).append((record["step"], value))
    return series


def _assert_all_steps_logged(history: dict, records: list[dict]) -> None:
    """The tracker holds every metrics.jsonl series at every step (float32: rel 1e-6)."""
    expected = _training_series(records)
    assert set(expected) <= set(history), sorted(set(expected) - set(history))
    for name, pairs in expected.items():
        _assert_series(history, name, pairs)


# --------------------------------------------------------------------------- a real `calibrl train`, four trackers


def test_calibrl_train_logs_the_heldout_table_to_every_tracker(trainer_world, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for reading the store back here
    out = tmp_path / "run"
    uri = (tmp_path / "mlruns").as_uri()
    overrides = trainer_world.overrides(
        out, *NO_JUDGE, "steps=2", "checkpoint_every=0", "tensorboard=true", "tasks.heldout_fraction=0.25",
        "eval.heldout_split=true", "eval.every=1", "eval.on_start=true",
        "report_to=tensorboard,wandb,mlflow,trackio", "tracking_project=calibrl-heldout")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "calibrl", "train", "--log-level", "WARNING", *overrides],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]

    # heldout.jsonl: steps 0 (on_start), 1, 2; the 3 tasks of the 0.25 split of 12
    records = read_heldout(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["num_tasks"] == 3 and set(r["metrics"]) == REWRITE_METRICS for r in records)
    assert all(0.0 <= r["metrics"]["all_gold@k"] <= r["metrics"]["hit@k"] <= 1.0 for r in records)
    curve = heldout_curve(records)
    columns, rows = _table_rows(curve)
    assert f"held-out ({out / HELDOUT_FILE}):" in done.stderr and format_heldout(curve) in done.stderr
    training = read_log(out / "metrics.jsonl")
    assert [r["step"] for r in training] == [1, 2]
    eval_series = {f"eval/{k}": [(s, m[k]) for s, m in curve] for k in REWRITE_METRICS}

    # TensorBoard: every step's scalars, eval/* at 0..2, the table as markdown
    scalars, texts = _tensorboard(out)
    _assert_all_steps_logged(scalars, training)
    for name, pairs in eval_series.items():
        _assert_series(scalars, name, pairs)
    table_lines = texts["heldout"].splitlines()
    assert table_lines[0] == "| " + " | ".join(columns) + " |" and len(table_lines) == 2 + len(rows)
    for line, row in zip(table_lines[2:], rows):
        assert line == "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |"

    # W&B offline run: the same table (columns and data exactly), every step
    ids = json.loads((out / "trackers.json").read_text())
    run_ids, wandb_history, _, tables = _wandb(out)
    assert run_ids == {ids["wandb"]}
    _assert_all_steps_logged(wandb_history, training)
    for name, pairs in eval_series.items():
        _assert_series(wandb_history, name, pairs)
    (table_path,) = tables
    table = json.loads(next(out.glob(f"wandb/offline-run-*/files/{table_path}")).read_text())
    assert table["columns"] == columns and table["data"] == rows  # JSON keeps a float exactly

    # MLflow file store: the table artifact, every step (MLflow spells '@' as '_')
    history, _, _, extra = _mlflow(uri, ids["mlflow"])
    assert extra["table"] == {"columns": columns, "data": rows} and extra["status"] == "FINISHED"
    _assert_all_steps_logged(history, [{tracking._mlflow_key(k): v for k, v in r.items()} for r in training])
    for name, pairs in eval_series.items():
        _assert_series(history, tracking._mlflow_key(name), pairs)

    # trackio's local store, read in a process that imports trackio with this TRACKIO_DIR
    script = textwrap.dedent("""
        import json
        from trackio.sqlite_storage import SQLiteStorage
        print("RESULT " + json.dumps(SQLiteStorage.get_logs("calibrl-heldout", "run"), default=str))
    """)
    read = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    logs = json.loads(next(line for line in read.stdout.splitlines() if line.startswith("RESULT "))[7:])
    trackio_history: dict[str, list[tuple[int, float]]] = {}
    for entry in logs:
        for name, value in entry.items():
            if isinstance(value, (int, float)) and name not in ("step", "timestamp") and not name.startswith("_"):
                trackio_history.setdefault(name, []).append((entry["step"], value))
    _assert_all_steps_logged(trackio_history, training)
    for name, pairs in eval_series.items():
        _assert_series(trackio_history, name, pairs)
    (table_log,) = [entry for entry in logs if "heldout" in entry]
    assert table_log["heldout"]["_type"] == "trackio.table"
    assert [list(r.values()) for r in table_log["heldout"]["_value"]] == rows


# --------------------------------------------------------------------------- resume, and the numbers themselves


def test_a_resumed_run_evaluates_what_was_left_due_and_logs_each_row_once(trainer_world, tmp_path, monkeypatch):
    from calibrl.trainer.loop import train

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    overrides = trainer_world.overrides(out, *NO_JUDGE, "steps=2", "checkpoint_every=1", "tensorboard=true",
                                        f"eval.tasks={trainer_world.rewrite_tasks}", "eval.limit=4", "eval.every=1",
                                        "report_to=tensorboard,mlflow", "tracking_project=calibrl-heldout")
    retrieval, _ = trainer_world.clients(judge=False)
    first = train(load_train_config(None, overrides), retrieval=retrieval, judge=None, stop_after=1)
    # stopped at step 1 before its evaluation; no table for an unfinished run
    assert first.stopped == "stop_after" and first.heldout == [] and read_heldout(out) == []
    second = train(load_train_config(None, overrides), retrieval=retrieval, judge=None, resume=out)
    assert second.stopped == "completed"
    records = read_heldout(out)
    assert [r["step"] for r in records] == [1, 2] and all(r["num_tasks"] == 4 for r in records)
    assert second.heldout == heldout_curve(records)
    columns, rows = _table_rows(second.heldout)

    training = read_log(out / "metrics.jsonl")
    assert [r["step"] for r in training] == [1, 2]
    scalars, texts = _tensorboard(out)
    _assert_all_steps_logged(scalars, training)
    _assert_series(scalars, "eval/hit@k", [(s, m["hit@k"]) for s, m in second.heldout])
    assert len(texts["heldout"].splitlines()) == 2 + len(rows)
    ids = json.loads((out / "trackers.json").read_text())
    history, _, _, extra = _mlflow(uri, ids["mlflow"])
    assert extra["table"] == {"columns": columns, "data": rows}
    _assert_all_steps_logged(history, [{tracking._mlflow_key(k): v for k, v in r.items()} for r in training])

    # A second resume of the finished run changes nothing it already has.
    third = train(load_train_config(None, overrides), retrieval=retrieval, judge=None, resume=out)
    assert third.steps_done == 2 and [r["step"] for r in read_heldout(out)] == [1, 2]


def test_evaluation_leaves_training_unchanged_and_matches_calibrl_eval(trainer_world, tmp_path):
    """The run's numbers are the same with and without evaluation (bitwise: the same
    process and machine), and the final row equals `calibrl eval` of the final checkpoint."""
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.eval import EvalSettings, evaluate_models, load_eval_tasks
    from calibrl.trainer.loop import train

    retrieval, _ = trainer_world.clients(judge=False)
    runs = {}
    for name, extra in (("plain", ()), ("evaluated", (f"eval.tasks={trainer_world.rewrite_tasks}", "eval.every=1",
                                                        "eval.on_start=true", "eval.top_k=3"))):
        config = load_train_config(None, trainer_world.overrides(tmp_path / name, *NO_JUDGE, "steps=2",
                                                                 "checkpoint_every=0", "report_to=none", *extra))
        runs[name] = train(config, retrieval=retrieval, judge=None)
    untimed = [[{k: v for k, v in m.items() if not k.startswith("timing/")} for m in r.history] for r in runs.values()]
    assert untimed[0] == untimed[1]
    curve = runs["evaluated"].heldout
    assert [step for step, _ in curve] == [0, 1, 2] and runs["plain"].heldout == []
    assert not (tmp_path / "plain" / HELDOUT_FILE).exists()

    tasks = load_eval_tasks(str(trainer_world.rewrite_tasks))
    with BackgroundLoop(name="test-eval") as background:
        (row,) = evaluate_models([str(tmp_path / "evaluated")], tasks, retrieval,
                                 EvalSettings(top_k=3, max_new_tokens=6, device="cpu"), run_async=background.run)
    assert row.metrics == curve[-1][1]


def test_a_search_agent_run_evaluates_answers_and_keeps_an_undefined_metric_visible(trainer_world, tmp_path):
    """Search tasks without gold ids have no gold_doc_recall: null in heldout.jsonl, no
    eval/ scalar (never a 0), an empty cell in the table."""
    from calibrl.trainer.loop import train
    from tests.test_trainer_support import SEARCH_TASKS

    no_gold = tmp_path / "heldout_search.jsonl"
    no_gold.write_text("".join(json.dumps({k: v for k, v in t.items() if k != "gold_doc_ids"}) + "\n"
                               for t in SEARCH_TASKS[:2]))
    out = tmp_path / "run"
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        out, f"tasks.path={trainer_world.search_tasks}", "advantage.type=calibadv", "advantage.use_gold=true",
        "rollout.prompts_per_step=2", "rollout.max_new_tokens=8", "rollout.max_turns=2", "rollout.max_obs_tokens=24",
        "steps=1", "tensorboard=true", f"eval.tasks={no_gold}", judge=False))
    result = train(config, retrieval=retrieval, judge=None)
    (record,) = read_heldout(out)
    metrics = record["metrics"]
    assert record["step"] == 1 and record["num_tasks"] == 2
    assert set(metrics) == {"em", "f1", "answered", "well_formed", "searches", "gold_doc_recall"}
    assert metrics["gold_doc_recall"] is None and 0.0 <= metrics["em"] <= metrics["f1"] + 1e-12 <= 1.0 + 1e-12
    assert 0.0 <= metrics["searches"] <= 2.0  # at most one search per turn, max_turns=2
    assert result.heldout == [(1, metrics)]
    scalars, texts = _tensorboard(out)
    assert "eval/f1" in scalars and "eval/gold_doc_recall" not in scalars
    header, _, row = texts["heldout"].splitlines()
    assert header == "| step | answered | em | f1 | gold_doc_recall | searches | well_formed |"
    cells = dict(zip(header.split("|"), row.split("|")))
    assert cells[" gold_doc_recall "].strip() == "" and cells[" step "].strip() == "1"  # an empty cell


def test_a_failed_evaluation_is_recorded_and_training_goes_on(trainer_world, tmp_path, caplog):
    from calibrl.errors import Unavailable
    from calibrl.trainer.loop import train

    retrieval, _ = trainer_world.clients(judge=False)

    class DownForEval:  # the retrieval service fails the held-out calls (top_k=2) only
        async def score(self, items, top_k, *args, **kwargs):
            if top_k == 2:
                raise Unavailable("retrieval service unavailable after 5 attempts")
            return await retrieval.score(items, top_k, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(retrieval, name)

    out = tmp_path / "run"
    config = load_train_config(None, trainer_world.overrides(
        out, *NO_JUDGE, "steps=2", "checkpoint_every=0", "report_to=none", f"eval.tasks={trainer_world.rewrite_tasks}",
        "eval.every=1", "eval.top_k=2"))
    result = train(config, retrieval=DownForEval(), judge=None)
    assert result.stopped == "completed" and result.steps_done == 2 and result.heldout == []
    records = read_heldout(out)
    assert [(r["step"], r["error"]) for r in records] == [(s, "retrieval service unavailable after 5 attempts")
                                                          for s in (1, 2)]
    assert all("metrics" not in r for r in records)
    assert "held-out evaluation at step 1 failed: retrieval service unavailable" in caplog.text


# --------------------------------------------------------------------------- bad settings, refused early


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("eval.heldout_split=true",), r"eval.heldout_split=true but tasks.heldout_fraction=0 holds nothing out"),
        (("eval.heldout_split=true", "tasks.heldout_fraction=0.2", "eval.tasks=h.jsonl"), "give one source"),
        (("eval.tasks=h.jsonl", "distributed.strategy=fsdp"), "a sharded policy cannot generate on one rank"),
        (("eval.tasks=h.jsonl", "eval.every=-1"), r"eval.every=-1: must be >= 0"),
        (("eval.tasks=h.jsonl", "eval.top_k=0"), r"eval.top_k=0: must be >= 1"),
    ],
)
def test_bad_eval_settings_are_refused_at_load(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, ["policy.path=/models/policy", "tasks.path=t.jsonl", "services.index_dir=i",
                                 *NO_JUDGE, *extra])


def test_heldout_tasks_of_another_kind_stop_the_run_before_its_first_step(trainer_world, tmp_path):
    from calibrl.trainer.loop import train

    config = load_train_config(None, trainer_world.overrides(tmp_path / "run", *NO_JUDGE, "report_to=none",
                                                             f"eval.tasks={trainer_world.search_tasks}"))
    retrieval, _ = trainer_world.clients(judge=False)
    with pytest.raises(ConfigError, match=r"eval.tasks: .*search.jsonl holds search tasks but the run trains a "
                                          r"rewrite agent"):
        train(config, retrieval=retrieval, judge=None)
    assert read_log(tmp_path / "run" / "metrics.jsonl") == []


def test_the_table_helper_the_demo_and_train_share(tmp_path, monkeypatch):
    from calibrl.demo import training as demo_training
    from calibrl.trainer import eval_report

    # the demo appends each run's held-out table through calibrl eval --run-dir's path
    # (eval_report.log_to_run), which logs it with tracking.log_heldout_table
    calls = []
    monkeypatch.setattr(eval_report, "run_trackers", lambda run_dir: (["tensorboard"], "calibrl-demo"))
    monkeypatch.setattr(eval_report, "log_to_run", lambda *args: calls.append(args))
    curve = [(2, {"f1": 0.5})]
    demo_training._log_heldout(tmp_path, curve)
    assert calls == [(tmp_path, curve, ["tensorboard"], "calibrl-demo")]
    recorder = _Recorder()
    tracking.log_heldout_table(recorder, [(0, {"hit@k": 0.25, "mrr": None, "ok": True}), (2, {"hit@k": 0.5, "mrr": 0.4})])
    assert recorder.calls == [("heldout", ["step", "hit@k", "mrr"], [[0, 0.25, None], [2, 0.5, 0.4]])]
    tracking.log_heldout_table(recorder, [(3, {"hit@k": 0.5, "recall": None})], name="heldout_v2")
    assert recorder.calls[-1] == ("heldout_v2", ["step", "hit@k", "recall"], [[3, 0.5, None]])


# --------------------------------------------------------------------------- calibrl eval --run-dir: a table afterwards


def test_calibrl_eval_adds_a_table_to_a_finished_runs_trackers_and_drops_nothing(trainer_world, tmp_path,
                                                                                 monkeypatch, capsys):
    from calibrl.cli import main as calibrl_main
    from calibrl.trainer.loop import train

    uri = (tmp_path / "mlruns").as_uri()
    for name, value in (("MLFLOW_TRACKING_URI", uri), ("MLFLOW_ALLOW_FILE_STORE", "true"), ("WANDB_MODE", "offline"),
                        ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    overrides = trainer_world.overrides(out, *NO_JUDGE, "steps=2", "checkpoint_every=1", "keep_checkpoints=0",
                                        "tensorboard=true", "report_to=tensorboard,mlflow,wandb",
                                        "tracking_project=calibrl-heldout")
    retrieval, _ = trainer_world.clients(judge=False)
    train(load_train_config(None, overrides), retrieval=retrieval, judge=None)
    ids = json.loads((out / "trackers.json").read_text())
    training = read_log(out / "metrics.jsonl")
    assert [r["step"] for r in training] == [1, 2]

    common = ["--tasks", str(trainer_world.rewrite_tasks), "--index", str(trainer_world.index_dir),
              "--max-new-tokens", "6", "--device", "cpu", "--top-k", "3"]
    # refused before anything is evaluated
    assert calibrl_main(["eval", "--model", str(trainer_world.policy_dir), "--run-dir", str(out), *common]) == 2
    assert "is not a checkpoint of --run-dir" in capsys.readouterr().err
    assert calibrl_main(["eval", "--run-dir", str(out), "--report-to", "trackio", *common]) == 2
    assert "has no trackio run to add the table to (it logged to: mlflow, tensorboard, wandb)" in capsys.readouterr().err
    assert calibrl_main(["eval", "--model", str(out), "--report-to", "mlflow", *common]) == 2
    assert "--report-to needs --run-dir" in capsys.readouterr().err

    assert calibrl_main(["eval", "--run-dir", str(out), *common, "--out", str(tmp_path / "eval.json")]) == 0
    assert "table 'heldout' (2 rows) added to the run's trackers: tensorboard, mlflow, wandb" in capsys.readouterr().err
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [r["model"] for r in results] == [str(out / "checkpoints" / f"step_00000{s}" / "model") for s in (1, 2)]
    columns, rows = _table_rows([(s, r["metrics"]) for s, r in zip((1, 2), results)])

    scalars, texts = _tensorboard(out)
    _assert_all_steps_logged(scalars, training)  # reopening purged nothing
    assert len(texts["heldout"].splitlines()) == 2 + len(rows) and texts["heldout"].startswith("| step | all_gold@k")
    history, _, config, extra = _mlflow(uri, ids["mlflow"])
    assert extra["table"] == {"columns": columns, "data": rows} and extra["status"] == "FINISHED"
    assert config["report_to"] == ["tensorboard", "mlflow", "wandb"]
    _assert_all_steps_logged(history, [{tracking._mlflow_key(k): v for k, v in r.items()} for r in training])
    run_ids, wandb_history, _, tables = _wandb(out)
    assert run_ids == {ids["wandb"]} and json.loads((out / "trackers.json").read_text()) == ids
    _assert_all_steps_logged(wandb_history, training)
    (table_path,) = tables
    table = json.loads(next(out.glob(f"wandb/offline-run-*/files/{table_path}")).read_text())
    assert table["columns"] == columns and table["data"] == rows
