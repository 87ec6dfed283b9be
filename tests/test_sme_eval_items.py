"""`calibrl eval --sme-items FILE`: the eval's greedy outputs as items for `calibrl sme sample`."""

from __future__ import annotations

import numpy as np

from calibrl.cli import main as calibrl_main
from calibrl.sme.eval_items import eval_items
from calibrl.sme.items import read_items
from calibrl.sme.sample import SampleOptions, choose_sample
from tests.test_trainer_support import one_torch_thread, trainer_world  # noqa: F401  (fixtures)
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.eval import EvalSettings, load_eval_tasks


def test_eval_writes_items_that_the_sampler_reads(trainer_world, tmp_path, capsys):
    items_path = tmp_path / "eval_items.jsonl"
    code = calibrl_main([
        "eval", "--model", str(trainer_world.policy_dir), "--name", "base", "--tasks", str(trainer_world.rewrite_tasks),
        "--index", str(trainer_world.index_dir), "--max-new-tokens", "6", "--device", "cpu", "--top-k", "3",
        "--sme-items", str(items_path),
    ])
    assert code == 0
    out = capsys.readouterr().out
    items = read_items(items_path)
    assert f"wrote {len(items)} items for calibrl sme sample to {items_path}" in out
    tasks = {t.task_id: t for t in load_eval_tasks(str(trainer_world.rewrite_tasks))}
    empty = 12 - len(items)
    assert empty == 0 or f"({empty} empty outputs left out)" in out
    for item in items:
        name, _, task_id = item.id.partition(":")
        task = tasks[task_id]
        assert name == "base" and item.model == "base" and item.query == task.query and item.output.strip()
        assert item.gold_doc_ids == task.gold_doc_ids and 1 <= len(item.retrieved_doc_ids) <= 3
        assert len(item.retrieved_texts) == len(item.retrieved_doc_ids)
        signals = dict(item.signals)
        assert set(signals) == {"hit", "mrr", "ndcg", "recall"}
        assert signals["hit"] == float(bool(set(item.gold_doc_ids) & set(item.retrieved_doc_ids)))
        assert item.outcome == ("hit" if signals["hit"] else "miss")
    sample = choose_sample(items, SampleOptions(n=4), vectors=np.random.default_rng(0).standard_normal((len(items), 8)))
    assert len(sample.items) == min(4, len(items))


def test_search_agent_items_carry_the_trajectory(trainer_world):
    retrieval, _ = trainer_world.clients(judge=False)
    tasks = load_eval_tasks(str(trainer_world.search_tasks), limit=3)
    settings = EvalSettings(max_new_tokens=8, max_turns=2, max_obs_tokens=24, device="cpu")
    with BackgroundLoop() as loop:
        items, empty = eval_items([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=loop.run,
                                  names=["agent"])
    assert empty == 0 and [i.id for i in items] == [f"agent:{t.task_id}" for t in tasks]
    for item, task in zip(items, tasks):
        assert item.query == task.query and item.output  # "search: ... | answer: ..." or "(no answer)"
        signals = dict(item.signals)
        assert {"em", "f1", "well_formed"} <= set(signals) and 0.0 <= signals["f1"] <= 1.0
        if task.gold_doc_ids:
            assert signals["hit"] == float(bool(set(task.gold_doc_ids) & set(item.retrieved_doc_ids)))
