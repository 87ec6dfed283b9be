"""The search agent's collapse signals, logged every step (issue 11, "A study with power"):
``search/*`` (well-formed rate, searches per trajectory, repeated searches) for every
search run, and ``policy/ref_ppl`` (perplexity of the generated tokens under the frozen
reference) whenever a reference is loaded. Hand cases, then real training runs."""

from __future__ import annotations

import math

import pytest
import torch

from calibrl.api.retrieval import Hit, RetrievalScore
from calibrl.trainer.kinds.search.metrics import collapse_metrics, recall_metrics, search_step_metrics
from calibrl.trainer.kinds.rewrite import REWRITE
from calibrl.trainer.kinds.search import SEARCH
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.tasks import Task
from calibrl.trainer.update import reference_perplexity
from tests.test_step_rewards import SEARCH_RUN, _judge_with_step_rubric, searching_policy  # noqa: F401  (fixture)
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)

TASK = Task("t", "search", "Who discovered penicillin?", answers=("Alexander Fleming",))
NO_HITS = RetrievalScore(hits=(), hit=False, all_gold=False, recall=0.0, mrr=0.0, ndcg=0.0, first_gold_rank=0)
# exp of a float64 mean of a few float32 log-probs: relative error below 1e-6.
PPL_TOL = 1e-6


def _rollout(queries, well_formed=True, answer="Fleming"):
    steps = tuple(SearchStepRecord("t", q, NO_HITS) for q in queries)
    return SearchRollout(TASK, steps, answer, well_formed)


def test_search_metrics_on_hand_made_trajectories():
    rollouts = [
        _rollout(["penicillin discovery", "Alexander Fleming mould"]),
        _rollout(["penicillin discovery", "penicillin discovery"], well_formed=False),  # a repeat
        _rollout([], well_formed=False, answer=None),  # answered nothing, searched nothing
        _rollout(["Fleming"]),
    ]
    assert collapse_metrics(rollouts) == pytest.approx({
        "search/well_formed": 2 / 4,
        "search/answered": 3 / 4,
        "search/searches_per_trajectory": 5 / 4,
        "search/repeated_share": 1 / 5,
    }, abs=1e-12)


def test_search_metrics_are_the_search_kinds_and_zero_repeats_without_searches():
    assert REWRITE.step_metrics is None  # a rewrite step logs no search/* metrics
    assert SEARCH.step_metrics is not None
    assert collapse_metrics([]) == {}
    metrics = collapse_metrics([_rollout([], answer="x")])
    assert metrics["search/searches_per_trajectory"] == 0.0 and metrics["search/repeated_share"] == 0.0


def test_reference_perplexity_is_exp_of_minus_the_mean_over_generated_tokens():
    logps = [torch.tensor([[-1.0, -2.0, -50.0]]), torch.tensor([[-3.0, -9.0], [-0.5, -0.5]])]
    masks = [torch.tensor([[True, True, False]]), torch.tensor([[True, False], [True, True]])]
    metrics = reference_perplexity(logps, masks)
    mean = (-1.0 - 2.0 - 3.0 - 0.5 - 0.5) / 5  # the masked tokens (-50, -9) are left out
    assert metrics["policy/ref_logp_mean"] == pytest.approx(mean, abs=1e-12)
    assert metrics["policy/ref_ppl"] == pytest.approx(math.exp(-mean), rel=PPL_TOL)
    # A uniform reference over V tokens has perplexity V.
    uniform = reference_perplexity([torch.full((2, 4), -math.log(7.0))], [torch.ones(2, 4, dtype=torch.bool)])
    assert uniform["policy/ref_ppl"] == pytest.approx(7.0, rel=PPL_TOL)


def test_reference_perplexity_is_absent_without_a_reference_or_a_generated_token():
    assert reference_perplexity([None], [torch.ones(1, 2, dtype=torch.bool)]) == {}
    assert reference_perplexity([], []) == {}
    assert reference_perplexity([torch.zeros(1, 2)], [torch.zeros(1, 2, dtype=torch.bool)]) == {}


