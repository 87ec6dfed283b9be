"""GRPO advantages: a plain-loop reference against the vectorised estimator,
hand-computed cases, metrics, the registry and input validation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from calibrl.errors import InvalidArgument
from calibrl.trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    register_advantage,
)
from tests.advantage_inputs import single_turn_inputs

# ---------------------------------------------------------------------------
# Random batches (shared with test_calibadv)
# ---------------------------------------------------------------------------


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

def random_layout(rng: random.Random, batch: int, width: int, max_segments: int):
    """Token layout of ``batch`` multi-turn rollouts in ``width`` positions.

    Each row: [segment 0][observation gap][segment 1]...[last segment][padding],
    truncated at ``width``; some rows have no trained token at all.
    Returns completion_mask (B, T) bool, segment_index (B, T) long, answer_mask.
    """
    mask = torch.zeros(batch, width, dtype=torch.bool)
    segment = torch.full((batch, width), -1, dtype=torch.long)
    for row in range(batch):
        if rng.random() < 0.1:
            continue
        position = rng.randint(0, 1)  # an untrained leading token now and then
        for k in range(rng.randint(1, max_segments)):
            for _ in range(rng.randint(1, 3)):
                if position < width:
                    mask[row, position] = True
                    segment[row, position] = k
                position += 1
            position += rng.randint(0, 2)  # the observation between turns is not trained
    last = segment.max(dim=1, keepdim=True).values
    answer = mask & (segment == last)
    return mask, segment, answer


def random_batch(seed: int, max_segments: int = 3, with_scores: bool = False) -> AdvantageInputs:
    rng = random.Random(seed)
    batch, width = rng.randint(4, 14), rng.randint(3, 12)
    labels = [-3, 7, 10, 42, 5]
    group_index = torch.tensor([rng.choice(labels[: rng.randint(1, 5)]) for _ in range(batch)])
    # Rewards on a coarse grid so that some groups have all-equal rewards.
    rewards = torch.tensor([rng.choice([0.0, 0.25, 0.5, 1.0]) + (rng.random() if rng.random() < 0.3 else 0.0)
                            for _ in range(batch)], dtype=torch.float32)
    mask, segment, answer = random_layout(rng, batch, width, max_segments)
    scores = None
    if with_scores:
        slots = max_segments
        scores = torch.tensor([[rng.choice([0.0, 0.2, 0.5, 1.0, rng.random()]) for _ in range(slots)]
                               for _ in range(batch)])
        for row in range(batch):
            if rng.random() < 0.15:  # a rollout without step scores
                scores[row] = float("nan")
    return AdvantageInputs(rewards, group_index, mask, segment, answer, scores)


# ---------------------------------------------------------------------------
# Plain-loop reference
# ---------------------------------------------------------------------------


def group_stats(rewards: list[float], groups: list[int]) -> dict[int, tuple[float, float]]:
    """group -> (mean, unbiased std; 0 for a group of one)."""
    members: dict[int, list[float]] = {}
    for reward, group in zip(rewards, groups):
        members.setdefault(group, []).append(reward)
    stats = {}
    for group, values in members.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        stats[group] = (mean, std)
    return stats


def reference_grpo(inputs: AdvantageInputs, scale: str = "group", eps: float = 1e-4) -> list[list[float]]:
    rewards = [float(r) for r in inputs.rewards]
    groups = [int(g) for g in inputs.group_index]
    stats = group_stats(rewards, groups)
    batch_mean = sum(rewards) / len(rewards)
    batch_std = (math.sqrt(sum((r - batch_mean) ** 2 for r in rewards) / (len(rewards) - 1))
                 if len(rewards) > 1 else 0.0)
    out = []
    for i, reward in enumerate(rewards):
        mean, std = stats[groups[i]]
        advantage = reward - mean
        if scale == "group":
            advantage /= std + eps
        elif scale == "batch":
            advantage /= batch_std + eps
        out.append([advantage if bool(m) else 0.0 for m in inputs.completion_mask[i]])
    return out


# ---------------------------------------------------------------------------
# grpo
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(12))
def test_grpo_matches_loop_reference(seed: int, scale: str) -> None:
    inputs = random_batch(seed)
    token_adv, _ = compute_advantages("grpo", inputs, scale=scale)
    expected = torch.tensor(reference_grpo(inputs, scale), dtype=torch.float64)
    assert token_adv.shape == inputs.completion_mask.shape
    assert token_adv.dtype == torch.float32
    # float32 group mean / std of <= 8 rewards in [0, 1] (float32_sum_error(8, 8) ~ 7e-6 before the
    # division), against a float64 loop: atol 1e-5 is that bound; a wrong group or scale is off by >= 1e-2.
    torch.testing.assert_close(token_adv.double(), expected, atol=1e-5, rtol=1e-6)
    assert bool((token_adv[~inputs.completion_mask] == 0).all())


def test_grpo_hand_computed_group_scale() -> None:
    # Group 7: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5) -> A = +-0.5 / (0.70711 + 1e-4).
    # Group 3: 0.5, 0.5 -> zero std -> A = 0. Group 9 (ids need not be contiguous): 0, 0, 0.9.
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.9, 0.0])
    group_index = torch.tensor([7, 7, 3, 3, 9, 9, 9])
    mask = torch.ones(7, 2, dtype=torch.bool)
    token_adv, metrics = compute_advantages("grpo", single_turn_inputs(rewards, group_index, mask))
    half = 0.5 / (math.sqrt(0.5) + 1e-4)
    std9 = math.sqrt((0.3 ** 2 * 2 + 0.6 ** 2) / 2)
    expected = [half, -half, 0.0, 0.0, -0.3 / (std9 + 1e-4), 0.6 / (std9 + 1e-4), -0.3 / (std9 + 1e-4)]
    # Groups of 2-3 rewards with one decimal: float32 mean / std round a few times (|A| < 1.5, u = 6e-8),
    # so 1e-6 (~16 u) bounds it.
    torch.testing.assert_close(token_adv[:, 0].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(token_adv[:, 0], token_adv[:, 1])
    assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert metrics["reward"] == pytest.approx(float(rewards.double().mean()))
    assert metrics["reward_std"] == pytest.approx(float(rewards.double().std()))
    assert metrics["reward_std_within_group"] == pytest.approx((math.sqrt(0.5) + 0.0 + std9) / 3)
    # float32 mean of 14 values vs float64: float32_sum_error(14, .) / sum < 2 * 13 u = 1.6e-6 worst case
    # for the sum, but 7 distinct values of one sign sum with error ~ 7 u: rel 1e-6.
    assert metrics["advantage/abs_mean"] == pytest.approx(sum(abs(a) for a in expected) / 7, rel=1e-6)


def test_grpo_scale_none_and_batch_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    group_index = torch.tensor([0, 0, 1, 1])
    inputs = single_turn_inputs(rewards, group_index, torch.ones(4, 1, dtype=torch.bool))
    plain, _ = compute_advantages("grpo", inputs, scale="none")
    assert plain[:, 0].tolist() == [0.5, -0.5, 1.0, -1.0]
    batch_std = float(rewards.std())  # unbiased, as torch.std / TRL
    scaled, _ = compute_advantages("grpo", inputs, scale="batch", eps=0.0)
    torch.testing.assert_close(scaled[:, 0], torch.tensor([0.5, -0.5, 1.0, -1.0]) / batch_std)


def test_grpo_all_equal_rewards_give_zero_advantage_and_are_counted() -> None:
    inputs = single_turn_inputs(torch.full((6,), 0.3), torch.tensor([1, 1, 1, 2, 2, 2]),
                                         torch.ones(6, 3, dtype=torch.bool))
    for scale in ("group", "batch", "none"):
        token_adv, metrics = compute_advantages("grpo", inputs, scale=scale)
        assert bool((token_adv == 0).all())
        assert metrics["frac_reward_zero_std"] == 1.0
        assert metrics["advantage/abs_mean"] == 0.0


def test_grpo_group_of_one_gets_zero_advantage() -> None:
    inputs = single_turn_inputs(torch.tensor([0.9, 1.0, 0.0]), torch.tensor([5, 6, 6]),
                                         torch.ones(3, 2, dtype=torch.bool))
    token_adv, metrics = compute_advantages("grpo", inputs)
    assert token_adv[0].tolist() == [0.0, 0.0]
    assert float(token_adv[1, 0]) > 0 > float(token_adv[2, 0])
    assert metrics["frac_reward_zero_std"] == pytest.approx(0.5)  # the singleton counts as zero-std


def test_grpo_keeps_float64_rewards_and_does_not_mutate_inputs() -> None:
    inputs = random_batch(3)
    inputs64 = AdvantageInputs(inputs.rewards.double(), inputs.group_index, inputs.completion_mask,
                               inputs.segment_index, inputs.answer_mask)
    before = [t.clone() for t in (inputs64.rewards, inputs64.group_index, inputs64.completion_mask,
                                  inputs64.segment_index, inputs64.answer_mask)]
    token_adv, _ = compute_advantages("grpo", inputs64)
    assert token_adv.dtype == torch.float64
    after = (inputs64.rewards, inputs64.group_index, inputs64.completion_mask, inputs64.segment_index,
             inputs64.answer_mask)
    for old, new in zip(before, after):
        assert torch.equal(old, new)


def test_integer_masks_are_accepted() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    inputs = single_turn_inputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    token_adv, _ = compute_advantages("grpo", inputs, scale="none")
    assert token_adv.tolist() == [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


def test_registry_runs_a_new_estimator_by_name() -> None:
    @register_advantage("test_sign_only")
    def sign_only(inputs: AdvantageInputs, *, magnitude: float = 1.0):
        token_adv = torch.where(inputs.trained, torch.sign(inputs.rewards - 0.5)[:, None] * magnitude, 0.0)
        return token_adv, {"magnitude": magnitude}

    try:
        inputs = single_turn_inputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                    torch.ones(2, 1, dtype=torch.bool))
        token_adv, metrics = compute_advantages("test_sign_only", inputs, magnitude=2.0)
        assert token_adv[:, 0].tolist() == [2.0, -2.0] and metrics == {"magnitude": 2.0}
        with pytest.raises(InvalidArgument, match="already registered"):
            register_advantage("test_sign_only")(lambda inputs: None)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_sign_only", None)


def test_registry_has_both_estimators() -> None:
    assert {"grpo", "calibadv"} <= set(ADVANTAGE_ESTIMATORS)


# ---------------------------------------------------------------------------
# Validation: errors name the field
# ---------------------------------------------------------------------------


def _simple(**overrides):
    fields = dict(
        rewards=torch.tensor([1.0, 0.0]),
        group_index=torch.tensor([0, 0]),
        completion_mask=torch.tensor([[True, True, False], [True, False, False]]),
        segment_index=torch.tensor([[0, 0, -1], [0, -1, -1]]),
        answer_mask=torch.tensor([[True, True, False], [True, False, False]]),
    )
    fields.update(overrides)
    return AdvantageInputs(**fields)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(rewards=torch.tensor([1.0, float("nan")])), "rewards"),
        (dict(rewards=torch.tensor([1.0, float("inf")])), "rewards"),
        (dict(rewards=torch.tensor([[1.0, 0.0]])), "rewards"),
        (dict(rewards=torch.tensor([1, 0])), "rewards"),
        (dict(group_index=torch.tensor([0, 0, 1])), "group_index"),
        (dict(group_index=torch.tensor([0.0, 0.0])), "group_index"),
        (dict(completion_mask=torch.ones(3, 3, dtype=torch.bool)), "completion_mask"),
        (dict(completion_mask=torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])), "completion_mask"),
        (dict(completion_mask=torch.tensor([[2, 1, 0], [1, 0, 0]])), "completion_mask"),
        (dict(segment_index=torch.tensor([[0, 0, 0], [0, -1, -1]])), "segment_index"),
        (dict(segment_index=torch.tensor([[0, -1, -1], [0, -1, -1]])), "segment_index"),
        (dict(answer_mask=torch.tensor([[False, True, False], [True, False, False]])), "answer_mask"),
        (dict(step_scores=torch.tensor([[1.5], [0.0]])), "step_scores"),
        (dict(step_scores=torch.tensor([0.5, 0.5])), "step_scores"),
    ],
)
def test_bad_inputs_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        _simple(**overrides)
    assert caught.value.field == field


def test_answer_mask_must_be_the_last_segment() -> None:
    with pytest.raises(InvalidArgument, match="last generated segment") as caught:
        _simple(
            completion_mask=torch.tensor([[True, True, True], [True, False, False]]),
            segment_index=torch.tensor([[0, 1, 1], [0, -1, -1]]),
            answer_mask=torch.tensor([[True, False, False], [True, False, False]]),
        )
    assert caught.value.field == "answer_mask"


def test_step_scores_must_cover_every_intermediate_segment() -> None:
    with pytest.raises(InvalidArgument, match="at least 2") as caught:
        _simple(
            completion_mask=torch.tensor([[True, True, True], [True, False, False]]),
            segment_index=torch.tensor([[0, 1, 2], [0, -1, -1]]),
            answer_mask=torch.tensor([[False, False, True], [True, False, False]]),
            step_scores=torch.tensor([[0.5], [0.5]]),
        )
    assert caught.value.field == "step_scores"


def test_unknown_estimator_and_parameters_are_rejected() -> None:
    inputs = _simple()
    with pytest.raises(InvalidArgument, match="unknown advantage estimator") as caught:
        compute_advantages("ppo", inputs)
    assert caught.value.field == "name"
    with pytest.raises(InvalidArgument) as caught:
        compute_advantages("grpo", inputs, scale_rewards="group")
    assert caught.value.field == "scale_rewards"
    with pytest.raises(InvalidArgument) as caught:
        compute_advantages("grpo", inputs, scale="sequence")
    assert caught.value.field == "scale"
    with pytest.raises(InvalidArgument) as caught:
        compute_advantages("grpo", inputs, eps=-1.0)
    assert caught.value.field == "eps"
