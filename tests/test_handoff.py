"""The hand-off types of a step's stages (``calibrl.trainer.handoff``) are frozen: a stage
cannot reassign what it received, and the stages that add to a batch hand on a copy."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest
import torch

from calibrl.errors import RewardError
from calibrl.trainer import handoff
from calibrl.trainer.handoff import PendingBatch, RolloutBatch, StepRollouts, TrainingBatch
from calibrl.trainer.rewards import RewardBreakdown
from calibrl.trainer.rollout import assemble_rows
from calibrl.trainer.scoring import settled


def _future(value=None, exc=None):
    future = concurrent.futures.Future()
    future.set_exception(exc) if exc is not None else future.set_result(value)
    return future


def _batch() -> RolloutBatch:
    rows = [[([1, 2], False), ([3, 4], True)]] * 2
    return RolloutBatch(**assemble_rows(rows, pad_id=0), group_index=torch.zeros(2, dtype=torch.long),
                        completion_texts=["", ""], rollouts=[None, None])


def test_every_hand_off_type_is_a_frozen_dataclass():
    for name in handoff.__all__:
        cls = getattr(handoff, name)
        if name == "Rollout":  # the protocol of a kind's records, not a dataclass
            continue
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name


@pytest.mark.parametrize("obj, field, value", [
    (PendingBatch(1, None, (), {}), "behaviour_logp", torch.zeros(1)),
    (PendingBatch(1, None, (), {}), "breakdowns", []),
    (StepRollouts(None, None, None), "current", None),
    (TrainingBatch(1, None, torch.zeros(1), [], {}), "token_adv", torch.ones(1)),
    (handoff.ScoredBatch(1, None, []), "breakdowns", [RewardBreakdown(1.0)]),
    (handoff.UpdateResult({}, True), "stepped", False),
    (handoff.EarlyForward([], [], None), "first", None),
    (handoff.MicroBatch(torch.zeros(1), torch.zeros(1), 0, torch.zeros(1), None), "start", 1),
])
def test_a_stage_cannot_reassign_what_it_received(obj, field, value):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, value)


def test_a_rollout_batch_cannot_be_reassigned_and_to_makes_a_copy():
    batch = _batch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.group_index = torch.ones(2, dtype=torch.long)
    moved = batch.to("cpu")
    assert moved is not batch and torch.equal(moved.input_ids, batch.input_ids)


def test_adding_to_a_pending_batch_hands_on_a_copy():
    batch = _batch()
    pending = PendingBatch(4, batch, (_future([RewardBreakdown(1.0), RewardBreakdown(0.0)]),), {"offset": 2})
    logp = torch.full(batch.input_ids.shape, -1.0)
    stale = pending.with_behaviour_logp(logp)
    assert pending.behaviour_logp is None and stale.behaviour_logp is logp
    assert stale.scored().behaviour_logp is logp
    scored = settled(stale)
    assert scored is not stale and scored.futures == () and [b.total for b in scored.breakdowns] == [1.0, 0.0]
    assert stale.breakdowns is None and len(stale.futures) == 1  # the original is untouched
    assert scored.without_scores().breakdowns is None and scored.breakdowns is not None


def test_a_failed_score_is_dropped_from_the_copy_and_still_raises_on_the_original():
    failing = PendingBatch(2, _batch(), (_future([RewardBreakdown(1.0)]), _future(exc=RewardError("judge down"))), {})
    saved = settled(failing)
    assert saved.breakdowns is None and saved.futures == ()
    with pytest.raises(RewardError, match="judge down"):
        failing.scored()  # the step that trains on it stops for the failure; it never trains on no rewards


def test_the_upcoming_batch_gets_its_behaviour_logprobs_on_a_copy():
    upcoming = PendingBatch(2, _batch(), (), {})
    rollouts = StepRollouts(PendingBatch(1, _batch(), (), {}), upcoming, None)
    with_logp = rollouts.with_upcoming_behaviour(lambda batch: torch.full(batch.input_ids.shape, -2.0))
    assert float(with_logp.upcoming.behaviour_logp.sum()) == -2.0 * upcoming.batch.input_ids.numel()
    assert rollouts.upcoming.behaviour_logp is None and with_logp.current is rollouts.current
    on_policy = StepRollouts(rollouts.current, None, None)
    assert on_policy.with_upcoming_behaviour(lambda batch: 1 / 0) is on_policy
