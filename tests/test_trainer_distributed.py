"""Multi-process training on CPU: gloo all-reduce of gradients, and a 2-process
torchrun of `calibrl train` (rank 0 logs and checkpoints, every rank keeps its RNG)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from tests.test_trainer_support import one_torch_thread, trainer_world  # noqa: F401  (fixtures)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _all_reduce_worker(rank: int, world_size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from calibrl.trainer.distributed import DistContext, all_reduce_gradients, check_in_sync, reduce_metrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ctx = DistContext(rank=rank, world_size=world_size, backend="gloo")
    weight = torch.nn.Parameter(torch.zeros(3))
    bias = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.full((3,), float(rank + 1))
    bias.grad = torch.tensor([float(rank), 10.0 * rank])
    all_reduce_gradients([weight, bias], ctx)
    metrics = reduce_metrics({"reward": float(rank), "completions/max_length": 5.0 + rank,
                              "clip_ratio/low_min": 1.0 - rank}, ctx)
    check_in_sync([weight, bias], ctx)
    with torch.no_grad():
        weight.add_(rank)  # drift on purpose
    try:
        check_in_sync([weight, bias], ctx)
        drift_caught = False
    except RuntimeError:
        drift_caught = True
    results[rank] = (weight.grad.tolist(), bias.grad.tolist(), metrics, drift_caught)
    dist.destroy_process_group()


@pytest.mark.slow
def test_gradients_and_metrics_are_reduced_over_ranks():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_all_reduce_worker, args=(2, port, results), nprocs=2, join=True)
    for rank in (0, 1):
        weight_grad, bias_grad, metrics, drift_caught = results[rank]
        assert weight_grad == [1.5, 1.5, 1.5]  # mean of 1 and 2
        assert bias_grad == [0.5, 5.0]
        assert metrics == {"reward": 0.5, "completions/max_length": 6.0, "clip_ratio/low_min": 0.0}
        assert drift_caught


def _torchrun_train(world, out: pathlib.Path, config_path: pathlib.Path, *extra: str) -> list[dict]:
    overrides = world.overrides(out, "steps=2", "rollout.prompts_per_step=4", *extra, judge=False)
    config: dict = {}
    for item in overrides:
        key, _, value = item.partition("=")
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "calibrl", "train", "--config", str(config_path), "--log-level", "WARNING"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_ddp_and_fsdp_train_log_once_checkpoint_every_rank_and_agree(trainer_world, tmp_path):
    """Two processes under torchrun, gloo on CPU. DDP all-reduces by hand, FSDP2
    shards; with the same rollouts (sampling seeds depend on step, rank and chunk
    only) both take the same first step."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        records = _torchrun_train(trainer_world, out, tmp_path / f"{strategy}.yaml",
                                  f"distributed.strategy={strategy}")
        assert [r["step"] for r in records] == [1, 2]  # rank 0 alone writes the log
        checkpoint = out / "checkpoints" / "step_000002"
        assert (checkpoint / "rng_rank0.pt").exists() and (checkpoint / "rng_rank1.pt").exists()
        assert json.loads((checkpoint / "state.json").read_text())["world_size"] == 2
        assert (checkpoint / "model" / "config.json").exists()  # FSDP: gathered to a full HF model
        runs[strategy] = records
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert fsdp[0]["reward"] == ddp[0]["reward"]
    # DDP and FSDP all-reduce the same per-rank gradients in another order and flatten / shard them
    # differently: float32 sums over the step's few hundred tokens and 2 ranks, ~ (n - 1) * 2u = 5e-5
    # relative; rel 1e-4 for the gradient and the loss.
    assert fsdp[0]["grad_norm"] == pytest.approx(ddp[0]["grad_norm"], rel=1e-4)
    assert fsdp[0]["loss"] == pytest.approx(ddp[0]["loss"], rel=1e-4, abs=1e-7)
    # Step 2's KL is measured after one update whose weights differ by the step-1 bound above (Adam moves
    # each weight by lr * g / |g|, so rel 1e-4 in g can flip tiny updates): the KL, itself ~1e-3, gets rel 1e-3.
    assert fsdp[1]["kl"] == pytest.approx(ddp[1]["kl"], rel=1e-3, abs=1e-7)

    # One step off-policy under FSDP: the next step's rollouts are sampled and their
    # behaviour log-probs computed (a sharded forward pass) before the update; every
    # rank keeps its own in the checkpoint. Step 1 is on-policy, the same step as above.
    out = tmp_path / "fsdp-off-policy"
    records = _torchrun_train(trainer_world, out, tmp_path / "fsdp-off-policy.yaml", "distributed.strategy=fsdp",
                              "rollout.off_policy_steps=1", "checkpoint_every=1")
    assert [r["rollout/staleness"] for r in records] == [0.0, 1.0]
    # The same FSDP step 1 with the next batch sampled first: same shards, same order; only the
    # forward's batch shape differs, a few u per token over <= 100 tokens: rel 1e-5.
    assert records[0]["loss"] == pytest.approx(fsdp[0]["loss"], rel=1e-5, abs=1e-7)
    first = out / "checkpoints" / "step_000001"
    assert (first / "pending_rank0.pt").exists() and (first / "pending_rank1.pt").exists()
    assert all(math.isfinite(r["loss"]) for r in records)