def _search_run(world, policy, tmp_path, *extra):
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.loop import train

    retrieval, _ = world.clients(judge=False)
    judge = _judge_with_step_rubric(world, tmp_path)
    config = load_train_config(None, world.overrides(
        tmp_path / "run", f"tasks.path={world.search_tasks}", *SEARCH_RUN, *extra, f"policy.path={policy}"))
    return train(config, retrieval=retrieval, judge=judge).history[0]


def test_a_search_run_without_step_rewards_logs_the_collapse_signals(trainer_world, searching_policy, tmp_path):
    record = _search_run(trainer_world, searching_policy, tmp_path, "loss.beta=0.04")
    assert not any(name.startswith("steps/") for name in record)  # step rewards off
    assert 0.0 <= record["search/well_formed"] <= 1.0 and 0.0 <= record["search/repeated_share"] <= 1.0
    # max_turns=3: at most 2 searches; the taught policy searches in most of its 8 rollouts.
    assert 0.5 <= record["search/searches_per_trajectory"] <= 2.0
    assert record["entropy"] > 0
    # The reference is the policy before its first update: a finite perplexity >= 1.
    assert 1.0 <= record["policy/ref_ppl"] < 1e6
    assert record["policy/ref_ppl"] == pytest.approx(math.exp(-record["policy/ref_logp_mean"]), rel=PPL_TOL)


def test_without_a_reference_no_perplexity_is_logged(trainer_world, searching_policy, tmp_path):
    record = _search_run(trainer_world, searching_policy, tmp_path, "loss.beta=0")
    assert "policy/ref_ppl" not in record and "search/well_formed" in record


def test_the_search_counts_agree_with_the_step_reward_counts(trainer_world, searching_policy, tmp_path):
    record = _search_run(trainer_world, searching_policy, tmp_path, "reward.w_steps=0.5")
    # Both count the same steps with the same repeat test: equal up to float rounding of a ratio.
    assert record["search/searches_per_trajectory"] == pytest.approx(record["steps/searches_per_trajectory"],
                                                                     abs=1e-12)
    assert record["search/repeated_share"] == pytest.approx(record["steps/repeated_share"], abs=1e-12)


def _found(doc_ids):
    hits = tuple(Hit(d, d, 1.0, rank) for rank, d in enumerate(doc_ids, start=1))
    return RetrievalScore(hits=hits, hit=bool(doc_ids), all_gold=False, recall=0.0, mrr=0.0, ndcg=0.0,
                          first_gold_rank=0)


def test_search_recall_per_step_counts_the_bridge_and_the_answer_document_on_hand_made_trajectories():
    two_hop = Task("q", "search", "What does the default fund of plan 4821 hold?", answers=("512",),
                   gold_doc_ids=("bridge", "answer"))
    rollouts = [
        SearchRollout(two_hop, (SearchStepRecord("t", "a", _found(["bridge"])),
                                SearchStepRecord("t", "b", _found(["answer"]))), "512", True),  # both found
        SearchRollout(two_hop, (SearchStepRecord("t", "a", _found(["bridge"])),
                                SearchStepRecord("t", "b", _found(["sibling"]))), "3", True),  # bridge only
        SearchRollout(two_hop, (SearchStepRecord("t", "a", _found(["answer"])),), "512", True),  # answer only
        SearchRollout(two_hop, (), None, False),  # searched nothing
        _rollout(["Fleming"]),  # no gold documents: not counted
    ]
    assert recall_metrics(rollouts) == pytest.approx({
        "search/gold_doc_recall": (1 + 0.5 + 0.5 + 0) / 4,
        "search/first_gold_found": 2 / 4,
        "search/all_gold_found": 1 / 4,
    }, abs=1e-12)
    assert recall_metrics([_rollout(["Fleming"])]) == {}
    assert set(recall_metrics(rollouts)) <= set(search_step_metrics(rollouts, []))
