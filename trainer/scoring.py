"""Stage 2 of a step: rollouts whose rewards are being computed -> a scored batch.

:class:`PendingBatch` is one step's rollouts from generation to update: the
:class:`~calibrl.trainer.rollout.RolloutBatch` and its reward futures (one per generation
chunk, running on the background event loop). :meth:`PendingBatch.scored` waits
for them and hands on a :class:`ScoredBatch`. A pending batch can be written into
a checkpoint (with its scores when they are in) and restored from one, so a run
that stops between sampling and training resumes on exactly those rollouts.

A reward that could not be computed raises: it is never turned into a 0.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from calibrl.errors import CalibrlError, ConfigError
from calibrl.trainer import checkpoint as ckpt

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.rollout import RolloutBatch

log = logging.getLogger(__name__)

# The reward coroutine of a batch's rollouts: one RewardBreakdown per row, in order.
ScoreFn = Callable[["RolloutBatch"], Coroutine[Any, Any, "list[RewardBreakdown]"]]


@dataclass
class ScoredBatch:
    """A step's rollouts with one reward breakdown per row (the hand-off to the
    advantage stage)."""

    step: int
    batch: "RolloutBatch"  # on the training device
    breakdowns: list["RewardBreakdown"]  # one per row: the total reward and its components
    behaviour_logp: "torch.Tensor | None" = None  # (B, L) when sampled before the last update, else None

    @property
    def rewards(self) -> "torch.Tensor":
        """(B,) float32 total rewards, on the batch's device."""
        import torch

        return torch.tensor([b.total for b in self.breakdowns], dtype=torch.float32,
                            device=self.batch.input_ids.device)


@dataclass
class PendingBatch:
    """One step's rollouts from generation to update: the batch, its behaviour
    log-probs when it was sampled before the last update (one step off-policy), and
    its reward futures, one per generation chunk, until settled."""

    step: int
    batch: "RolloutBatch"  # on the training device
    futures: list["concurrent.futures.Future[list[RewardBreakdown]]"]  # in chunk order
    data_position: dict[str, int]  # TaskOrder.state() just after this step's tasks were taken
    breakdowns: list["RewardBreakdown"] | None = None  # one per row once every future is in
    generation_s: float = field(default=0.0)
    sampling_metrics: dict[str, float] = field(default_factory=dict)  # sampling/* of dynamic sampling, else empty
    # (B, L) log-probs under the weights that sampled the batch, taken before the update that follows its
    # sampling (pipeline.py); None on-policy, where the loss uses the current log-probs, detached.
    behaviour_logp: "torch.Tensor | None" = None

    def settle(self) -> list["RewardBreakdown"]:
        """The rows' rewards, waiting for the futures; raises the first failure."""
        if self.breakdowns is None:
            breakdowns: list[RewardBreakdown] = []
            failure = None
            for future in self.futures:
                try:
                    breakdowns.extend(future.result())
                except CalibrlError as exc:
                    failure = failure or exc
            if failure is not None:
                raise failure
            self.breakdowns, self.futures = breakdowns, []
        return self.breakdowns

    def scored(self) -> ScoredBatch:
        """Wait for the rewards (raises the first failure) and hand the batch on."""
        return ScoredBatch(self.step, self.batch, self.settle(), self.behaviour_logp)

    def forget_scores(self) -> None:
        """Drop the scores (a resumed run asks for them again)."""
        self.breakdowns, self.futures = None, []

    def to_saved(self) -> ckpt.SavedPending:
        """What a checkpoint stores of it (tensors on the CPU; scores when settled)."""
        behaviour = None if self.behaviour_logp is None else self.behaviour_logp.to("cpu")
        return {"step": self.step, "batch": self.batch.to("cpu"), "breakdowns": self.breakdowns,
                "data_position": self.data_position, "behaviour_logp": behaviour}


def settled(pending: PendingBatch | None) -> PendingBatch | None:
    """``pending`` with its scores waited for, so a checkpoint keeps them; a score
    that fails now is left out and asked for again by the resumed run."""
    if pending is not None:
        try:
            pending.settle()
        except CalibrlError as exc:
            log.warning("rollouts of step %d: %s; the resumed run scores them again", pending.step, exc)
            pending.forget_scores()
    return pending


def restore_pending(checkpoint: pathlib.Path, rank: int, next_step: int, background: "BackgroundLoop",
                    score: ScoreFn, device: str) -> PendingBatch | None:
    """The rollouts a checkpoint holds for its next step (None when it holds none),
    with their scoring resubmitted when the checkpoint has no scores for them."""
    saved = ckpt.load_pending(checkpoint, rank)
    if saved is None:
        return None
    if saved["step"] != next_step:
        raise ConfigError(
            f"{checkpoint}: pending_rank{rank}.pt holds rollouts of step {saved['step']}, but the run resumes at "
            f"step {next_step}; the checkpoint was altered, resume from an untouched one"
        )
    pending = PendingBatch(saved["step"], saved["batch"].to(device), [], saved["data_position"], saved["breakdowns"])
    # checkpoints written before the behaviour log-probs moved here kept them on the batch
    behaviour = saved.get("behaviour_logp", getattr(saved["batch"], "old_logp", None))
    pending.behaviour_logp = None if behaviour is None else behaviour.to(device)
    if pending.breakdowns is None:
        pending.futures = [background.submit(score(pending.batch))]
    return pending


__all__ = ["PendingBatch", "ScoreFn", "ScoredBatch", "restore_pending", "settled"]
