"""The stages of a step in isolation: scoring hands on a ScoredBatch (or raises), the
advantage stage goes through the registries, the pipeline keeps one batch for the next
step off-policy, and task kinds are a registry."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from calibrl.errors import ConfigError, RewardError
from calibrl.api.retrieval import Hit, RetrievalScore
from calibrl.trainer.config import CalibAdvAdvantage, GrpoAdvantage
from calibrl.trainer.pipeline import RolloutPipeline
from calibrl.trainer.rewards import RewardBreakdown
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.rollout import RolloutBatch, assemble_rows
from calibrl.trainer.scoring import PendingBatch
from calibrl.trainer.task_kinds import TASK_KINDS, TaskKind, register_task_kind, task_kind
from calibrl.trainer.tasks import Task
from calibrl.trainer.training_batch import to_training_batch


def _done(value):
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _failed(exc):
    future = concurrent.futures.Future()
    future.set_exception(exc)
    return future


def _search_batch() -> RolloutBatch:
    """Four search rollouts of one task: two steps then an answer each."""
    def step(think, *doc_ids):
        hits = tuple(Hit(d, d, 1.0, i + 1) for i, d in enumerate(doc_ids))
        score = RetrievalScore(hits=hits, hit=False, all_gold=False, recall=0.0, mrr=0.0, ndcg=0.0, first_gold_rank=0)
        return SearchStepRecord(think=think, query=think, result=score)

    task = Task("t", "search", "q?", gold_doc_ids=("g",), answers=("paris",))
    rollouts = [
        SearchRollout(task, (step("find the city", "a", "s1"), step("find the country", "s2", "b")), "paris", True),
        SearchRollout(task, (step("look up a tower", "s1", "x"), step("check a river", "y", "z")), "rome", True),
        SearchRollout(task, (step("alpha beta", "x", "y"), step("gamma delta", "s2", "w")), "rome", True),
        SearchRollout(task, (step("one two", "q"), step("three four", "r")), "berlin", True),
    ]
    rows = [[([1, 2], False), ([3, 4], True), ([5], False), ([6, 7], True), ([8], False), ([9], True)]] * 4
    return RolloutBatch(**assemble_rows(rows, pad_id=0), group_index=torch.zeros(4, dtype=torch.long),
                        completion_texts=[""] * 4, rollouts=rollouts)


def test_scoring_hands_on_the_rewards_in_chunk_order_or_raises():
    batch = _search_batch()
    chunks = [_done([RewardBreakdown(1.0), RewardBreakdown(0.0)]), _done([RewardBreakdown(0.5), RewardBreakdown(0.25)])]
    scored = PendingBatch(3, batch, chunks, {"epoch": 0, "offset": 4}).scored()
    assert scored.step == 3 and scored.rewards.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert scored.rewards.dtype == torch.float32
    failing = PendingBatch(3, batch, [_done([RewardBreakdown(1.0)] * 2), _failed(RewardError("judge down"))], {})
    with pytest.raises(RewardError, match="judge down"):
        failing.scored()
    assert failing.breakdowns is None  # nothing half-scored is kept


def test_the_advantage_stage_goes_through_the_registry():
    batch = _search_batch()
    rewards = [RewardBreakdown(1.0), RewardBreakdown(0.0), RewardBreakdown(0.0), RewardBreakdown(0.5)]
    scored = PendingBatch(1, batch, [_done(rewards)], {}).scored()
    grpo = to_training_batch(scored, GrpoAdvantage())
    calibadv = to_training_batch(scored, CalibAdvAdvantage())
    assert grpo.token_adv.shape == calibadv.token_adv.shape == batch.input_ids.shape
    assert bool((grpo.token_adv[~batch.completion_mask] == 0).all())
    assert "calibadv/mean_step_score" not in grpo.metrics  # grpo reads no step scores
    assert 0.0 <= calibadv.metrics["calibadv/mean_step_score"] <= 1.0
    # Rollout 1 (reward 0, A < 0) found silver doc s1 in its first step: that step's
    # tokens are softened, so CalibAdv's advantages differ from the plain base advantage.
    first_step = batch.segment_index[1] == 0
    assert bool((calibadv.token_adv[1][first_step] > calibadv.token_adv[2][first_step]).all())
    # frac_reward_zero_std counts groups: one group with distinct rewards -> 0.
    assert grpo.metrics["frac_reward_zero_std"] == 0.0


class _Sampler:
    def __init__(self):
        self.sampled = []

    def sample(self, step):
        self.sampled.append(step)
        return PendingBatch(step, None, [], {"step": step})


def test_off_policy_pipeline_samples_the_next_step_ahead():
    sampler = _Sampler()
    pipeline = RolloutPipeline(sampler, off_policy_steps=1, last_step=3)
    first = pipeline.take(1)
    assert (first.current.step, first.upcoming.step, first.failure) == (1, 2, None)
    pipeline.keep(first.upcoming)
    second = pipeline.take(2)
    assert second.current is first.upcoming and second.upcoming.step == 3
    pipeline.keep(second.upcoming)
    last = pipeline.take(3)
    assert last.upcoming is None  # nothing is sampled past the last step
    assert sampler.sampled == [1, 2, 3]
    on_policy = RolloutPipeline(_Sampler(), off_policy_steps=0, last_step=3)
    taken = on_policy.take(1)
    assert taken.upcoming is None and on_policy.sampler.sampled == [1]


def test_a_sampling_failure_is_reported_not_raised():
    class Failing:
        def sample(self, step):
            raise RewardError("retrieval down")

    taken = RolloutPipeline(Failing(), off_policy_steps=0, last_step=2).take(1)
    assert taken.current is None and "retrieval down" in str(taken.failure)


def test_task_kinds_are_a_registry():
    assert set(TASK_KINDS) >= {"rewrite", "search"}
    assert task_kind("search").max_completion_tokens(type("R", (), {"max_new_tokens": 8, "max_turns": 3})()) == 24
    assert task_kind("rewrite").max_completion_tokens(type("R", (), {"max_new_tokens": 8, "max_turns": 3})()) == 8
    with pytest.raises(ConfigError, match="expected one of"):
        task_kind("translate")
    third = TaskKind("classify", "Label: {query}", rollout=None, score=None, evaluate=None,
                     metric_names=("accuracy",), max_completion_tokens=lambda rollout: 1)
    try:
        register_task_kind(third)
        assert task_kind("classify") is third
        from calibrl.trainer.config import RolloutConfig

        assert RolloutConfig().template_for("classify") == "Label: {query}"
        with pytest.raises(ConfigError, match="already registered"):
            register_task_kind(TaskKind("classify", "", None, None, None, (), lambda rollout: 1))
    finally:
        TASK_KINDS.pop("classify", None)
    assert "classify" not in TASK_KINDS
