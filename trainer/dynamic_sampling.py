"""Dynamic sampling (DAPO, Yu et al. 2025): train on groups whose rewards differ.

A group whose G rewards are all equal has advantage 0 on every token and teaches
the policy nothing, yet takes its share of the batch. With
``rollout.dynamic_sampling=true`` a step samples ``prompts_per_step`` fresh tasks
per round, scores them, keeps the groups whose rewards are not all equal, and
samples again until ``prompts_per_step`` groups are kept or
``rollout.max_sampling_rounds`` rounds were sampled. The rule of this module:

* groups are kept in the order they were sampled; varied groups beyond the batch
  size are dropped (their tasks count as visited);
* when the bound is reached with fewer varied groups than the batch size, the
  batch is filled up with all-equal groups, first sampled first, so every step
  still trains exactly ``prompts_per_step`` groups and makes one update (the
  same budget of policy updates and the same batch shape as without it; the
  filling groups add nothing to the advantage, only to the KL term);
* "all equal" is the rule of ``frac_reward_zero_std``: the unbiased group std is
  at most ``calibrl.trainer.advantages.ZERO_STD_ATOL``.

Everything here is plain Python except :func:`select_rows` (tensors already made).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.rollout import RolloutBatch

# The bound of calibrl.trainer.advantages.ZERO_STD_ATOL, repeated so this module imports no torch;
# tests/test_dynamic_sampling.py checks the two are equal.
ZERO_STD_ATOL = 1e-8


def rewards_all_equal(rewards: Sequence[float]) -> bool:
    """True when a group's rewards have (unbiased) std <= ZERO_STD_ATOL (a group of one: True)."""
    if len(rewards) < 2:
        return True
    mean = sum(rewards) / len(rewards)
    variance = sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)
    return math.sqrt(variance) <= ZERO_STD_ATOL


@dataclass(frozen=True)
class GroupSelection:
    """Which of the sampled groups a step trains on (indices in sampling order)."""

    kept: tuple[int, ...]  # groups whose rewards differ, at most the batch size
    filled: tuple[int, ...]  # all-equal groups added because the bound was reached

    @property
    def groups(self) -> tuple[int, ...]:
        """The groups trained on, in sampling order."""
        return tuple(sorted(self.kept + self.filled))


def select_groups(group_rewards: Sequence[Sequence[float]], wanted: int) -> GroupSelection:
    """The groups to train on out of ``group_rewards`` (one reward list per sampled group,
    in sampling order, called once sampling stopped): the first ``wanted`` whose rewards
    differ; when fewer differ (the bound was reached), the first all-equal ones fill up
    to ``wanted``."""
    if wanted < 1:
        raise ValueError(f"select_groups: wanted={wanted} must be >= 1")
    varied = [g for g, rewards in enumerate(group_rewards) if not rewards_all_equal(rewards)]
    kept = tuple(varied[:wanted])
    filled: tuple[int, ...] = ()
    if len(kept) < wanted:
        equal = [g for g, rewards in enumerate(group_rewards) if rewards_all_equal(rewards)]
        filled = tuple(equal[: wanted - len(kept)])
    return GroupSelection(kept, filled)


def enough_kept(group_rewards: Sequence[Sequence[float]], wanted: int) -> bool:
    """Whether the groups sampled so far hold ``wanted`` groups whose rewards differ."""
    return sum(not rewards_all_equal(rewards) for rewards in group_rewards) >= wanted


def select_rows(batch: "RolloutBatch", rows: Sequence[int]) -> "RolloutBatch":
    """A RolloutBatch of ``rows`` of ``batch`` (in that order; the width is kept: padding
    columns are masked everywhere)."""
    import torch

    index = torch.tensor(list(rows), dtype=torch.long, device=batch.input_ids.device)

    def take(tensor: "torch.Tensor") -> "torch.Tensor":
        return tensor[index]

    return replace(
        batch,
        input_ids=take(batch.input_ids),
        attention_mask=take(batch.attention_mask),
        completion_mask=take(batch.completion_mask),
        segment_index=take(batch.segment_index),
        answer_mask=take(batch.answer_mask),
        group_index=batch.group_index[index],
        completion_texts=[batch.completion_texts[r] for r in rows],
        rollouts=[batch.rollouts[r] for r in rows],
        prompt_lengths=[batch.prompt_lengths[r] for r in rows] if batch.prompt_lengths else [],
    )


__all__ = ["GroupSelection", "ZERO_STD_ATOL", "enough_kept", "rewards_all_equal", "select_groups", "select_rows"]
