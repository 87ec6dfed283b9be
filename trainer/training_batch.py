"""Stage 3 of a step: a scored batch -> a training batch (per-token advantages).

The estimator named by ``advantage.type`` (``calibrl.trainer.advantages``) turns the rewards
and the token layout of the rollouts into ``token_adv`` (B, L). What an estimator
reads from the rollouts beyond that (CalibAdv's step scores) is registered with the
estimator itself (``register_advantage(..., batch_inputs=...)``), so this stage, and
the loop above it, never name an estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.config import CalibAdvAdvantage, GrpoAdvantage
    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.rollout import RolloutBatch
    from calibrl.trainer.scoring import ScoredBatch


@dataclass
class TrainingBatch:
    """What the update consumes: the rollouts' tokens and masks, their behaviour
    log-probs (``batch.old_logp``, None on-policy) and per-token advantages."""

    step: int
    batch: "RolloutBatch"  # input_ids, attention_mask, completion_mask (B, L); old_logp (B, L) or None
    token_adv: "torch.Tensor"  # (B, L) float, 0 wherever completion_mask is False
    breakdowns: list["RewardBreakdown"]  # one per row (for the per-component reward metrics)
    metrics: dict[str, float]  # the estimator's: reward, reward_std, frac_reward_zero_std, ...


def to_training_batch(scored: "ScoredBatch", advantage: "GrpoAdvantage | CalibAdvAdvantage") -> TrainingBatch:
    """Per-token advantages of ``scored`` from the registered estimator ``advantage.type``
    with ``advantage.params()``."""
    from calibrl.trainer.advantages import AdvantageInputs, batch_inputs_for, compute_advantages

    batch = scored.batch
    rewards = scored.rewards
    extra_inputs, extra_metrics = batch_inputs_for(advantage.type, batch, advantage)
    inputs = AdvantageInputs(
        rewards=rewards,
        group_index=batch.group_index,
        completion_mask=batch.completion_mask,
        segment_index=batch.segment_index,
        answer_mask=batch.answer_mask,
        **extra_inputs,
    )
    token_adv, metrics = compute_advantages(advantage.type, inputs, **advantage.params())
    return TrainingBatch(scored.step, batch, token_adv, scored.breakdowns, {**metrics, **extra_metrics})


__all__ = ["TrainingBatch", "to_training_batch"]
