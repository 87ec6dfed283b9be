"""CalibAdv: the signals (silver documents, step scores, word edit similarity)
and the ``calibadv`` estimator, against a plain-loop reference and
hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrl.errors import InvalidArgument
from tests.test_advantages import group_stats, random_batch
from calibrl.trainer.advantages import AdvantageInputs, compute_advantages
from calibrl.trainer.calibadv import SearchStep, select_silver_docs, step_scores, word_edit_similarity

# ---------------------------------------------------------------------------
# word_edit_similarity
# ---------------------------------------------------------------------------


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

def test_word_edit_similarity_hand_cases() -> None:
    assert word_edit_similarity("", "") == 1.0
    assert word_edit_similarity("  ", "") == 1.0
    assert word_edit_similarity("who founded acme", "who founded acme") == 1.0
    assert word_edit_similarity("a b c", "a b d") == pytest.approx(2 / 3)  # one substitution
    assert word_edit_similarity("a b c d", "a c d") == pytest.approx(3 / 4)  # one deletion
    assert word_edit_similarity("a b", "") == 0.0
    assert word_edit_similarity("x y z", "p q r") == 0.0
    # Words, not characters: "founder" and "founded" are simply different words.
    assert word_edit_similarity("acme founder", "acme founded") == pytest.approx(0.5)


def _brute_distance(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    if not a or not b:
        return len(a) + len(b)
    return min(_brute_distance(a[1:], b) + 1, _brute_distance(a, b[1:]) + 1,
               _brute_distance(a[1:], b[1:]) + (a[0] != b[0]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from("abcd"), max_size=6), st.lists(st.sampled_from("abcd"), max_size=6))
def test_word_edit_similarity_matches_brute_force(a: list[str], b: list[str]) -> None:
    expected = 1.0 if not a and not b else 1 - _brute_distance(tuple(a), tuple(b)) / max(len(a), len(b))
    assert word_edit_similarity(" ".join(a), " ".join(b)) == pytest.approx(expected)
    assert word_edit_similarity(" ".join(a), " ".join(b)) == word_edit_similarity(" ".join(b), " ".join(a))


# ---------------------------------------------------------------------------
# select_silver_docs
# ---------------------------------------------------------------------------

STEPS = [
    [SearchStep("find the founder", ("d1", "d2")), SearchStep("find the birthplace", ("d3",))],
    [SearchStep("search acme", ("d4",))],
    [SearchStep("look up acme founder", ("d5", "d1"))],
]


def test_silver_docs_come_from_every_rollout_at_the_best_f1() -> None:
    assert select_silver_docs([0.8, 0.3, 0.8], STEPS) == {"d1", "d2", "d3", "d5"}
    assert select_silver_docs([0.9, 0.3, 0.8], STEPS) == {"d1", "d2", "d3"}


def test_no_silver_docs_below_the_f1_threshold() -> None:
    assert select_silver_docs([0.69, 0.3, 0.5], STEPS) == set()
    assert select_silver_docs([0.7, 0.3, 0.5], STEPS) == {"d1", "d2", "d3"}  # the threshold is inclusive
    assert select_silver_docs([0.5, 0.3, 0.5], STEPS, f1_threshold=0.5) == {"d1", "d2", "d3", "d5"}
    assert select_silver_docs([], []) == set()


def test_gold_docs_serve_instead_when_asked_and_given() -> None:
    assert select_silver_docs([0.9, 0.3, 0.8], STEPS, gold_doc_ids=["g1", "d4"], use_gold=True) == {"g1", "d4"}
    assert select_silver_docs([0.9, 0.3, 0.8], STEPS, gold_doc_ids=["g1"], use_gold=False) == {"d1", "d2", "d3"}
    # Asked for gold but the task has none: fall back to the rollouts' silver docs.
    assert select_silver_docs([0.9, 0.3, 0.8], STEPS, gold_doc_ids=None, use_gold=True) == {"d1", "d2", "d3"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(rewards=[0.5, 0.5], steps=STEPS), "steps"),
        (dict(rewards=[0.5, 1.2, 0.1], steps=STEPS), "rewards"),
        (dict(rewards=[0.5, float("nan"), 0.1], steps=STEPS), "rewards"),
        (dict(rewards=[0.5, 0.5, 0.1], steps=STEPS, f1_threshold=1.5), "f1_threshold"),
    ],
)
def test_silver_doc_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        select_silver_docs(**kwargs)
    assert caught.value.field == field


# ---------------------------------------------------------------------------
# step_scores
# ---------------------------------------------------------------------------


def test_step_score_counts_silver_docs_first_seen_in_the_step() -> None:
    steps = [
        SearchStep("who founded acme", ("s1", "x1", "s2", "x2")),   # 2 silver of 4
        SearchStep("where was she born", ("s1", "s3", "x3")),       # s1 seen before: 1 new silver of 3
        SearchStep("what year did it happen", ("x4", "x5")),        # no silver
    ]
    assert step_scores(steps, {"s1", "s2", "s3"}, well_formed=True) == pytest.approx([0.5, 1 / 3, 0.0])


def test_step_repeating_more_than_one_earlier_doc_scores_zero() -> None:
    steps = [
        SearchStep("who founded acme", ("s1", "s2", "x1")),
        SearchStep("acme company origin story", ("s1", "s2", "s3")),  # two docs already retrieved -> repeat
        SearchStep("the founder's hometown", ("x1", "s4")),           # one repeated doc is allowed
    ]
    assert step_scores(steps, {"s1", "s2", "s3", "s4"}, well_formed=True) == pytest.approx([2 / 3, 0.0, 0.5])
    # The limit is a parameter.
    assert step_scores(steps, {"s1", "s2", "s3", "s4"}, True, max_shared_docs=2)[1] == pytest.approx(1 / 3)


def test_step_repeating_an_earlier_think_scores_zero() -> None:
    steps = [
        SearchStep("i need the founder of acme corp", ("s1",)),
        SearchStep("i need the founder of acme inc", ("s2",)),  # 6 of 7 words shared: similarity 6/7 > 0.5
        SearchStep("now the birthplace of the founder", ("s3",)),
    ]
    assert step_scores(steps, {"s1", "s2", "s3"}, well_formed=True) == pytest.approx([1.0, 0.0, 1.0])


def test_think_similarity_must_be_strictly_above_the_threshold() -> None:
    steps = [SearchStep("a b c d", ("s1",)), SearchStep("a b x y", ("s2",))]  # similarity exactly 0.5
    assert step_scores(steps, {"s1", "s2"}, well_formed=True) == [1.0, 1.0]
    assert step_scores(steps, {"s1", "s2"}, well_formed=True, similarity_threshold=0.4) == [1.0, 0.0]


def test_empty_thinks_are_not_a_repetition_but_their_docs_still_are() -> None:
    steps = [SearchStep("", ("s1", "s2")), SearchStep("", ("s3",)), SearchStep("", ("s1", "s2", "s4"))]
    assert step_scores(steps, {"s1", "s2", "s3", "s4"}, well_formed=True) == pytest.approx([1.0, 1.0, 0.0])


def test_step_without_docs_and_malformed_trajectory_score_zero() -> None:
    steps = [SearchStep("search nothing", ()), SearchStep("search acme", ("s1",))]
    assert step_scores(steps, {"s1"}, well_formed=True) == [0.0, 1.0]
    assert step_scores(steps, {"s1"}, well_formed=False) == [0.0, 0.0]
    assert step_scores([], {"s1"}, well_formed=True) == []


def test_duplicate_doc_within_a_step_counts_once() -> None:
    assert step_scores([SearchStep("q", ("s1", "s1", "x1", "x2"))], {"s1"}, True) == [0.25]


def test_step_score_parameter_errors_name_the_field() -> None:
    with pytest.raises(InvalidArgument) as caught:
        step_scores([], set(), True, similarity_threshold=1.5)
    assert caught.value.field == "similarity_threshold"
    with pytest.raises(InvalidArgument) as caught:
        step_scores([], set(), True, max_shared_docs=-1)
    assert caught.value.field == "max_shared_docs"


# ---------------------------------------------------------------------------
# calibadv estimator: plain-loop reference
# ---------------------------------------------------------------------------


def reference_calibadv(inputs: AdvantageInputs, lambda_: float = 1.0, eps: float = 1e-6) -> list[list[float]]:
    rewards = [float(r) for r in inputs.rewards]
    groups = [int(g) for g in inputs.group_index]
    stats = group_stats(rewards, groups)
    batch, width = inputs.completion_mask.shape
    base = [(rewards[i] - stats[groups[i]][0]) / (stats[groups[i]][1] + eps) for i in range(batch)]
    adv = [[0.0] * width for _ in range(batch)]
    for i in range(batch):
        for t in range(width):
            if not bool(inputs.completion_mask[i, t]):
                continue
            if bool(inputs.answer_mask[i, t]) or base[i] >= 0:
                adv[i][t] = base[i]
            else:
                score = float(inputs.step_scores[i, int(inputs.segment_index[i, t])])
                score = 0.0 if math.isnan(score) else score
                adv[i][t] = base[i] * (1 - score)
    for group in set(groups):
        answer_tokens = [(i, t) for i in range(batch) if groups[i] == group for t in range(width)
                         if bool(inputs.answer_mask[i, t])]
        positive = sum(adv[i][t] for i, t in answer_tokens if adv[i][t] > 0)
        negative = sum(-adv[i][t] for i, t in answer_tokens if adv[i][t] < 0)
        for i, t in answer_tokens:
            if positive == 0 or negative == 0:
                adv[i][t] = 0.0
            elif adv[i][t] > 0:
                adv[i][t] *= negative / (lambda_ * positive)
    return adv


@pytest.mark.parametrize("lambda_", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("seed", range(12))
def test_calibadv_matches_loop_reference(seed: int, lambda_: float) -> None:
    inputs = random_batch(seed, max_segments=4, with_scores=True)
    snapshot = [t.clone() for t in (inputs.rewards, inputs.completion_mask, inputs.segment_index,
                                    inputs.answer_mask, inputs.step_scores)]
    token_adv, _ = compute_advantages("calibadv", inputs, lambda_=lambda_)
    expected = torch.tensor(reference_calibadv(inputs, lambda_), dtype=torch.float64)
    # float32 group statistics of <= 8 rewards, a soften factor and the rebalance ratio N / (lambda P)
    # over a group's answer tokens, against a float64 loop: float32_sum_error(8, 8) ~ 7e-6 dominates.
    torch.testing.assert_close(token_adv.double(), expected, atol=1e-5, rtol=1e-6)
    assert bool((token_adv[~inputs.completion_mask] == 0).all())
    after = (inputs.rewards, inputs.completion_mask, inputs.segment_index, inputs.answer_mask, inputs.step_scores)
    for before, now in zip(snapshot, after):
        torch.testing.assert_close(now, before, rtol=0, atol=0, equal_nan=True)  # inputs are not modified


# ---------------------------------------------------------------------------
# calibadv estimator: hand-computed cases
# ---------------------------------------------------------------------------

# Two rollouts of one task, positions: [seg 0, seg 0, observation, seg 1 (answer), pad].
MASK = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
SEGMENTS = torch.tensor([[0, 0, -1, 1, -1], [0, 0, -1, 1, 1]])
ANSWER = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
A = 0.5 / (math.sqrt(0.5) + 1e-6)  # |base advantage| of rewards (1, 0)
# Hand-built groups of 2 rewards: float32 mean / std / soften / rebalance round a few times on values
# |A| <= 2 * 0.71 (u = 6e-8 each): 1e-6 is ~16 u of them; a wrong rule is off by >= 0.1 * A.
ATOL_SMALL_GROUP = 1e-6


def _two_rollouts(rewards, scores, mask=MASK, segments=SEGMENTS, answer=ANSWER, groups=(0, 0)) -> AdvantageInputs:
    return AdvantageInputs(torch.tensor(rewards), torch.tensor(groups), mask, segments, answer,
                           torch.tensor(scores, dtype=torch.float32))


def test_no_silver_docs_keeps_the_full_negative_advantage_and_rebalances_the_answer() -> None:
    token_adv, metrics = compute_advantages("calibadv", _two_rollouts([1.0, 0.0], [[0.0, 0.0], [0.0, 0.0]]))
    # Answer tokens: P = A (one token), N = 2A (two tokens) -> positives scaled by N / P = 2.
    expected = [[A, A, 0, 2 * A, 0], [-A, -A, 0, -A, -A]]
    torch.testing.assert_close(token_adv.double(), torch.tensor(expected, dtype=torch.float64), atol=ATOL_SMALL_GROUP,
                               rtol=0)
    assert metrics["calibadv/frac_tokens_softened"] == 0.0
    assert metrics["calibadv/rebalance_factor"] == pytest.approx(2.0)
    assert metrics["calibadv/frac_groups_answer_zeroed"] == 0.0


def test_soft_penalty_scales_negative_intermediate_steps_only() -> None:
    token_adv, metrics = compute_advantages("calibadv", _two_rollouts([1.0, 0.0], [[0.5, 0.0], [0.75, 0.0]]))
    # Positive rollout unchanged by its step score; negative one gets A * (1 - 0.75) on segment 0.
    expected = [[A, A, 0, 2 * A, 0], [-0.25 * A, -0.25 * A, 0, -A, -A]]
    torch.testing.assert_close(token_adv.double(), torch.tensor(expected, dtype=torch.float64), atol=ATOL_SMALL_GROUP,
                               rtol=0)
    assert metrics["calibadv/frac_tokens_softened"] == pytest.approx(2 / 7)


def test_lambda_divides_the_rebalanced_positive_answer() -> None:
    token_adv, metrics = compute_advantages("calibadv", _two_rollouts([1.0, 0.0], [[0.0, 0.0], [0.0, 0.0]]),
                                            lambda_=2.0)
    assert float(token_adv[0, 3]) == pytest.approx(A)  # N / (lambda * P) = 2A / (2 * A) = 1
    assert metrics["calibadv/rebalance_factor"] == pytest.approx(1.0)


def test_a_rollout_without_step_scores_gets_the_full_negative_advantage() -> None:
    nan = float("nan")
    token_adv, _ = compute_advantages("calibadv", _two_rollouts([1.0, 0.0], [[0.5, 0.5], [nan, nan]]))
    assert token_adv[1, :2].tolist() == pytest.approx([-A, -A])


def test_all_equal_rewards_give_zero_everywhere() -> None:
    token_adv, metrics = compute_advantages("calibadv", _two_rollouts([0.4, 0.4], [[0.5, 0.0], [0.5, 0.0]]))
    assert bool((token_adv == 0).all())
    assert metrics["frac_reward_zero_std"] == 1.0
    # the group's answers are zero because its rewards are equal, not because of the rebalance
    assert metrics["calibadv/frac_groups_answer_zeroed"] == 0.0
    assert math.isnan(metrics["calibadv/rebalance_factor"])


def test_no_positive_answer_tokens_zeroes_the_group_answers() -> None:
    # The positive rollout has no trained token (e.g. truncated away): P == 0.
    mask = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    segments = torch.where(mask, SEGMENTS, -1)
    answer = mask & ANSWER
    token_adv, metrics = compute_advantages(
        "calibadv", _two_rollouts([1.0, 0.0], [[0.0, 0.0], [0.5, 0.0]], mask, segments, answer))
    expected = [[0, 0, 0, 0, 0], [-0.5 * A, -0.5 * A, 0, 0, 0]]  # answers zeroed, soft penalty kept
    torch.testing.assert_close(token_adv.double(), torch.tensor(expected, dtype=torch.float64), atol=ATOL_SMALL_GROUP,
                               rtol=0)
    assert metrics["calibadv/frac_groups_answer_zeroed"] == 1.0


def test_no_negative_answer_tokens_zeroes_the_group_answers() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    segments = torch.where(mask, SEGMENTS, -1)
    answer = mask & ANSWER
    token_adv, _ = compute_advantages(
        "calibadv", _two_rollouts([1.0, 0.0], [[0.0, 0.0], [0.0, 0.0]], mask, segments, answer))
    expected = [[A, A, 0, 0, 0], [0, 0, 0, 0, 0]]
    torch.testing.assert_close(token_adv.double(), torch.tensor(expected, dtype=torch.float64), atol=ATOL_SMALL_GROUP,
                               rtol=0)


def test_groups_are_rebalanced_separately() -> None:
    # Group 1 is the two-rollout case above; group 2 has equal answer lengths (factor 1).
    mask = torch.cat([MASK, MASK[:1], MASK[:1]])
    segments = torch.cat([SEGMENTS, SEGMENTS[:1], SEGMENTS[:1]])
    answer = torch.cat([ANSWER, ANSWER[:1], ANSWER[:1]])
    inputs = AdvantageInputs(torch.tensor([1.0, 0.0, 0.3, 0.1]), torch.tensor([1, 1, 2, 2]), mask, segments,
                             answer, torch.zeros(4, 2))
    token_adv, metrics = compute_advantages("calibadv", inputs)
    assert float(token_adv[0, 3]) == pytest.approx(2 * A)
    # (0.3 - 0.2) / std of two float32 rewards: 0.3 - 0.2 cancels to 0.1 with the float32 rounding of 0.3
    # and 0.1 (each 0.5 ulp of ~0.3, i.e. ~3e-8 absolute, ~3e-7 relative to 0.1): rel 1e-5 bounds it.
    assert float(token_adv[2, 3]) == pytest.approx(0.1 / (math.sqrt(0.02) + 1e-6), rel=1e-5)
    assert metrics["calibadv/rebalance_factor"] == pytest.approx(1.5)


def test_calibadv_requires_step_scores_and_a_positive_lambda() -> None:
    inputs = random_batch(0)
    with pytest.raises(InvalidArgument) as caught:
        compute_advantages("calibadv", inputs)
    assert caught.value.field == "step_scores"
    with pytest.raises(InvalidArgument) as caught:
        compute_advantages("calibadv", random_batch(0, with_scores=True), lambda_=0.0)
    assert caught.value.field == "lambda_"


# ---------------------------------------------------------------------------
# From search steps to token advantages
# ---------------------------------------------------------------------------


def test_signals_feed_the_estimator_end_to_end() -> None:
    """Three rollouts of one question: the best (F1 1.0) defines the silver docs,
    a failed rollout that found one of them in its first step is softened there."""
    rollouts = [
        [SearchStep("who founded acme", ("s1", "s2")), SearchStep("where was alice born", ("s3",))],
        [SearchStep("acme founder name", ("s1", "x1")), SearchStep("alice birthplace", ("x2",))],
        [SearchStep("weather today", ("x3",)), SearchStep("weather today please", ("x3",))],
    ]
    answer_f1 = [1.0, 0.0, 0.0]
    silver = select_silver_docs(answer_f1, rollouts)
    assert silver == {"s1", "s2", "s3"}
    scores = [step_scores(steps, silver, well_formed=True) for steps in rollouts]
    assert scores == [[1.0, 1.0], [0.5, 0.0], [0.0, 0.0]]

    # Token layout of each rollout: [step 0 x2][obs][step 1 x2][obs][answer x1].
    row_mask = torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    row_segments = torch.tensor([0, 0, -1, 1, 1, -1, 2])
    inputs = AdvantageInputs(
        rewards=torch.tensor(answer_f1), group_index=torch.tensor([0, 0, 0]),
        completion_mask=row_mask.repeat(3, 1), segment_index=row_segments.repeat(3, 1),
        answer_mask=(row_segments == 2).repeat(3, 1),
        step_scores=torch.tensor([s + [0.0] for s in scores]),
    )
    token_adv, _ = compute_advantages("calibadv", inputs)
    negative = -(1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    assert token_adv[1].tolist() == pytest.approx([0.5 * negative] * 2 + [0, negative, negative, 0, negative])
    assert token_adv[2].tolist() == pytest.approx([negative] * 2 + [0, negative, negative, 0, negative])
    # Answers: P = 2|n| (one positive rollout) = N (two negative ones), so the factor is 1.
    assert float(token_adv[0, 6]) == pytest.approx(-2 * negative)


# ---------------------------------------------------------------------------
# A failed trajectory whose first search found the gold document: what each estimator does
# ---------------------------------------------------------------------------


def _good_search_group() -> AdvantageInputs:
    """Four rollouts of one question, 3 tokens per segment: [search 0][search 1][answer].
    Rollout 0 succeeds (reward 1); rollout 1 fails (reward 0) although its first search found
    the gold document (step score 1.0) and its second found a new silver one (0.5); rollouts
    2 and 3 fail with useless searches (score 0)."""
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2]] * 4)
    mask = torch.ones(4, 9, dtype=torch.bool)
    return AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_index=torch.zeros(4, dtype=torch.long),
        completion_mask=mask, segment_index=segments, answer_mask=segments == 2,
        step_scores=torch.tensor([[1.0, 1.0, math.nan], [1.0, 0.5, math.nan], [0.0, 0.0, math.nan],
                                  [0.0, 0.0, math.nan]]),
        step_found_gold=torch.tensor([[1.0, 1.0, math.nan], [1.0, 0.0, math.nan], [0.0, 0.0, math.nan],
                                      [0.0, 0.0, math.nan]]))


def test_calibadv_spares_the_good_search_of_a_failed_trajectory_that_grpo_punishes() -> None:
    inputs = _good_search_group()
    grpo, _ = compute_advantages("grpo", inputs, scale="group")
    calib, metrics = compute_advantages("calibadv", inputs)
    # Rewards 1, 0, 0, 0: mean 0.25, unbiased std 0.5. GRPO (eps 1e-4): every token of rollout 1
    # gets (0 - 0.25) / (0.5 + 1e-4), its good first search included.
    grpo_failed = -0.25 / (0.5 + 1e-4)
    assert torch.allclose(grpo[1], torch.full((9,), grpo_failed), rtol=0, atol=1e-7)  # float32 rounding
    # CalibAdv (eps 1e-6): A = -0.25 / (0.5 + 1e-6); search 0 (score 1) -> A * 0 = 0, search 1
    # (score 0.5) -> A * 0.5, the answer keeps A.
    a_failed = -0.25 / (0.5 + 1e-6)
    assert calib[1, :3].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(calib[1, 3:6], torch.full((3,), 0.5 * a_failed), rtol=0, atol=1e-7)
    assert torch.allclose(calib[1, 6:], torch.full((3,), a_failed), rtol=0, atol=1e-7)
    # useless searches of failed rollouts keep the full negative advantage under both
    assert torch.allclose(calib[2, :6], torch.full((6,), a_failed), rtol=0, atol=1e-7)
    # the answers are rebalanced: P = 3 * 0.75 / (0.5 + 1e-6) and N = 3 * 3 * 0.25 / (0.5 + 1e-6) are
    # equal (every answer has 3 tokens), so the factor N / P is 1 and the successful rollout keeps A
    a_success = 0.75 / (0.5 + 1e-6)
    assert metrics["calibadv/rebalance_factor"] == pytest.approx(1.0)
    assert torch.allclose(calib[0], torch.full((9,), a_success), rtol=0, atol=1e-6)
    # the interventions, counted: rollouts 1-3 have 6 negative search steps (what GRPO punishes in
    # full); CalibAdv softened 2 of them, both in rollout 1; 1 of the 6 (and 1 of the 2) found gold
    assert metrics["calibadv/neg_search_steps"] == 6.0
    assert metrics["calibadv/frac_neg_search_steps_softened"] == pytest.approx(2 / 6)
    assert metrics["calibadv/frac_neg_search_steps_found_gold"] == pytest.approx(1 / 6)
    assert metrics["calibadv/frac_softened_found_gold"] == pytest.approx(1 / 2)
    # mean change against A over the 24 search tokens: +|a| on 3 tokens, +|a|/2 on 3
    assert metrics["calibadv/adv_change_search"] == pytest.approx((3 + 1.5) * -a_failed / 24)
    # no answer token changes (factor 1); float32 rounding of the factor leaves < 1e-6
    assert abs(metrics["calibadv/adv_change_answer"]) < 1e-6
    # the group has unequal rewards, a positive and negative answers: nothing zeroed
    assert metrics["calibadv/frac_groups_answer_zeroed"] == 0.0


def test_answer_zeroed_counts_only_groups_with_a_learning_signal() -> None:
    """All-equal groups have zero advantages whatever the rebalance does: they are not counted."""
    inputs = _good_search_group()
    equal = AdvantageInputs(rewards=torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
                            group_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
                            completion_mask=torch.cat([inputs.completion_mask] * 2),
                            segment_index=torch.cat([inputs.segment_index] * 2),
                            answer_mask=torch.cat([inputs.answer_mask] * 2),
                            step_scores=torch.cat([inputs.step_scores] * 2))
    _, metrics = compute_advantages("calibadv", equal)
    assert metrics["calibadv/frac_groups_answer_zeroed"] == 0.0
    assert "calibadv/frac_neg_search_steps_found_gold" not in metrics  # no gold labels given
    with pytest.raises(InvalidArgument, match="step_found_gold"):
        AdvantageInputs(rewards=inputs.rewards, group_index=inputs.group_index,
                        completion_mask=inputs.completion_mask, segment_index=inputs.segment_index,
                        answer_mask=inputs.answer_mask, step_found_gold=torch.full((4, 3), 0.5))
