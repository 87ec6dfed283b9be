"""`calibrl eval`: greedy held-out metrics of a base model, a trained (LoRA)
checkpoint and the raw-query baseline, side by side, through a real index."""

from __future__ import annotations

import json
import math

import pytest

from calibrl.cli import main as calibrl_main
from calibrl.errors import ConfigError
from tests.test_trainer_support import one_torch_thread, trainer_world  # noqa: F401  (fixtures)
from trainer.aio import BackgroundLoop
from trainer.config import load_train_config
from trainer.eval import EvalSettings, evaluate_models, format_table, load_eval_tasks, resolve_model_path
from trainer.loop import train


@pytest.fixture(scope="module")
def lora_run(trainer_world, tmp_path_factory):
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("lora-run")
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        out, "steps=1", "policy.lora.enabled=true", "policy.lora.r=4", "optimizer.lr=5e-2", judge=False))
    train(config, retrieval=retrieval, judge=None)
    return out


def test_cli_compares_models_side_by_side_and_writes_json(trainer_world, lora_run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = calibrl_main([
        "eval", "--model", str(trainer_world.policy_dir), "--model", str(lora_run), "--name", "base",
        "--name", "trained", "--tasks", str(trainer_world.rewrite_tasks), "--index", str(trainer_world.index_dir),
        "--raw-query-baseline", "--max-new-tokens", "6", "--device", "cpu", "--top-k", "5", "--out", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["model", "tasks", "hit@k", "all_gold@k"]
    assert [line.split()[0] for line in table[2:]] == ["raw", "base", "trained"]
    payload = json.loads(out.read_text())
    assert payload["num_tasks"] == 12 and payload["settings"]["top_k"] == 5
    rows = {row["name"]: row for row in payload["results"]}
    assert rows["trained"]["model"].endswith("step_000001/model")
    # The original queries name their passage: the baseline retrieves almost all of them.
    assert rows["raw query"]["metrics"]["hit@k"] >= 0.75
    for row in rows.values():
        metrics = row["metrics"]
        assert 0.0 <= metrics["all_gold@k"] <= metrics["hit@k"] <= 1.0
        assert 0.0 <= metrics["mrr"] <= 1.0 and 0.0 <= metrics["empty_rewrite_rate"] <= 1.0


def test_greedy_eval_is_deterministic_and_covers_the_search_agent(trainer_world):
    retrieval, _ = trainer_world.clients(judge=False)
    tasks = load_eval_tasks(str(trainer_world.rewrite_tasks), limit=6)
    settings = EvalSettings(max_new_tokens=6, device="cpu")
    with BackgroundLoop() as loop:
        first = evaluate_models([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=loop.run)
        second = evaluate_models([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=loop.run)
        assert first[0].metrics == second[0].metrics and first[0].num_tasks == 6
        search_tasks = load_eval_tasks(str(trainer_world.search_tasks))
        search = evaluate_models([str(trainer_world.policy_dir)], search_tasks, retrieval,
                                 EvalSettings(max_new_tokens=8, max_turns=2, max_obs_tokens=24, device="cpu"),
                                 run_async=loop.run, names=["base"])
    metrics = search[0].metrics
    assert set(metrics) == {"em", "f1", "answered", "well_formed", "searches", "gold_doc_recall"}
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("em", "f1", "answered", "well_formed"))
    assert 0.0 <= metrics["searches"] <= 1.0  # at most one search fits in two turns
    assert math.isnan(metrics["gold_doc_recall"]) or 0.0 <= metrics["gold_doc_recall"] <= 1.0
    assert "em" in format_table(search).splitlines()[0]


def test_model_paths_resolve_and_held_out_split_matches_training(trainer_world, lora_run, tmp_path):
    assert resolve_model_path(trainer_world.policy_dir) == trainer_world.policy_dir
    checkpoint_model = lora_run / "checkpoints" / "step_000001" / "model"
    assert resolve_model_path(lora_run) == checkpoint_model
    assert resolve_model_path(lora_run / "checkpoints" / "step_000001") == checkpoint_model
    with pytest.raises(ConfigError, match="not a model folder"):
        resolve_model_path(tmp_path)
    from trainer.tasks import load_tasks, split_tasks

    train_part, heldout = split_tasks(load_tasks(trainer_world.rewrite_tasks), 0.25, 7)
    evaluated = load_eval_tasks(str(trainer_world.rewrite_tasks), heldout_fraction=0.25, seed=7)
    assert [t.task_id for t in evaluated] == [t.task_id for t in heldout]
    assert not {t.task_id for t in evaluated} & {t.task_id for t in train_part}
