"""Stage 2 of a step: rollouts whose rewards are being computed -> a scored batch.

:class:`PendingBatch` is one step's rollouts from generation to update: the
:class:`~calibrl.trainer.rollout.RolloutBatch` and its reward futures (one per generation
chunk, running on the background event loop). :meth:`PendingBatch.scored` waits
for them and hands on a :class:`ScoredBatch` (both types live in
:mod:`calibrl.trainer.handoff`). A pending batch can be written into a checkpoint
(with its scores when they are in) and restored from one, so a run that stops
between sampling and training resumes on exactly those rollouts.

A reward that could not be computed raises: it is never turned into a 0.
"""

from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from calibrl.errors import CalibrlError, ConfigError
from calibrl.trainer import checkpoint as ckpt
from calibrl.trainer.handoff import PendingBatch, RolloutBatch, ScoredBatch

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.rewards import RewardBreakdown

log = logging.getLogger(__name__)

# The reward coroutine of a batch's rollouts: one RewardBreakdown per row, in order.
ScoreFn = Callable[["RolloutBatch"], Coroutine[Any, Any, "list[RewardBreakdown]"]]


def settled(pending: PendingBatch | None) -> PendingBatch | None:
    """A copy of ``pending`` with its scores waited for, so a checkpoint keeps them; a
    score that fails now is left out and asked for again by the resumed run."""
    if pending is None:
        return None
    try:
        return pending.with_scores()
    except CalibrlError as exc:
        log.warning("rollouts of step %d: %s; the resumed run scores them again", pending.step, exc)
        return pending.without_scores()


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
    batch = saved["batch"].to(device)
    # checkpoints written before the behaviour log-probs moved here kept them on the batch
    behaviour = saved.get("behaviour_logp", getattr(saved["batch"], "old_logp", None))
    futures = (background.submit(score(batch)),) if saved["breakdowns"] is None else ()
    return PendingBatch(saved["step"], batch, futures, saved["data_position"], saved["breakdowns"],
                        behaviour_logp=None if behaviour is None else behaviour.to(device))


__all__ = ["PendingBatch", "ScoreFn", "ScoredBatch", "restore_pending", "settled"]
