"""Stage 3 of a step: a scored batch -> a training batch (per-token advantages).

The estimator named by ``advantage.type`` (``calibrl.trainer.advantages``) turns the rewards
and the token layout of the rollouts into ``token_adv`` (B, L). What an estimator
reads from the rollouts beyond that (CalibAdv's step scores) is registered with the
estimator itself (``register_advantage(..., batch_inputs=...)``), so this stage, and
the loop above it, never name an estimator. When the rewards carry per-step dense
rewards (search agents, ``calibrl.trainer.kinds.search.step_rewards``) they go in as
``step_rewards`` (B, S), NaN where a rollout has no step k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from calibrl.trainer.handoff import ScoredBatch, TrainingBatch

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.config import CalibAdvAdvantage, GrpoAdvantage
    from calibrl.trainer.rewards import RewardBreakdown


def to_training_batch(scored: ScoredBatch, advantage: "GrpoAdvantage | CalibAdvAdvantage") -> TrainingBatch:
    """Per-token advantages of ``scored`` from the registered estimator ``advantage.type``
    with ``advantage.params()``."""
    # lazy: advantages imports torch, which this module does not
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
        step_rewards=step_reward_tensor(scored.breakdowns, batch.segment_index),
        **extra_inputs,
    )
    token_adv, metrics = compute_advantages(advantage.type, inputs, **advantage.params())
    return TrainingBatch(scored.step, batch, token_adv, scored.breakdowns, {**metrics, **extra_metrics},
                         scored.behaviour_logp)


def step_reward_tensor(breakdowns: "list[RewardBreakdown]", segment_index: "torch.Tensor") -> "torch.Tensor | None":
    """(B, S) float32 step rewards of the rows (step k in slot k, NaN where a row has no
    step k); None when no row's step rewards were computed. S covers every segment."""
    import torch

    if not any(b.steps_scored for b in breakdowns):
        return None
    slots = max(int(segment_index.max()) + 1 if segment_index.numel() else 1,
                max(len(b.steps) for b in breakdowns), 1)
    table = torch.full((len(breakdowns), slots), float("nan"), dtype=torch.float32)
    for row, breakdown in enumerate(breakdowns):
        for k, step in enumerate(breakdown.steps):
            table[row, k] = step.reward
    return table.to(segment_index.device)


__all__ = ["TrainingBatch", "step_reward_tensor", "to_training_batch"]
