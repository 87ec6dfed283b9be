"""Checkpoints: what is saved comes back exactly (weights, AdamW, schedule, RNG),
folders are written atomically, the latest is found, old ones are pruned."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from calibrl.errors import NotFound
from tests.test_trainer_support import one_torch_thread  # noqa: F401  (fixture)
from calibrl.testing import build_model, build_tokenizer
from calibrl.trainer import checkpoint as ckpt


def _trained_model_and_optimizer():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 / (n + 1))
    ids = torch.tensor([tokenizer("the capital of France")["input_ids"]])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return tokenizer, model, optimizer, scheduler


def test_save_and_load_restore_weights_optimizer_schedule_and_rng(tmp_path):
    tokenizer, model, optimizer, scheduler = _trained_model_and_optimizer()
    state = ckpt.TrainState(step=2, data_position={"epoch": 0, "offset": 8, "num_tasks": 12, "seed": 0})
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    folder = ckpt.save_checkpoint(ckpt.checkpoint_dir(tmp_path, 2), model=model, tokenizer=tokenizer,
                                  optimizer=optimizer, scheduler=scheduler, state=state, config_yaml="steps: 3\n")
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert folder.name == "step_000002" and not folder.with_name("step_000002.tmp").exists()

    fresh = build_model(build_tokenizer(), seed=2).train()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda n: 1.0 / (n + 1))
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    ckpt.load_model_weights(folder, fresh)
    fresh_optimizer.load_state_dict(ckpt.load_optimizer_and_schedule(folder, fresh_optimizer, fresh_scheduler))
    ckpt.load_rng(folder, rank=0)

    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected_draws
    assert fresh_scheduler.last_epoch == scheduler.last_epoch == 2
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    saved = optimizer.state_dict()["state"]
    loaded = fresh_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)
    assert ckpt.load_train_state(folder) == state
    assert (folder / "config.yaml").read_text() == "steps: 3\n"
    assert (folder / "model" / "tokenizer.json").exists()


def test_find_prune_and_errors(tmp_path):
    tokenizer, model, optimizer, scheduler = _trained_model_and_optimizer()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(ckpt.checkpoint_dir(tmp_path, step), model=model, tokenizer=None, optimizer=optimizer,
                             scheduler=scheduler, state=ckpt.TrainState(step=step), config_yaml="")
    assert ckpt.find_checkpoint(tmp_path).name == "step_000003"
    assert ckpt.find_checkpoint(tmp_path / "checkpoints").name == "step_000003"
    assert ckpt.find_checkpoint(tmp_path / "checkpoints" / "step_000001").name == "step_000001"
    # A run killed between writing a staging folder's state file and renaming it leaves
    # step_N.tmp with a state file in it: never a checkpoint to resume from.
    cut_off = ckpt.checkpoint_dir(tmp_path, 4).with_name("step_000004.tmp")
    cut_off.mkdir()
    (cut_off / ckpt.STATE_FILE).write_text('{"step": 4}')
    assert ckpt.find_checkpoint(tmp_path).name == "step_000003"
    with pytest.raises(NotFound, match="still being written"):
        ckpt.find_checkpoint(cut_off)
    shutil.rmtree(cut_off)
    ckpt.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    with pytest.raises(NotFound, match="no checkpoint at"):
        ckpt.find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(NotFound, match="no RNG state for rank 1; resume with the world size"):
        ckpt.load_rng(ckpt.find_checkpoint(tmp_path), rank=1)
    other = build_model(build_tokenizer(), seed=0, hidden=64)
    with pytest.raises(Exception):
        ckpt.load_model_weights(ckpt.find_checkpoint(tmp_path), other)
