"""Writing the run's checkpoints, pending rollouts included.

:class:`Checkpointer` writes the state after ``state.step`` steps: model, optimizer,
schedule, RNG, data position and, when the next step's rollouts were already taken
from the data (one step off-policy, or a reward failure), those rollouts, so a
resumed run trains on exactly them. ``calibrl.trainer.checkpoint`` holds the file format.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

from calibrl.trainer import checkpoint as ckpt
from calibrl.trainer import distributed as dist_util

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase
    import torch

    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.handoff import PendingBatch


class Checkpointer:
    """Saves checkpoints of one run (one job: the write; pruning old ones on rank 0)."""

    def __init__(self, config: "TrainConfig", ctx: dist_util.DistContext, model: "torch.nn.Module",
                 tokenizer: "PreTrainedTokenizerBase",
                 optimizer: "torch.optim.Optimizer", scheduler: "torch.optim.lr_scheduler.LRScheduler",
                 order: dist_util.TaskOrder) -> None:
        self.config, self.ctx, self.model, self.tokenizer = config, ctx, model, tokenizer
        self.optimizer, self.scheduler, self.order = optimizer, scheduler, order
        self.config_yaml = config.to_yaml()

    def save(self, state: ckpt.TrainState, reason: str, rng: ckpt.RngState | None = None,
             position: dict[str, int] | None = None, pending: "PendingBatch | None" = None) -> pathlib.Path:
        """A checkpoint of the state after ``state.step`` steps. ``rng``/``position``:
        the RNG state and data position to store (default: the current ones);
        ``pending``: rollouts already taken from the data for the next step (kept,
        with their scores when they are in)."""
        config, ctx = self.config, self.ctx
        state.reason = reason
        state.data_position = position if position is not None else self.order.state()
        full_model, full_optim = (None, None)
        if config.distributed.strategy == "fsdp" and ctx.distributed:
            full_model, full_optim = dist_util.full_state_dicts(self.model, self.optimizer)
        elif ctx.distributed:
            dist_util.check_in_sync([p for p in self.model.parameters() if p.requires_grad], ctx)
        path = ckpt.save_checkpoint(
            ckpt.checkpoint_dir(config.run_dir, state.step),
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=state,
            config_yaml=self.config_yaml,
            rank=ctx.rank,
            rng=rng,
            pending=None if pending is None else pending.to_saved(),
            full_model_state=full_model,
            optimizer_state=full_optim,
        )
        if ctx.is_main:
            ckpt.prune_checkpoints(config.run_dir, config.keep_checkpoints)
        return path


__all__ = ["Checkpointer"]
