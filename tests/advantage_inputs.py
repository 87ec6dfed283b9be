"""Advantage inputs of one-segment rollouts (a query rewriter), built by hand for the tests."""

from __future__ import annotations

import torch

from calibrl.trainer.advantages import AdvantageInputs


def single_turn_inputs(rewards: torch.Tensor, group_index: torch.Tensor,
                       completion_mask: torch.Tensor) -> AdvantageInputs:
    """Every trained token is answer segment 0 (what a rewrite rollout's layout gives)."""
    segment_index = torch.where(completion_mask.bool(), 0, -1).to(torch.long)
    # the masks go in as given: AdvantageInputs checks them (a 0/1 integer mask is accepted)
    return AdvantageInputs(rewards, group_index, completion_mask, segment_index, completion_mask.clone())
