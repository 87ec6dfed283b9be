"""Everything a training run is built from, before its first step.

:func:`build_run` loads the policy (and its frozen reference), the optimizer and
its learning-rate schedule, the generation engine and the training tasks, and, when
resuming, restores their state from a checkpoint. The order of these steps is part
of the contract: the RNG draws it makes (LoRA initialisation, the per-rank sampling
seed) decide the run's numbers, so a resumed or repeated run stays bitwise equal.
"""

from __future__ import annotations

import logging
import math
import pathlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from calibrl.errors import ConfigError
from calibrl.trainer import checkpoint as ckpt
from calibrl.trainer import distributed as dist_util
from calibrl.trainer import engines  # engines.make_engine is looked up per call (tests swap it)
from calibrl.trainer.policy import load_policy, make_reference, resolve_device
from calibrl.trainer.task_kinds import TaskKind, task_kind
from calibrl.trainer.tasks import load_tasks, split_tasks
from calibrl.trainer.update import use_bf16

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.policy import Policy
    from calibrl.trainer.tasks import Task

log = logging.getLogger(__name__)


@dataclass
class TrainingRun:
    """The parts of a run, ready for its first (or resumed) step."""

    ctx: dist_util.DistContext
    device: str  # the torch device of this rank
    policy: "Policy"
    reference: "torch.nn.Module | None"  # the frozen reference model, None when loss.beta == 0
    engine: "GenerationEngine"
    optimizer: "torch.optim.Optimizer"
    scheduler: "torch.optim.lr_scheduler.LambdaLR"
    tasks: list["Task"]
    kind: TaskKind
    order: dist_util.TaskOrder
    state: ckpt.TrainState
    checkpoint_from: pathlib.Path | None  # the checkpoint resumed from, or None


def build_run(config: "TrainConfig", resume: str | pathlib.Path | None) -> TrainingRun:
    """Load and (when ``resume`` is given) restore every part of the run."""
    ctx = dist_util.init_distributed(config.policy.device)
    device = str(resolve_device(dist_util.rank_device(config.policy.device, ctx)))
    seed_everything(config.seed)  # identical on every rank: LoRA init must match
    policy = load_policy(config.policy.path, device=device, dtype=config.policy.dtype,
                         lora=config.policy.lora.settings(),
                         gradient_checkpointing=config.policy.gradient_checkpointing)
    reference = make_reference(policy) if config.loss.beta > 0 else None
    checkpoint_from = ckpt.find_checkpoint(resume) if resume else None
    if checkpoint_from is not None:
        ckpt.load_model_weights(checkpoint_from, policy.model)
    if ctx.distributed and config.distributed.strategy == "ddp":
        _broadcast_parameters(policy.model)
    if ctx.distributed and config.distributed.strategy == "fsdp":
        dist_util.apply_fsdp(policy.model, ctx, mixed_precision=use_bf16(config, device))
    engine = engines.make_engine(config.rollout.engine, policy, **_engine_kwargs(config))
    optimizer, scheduler = _optimizer_and_schedule(config, policy.model)
    tasks, kind = load_training_tasks(config)
    if config.rollout.prompts_per_step % ctx.world_size:
        raise ConfigError(
            f"rollout.prompts_per_step={config.rollout.prompts_per_step} does not split over "
            f"{ctx.world_size} ranks: make it a multiple of the number of processes"
        )
    order = dist_util.TaskOrder(len(tasks), config.seed, shuffle=config.tasks.shuffle)
    run = TrainingRun(ctx, device, policy, reference, engine, optimizer, scheduler, tasks, kind, order,
                      ckpt.TrainState(world_size=ctx.world_size), checkpoint_from)
    if checkpoint_from is not None:
        _restore(run, config, checkpoint_from)
    else:
        seed_everything(config.seed + ctx.rank)  # sampling differs per rank
    return run


def _restore(run: TrainingRun, config: "TrainConfig", checkpoint_from: pathlib.Path) -> None:
    """Continue from ``checkpoint_from``: step, optimizer, schedule, data position, RNG."""
    ctx = run.ctx
    run.state = ckpt.load_train_state(checkpoint_from)
    if run.state.world_size != ctx.world_size:
        raise ConfigError(
            f"checkpoint {checkpoint_from} was written by {run.state.world_size} processes, this run has "
            f"{ctx.world_size}: resume with --nproc_per_node {run.state.world_size}"
        )
    optimizer_state = ckpt.load_optimizer_and_schedule(checkpoint_from, run.optimizer, run.scheduler)
    if config.distributed.strategy == "fsdp" and ctx.distributed:
        dist_util.load_full_optimizer_state(run.policy.model, run.optimizer, optimizer_state)
    else:
        run.optimizer.load_state_dict(optimizer_state)
    run.order.load_state(run.state.data_position)
    ckpt.load_rng(checkpoint_from, ctx.rank)
    run.engine.update_weights(run.policy.model)
    log.info("resumed from %s at step %d", checkpoint_from, run.state.step)


def _optimizer_and_schedule(config: "TrainConfig",
                            model: "torch.nn.Module") -> "tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]":
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        eps=config.optimizer.eps,
        weight_decay=config.optimizer.weight_decay,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))


def load_training_tasks(config: "TrainConfig") -> tuple[list["Task"], TaskKind]:
    """The training tasks (held-out part removed) and their registered kind; one kind per run."""
    kind = None if config.tasks.kind == "auto" else config.tasks.kind
    tasks = load_tasks(config.tasks.path, kind=kind, fmt=config.tasks.format)
    if config.tasks.limit:
        tasks = tasks[: config.tasks.limit]
    if config.tasks.heldout_fraction > 0:
        tasks, _ = split_tasks(tasks, config.tasks.heldout_fraction, config.seed)
    kinds = {t.kind for t in tasks}
    if len(kinds) != 1:
        raise ConfigError(f"tasks.path={config.tasks.path}: mixes task kinds {sorted(kinds)}; train one agent at a time")
    found = task_kind(kinds.pop())
    needs_multi_step = config.advantage.needs_multi_step
    if needs_multi_step and not found.multi_step:
        raise ConfigError(
            f"advantage.type={config.advantage.type} but {config.tasks.path} holds {found.name} tasks: "
            f"{needs_multi_step}; use advantage.type=grpo"
        )
    return tasks, found


def lr_lambda(config: "TrainConfig") -> Callable[[int], float]:
    """Multiplier of the peak lr at scheduler step ``n`` (0-based optimizer steps):
    linear warmup over ``warmup_steps``, then constant, linear or cosine decay to
    ``min_lr_ratio`` at the last step."""
    opt = config.optimizer
    warmup, total, floor = opt.warmup_steps, config.steps, opt.min_lr_ratio

    def multiplier(n: int) -> float:
        if warmup and n < warmup:
            return (n + 1) / warmup
        if opt.schedule == "constant":
            return 1.0
        span = max(1, total - warmup - 1)
        progress = min(1.0, (n - warmup) / span)
        if opt.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _broadcast_parameters(model: "torch.nn.Module") -> None:
    import torch.distributed as dist

    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


def _engine_kwargs(config: "TrainConfig") -> dict[str, int | bool]:
    if config.rollout.engine != "transformers":
        return {}
    rollout = config.rollout
    share = rollout.share_prompt_prefix if rollout.share_generation_prompts == "auto" \
        else rollout.share_generation_prompts == "on"
    return {"max_batch_size": rollout.generation_batch_size or None, "share_prompts": share}


__all__ = ["TrainingRun", "build_run", "load_training_tasks", "lr_lambda", "seed_everything"]
