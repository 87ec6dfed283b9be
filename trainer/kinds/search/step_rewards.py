"""Per-step dense rewards of a search agent: every search step scored by both services.

A search step ``k`` of a trajectory gets::

    r(k) = step_w_retrieval * r_ret(k) + step_w_rubric * r_rub(k)     (defaults 0.7 / 0.3)

``r_ret(k)`` comes from the retrieval signals computed during the rollout
(``SearchStepRecord.result``): ``0.5 * found_new + 0.5 * rr``, where ``found_new``
is 1 when the step retrieved a relevant document no earlier step of the
trajectory had retrieved (``is_new`` and relevant) and ``rr`` is the reciprocal
rank of the first relevant document (the server's MRR, ``1 / first_gold_rank``).
Relevant means gold (``is_gold``) when the task has gold documents; a task
without gold documents uses silver ones: those that contain a gold answer
(``contains_answer``).

``r_rub(k)`` is the judge's total under the search-query rubric
(``reward.step_rubric_id``, ``configs/rubrics/search-steps.yaml``) of the item
:func:`step_judge_item` builds: query = the question, output = the step's search
query, retrieved texts = the previous step's passages (none for the first step),
context ``earlier_queries`` = the trajectory's earlier queries, one a line.

How step rewards enter training (``calibrl.trainer.kinds.search.reward``,
``calibrl.trainer.advantages``): ``reward.w_steps`` adds ``w_steps x mean_k r(k)``
to the trajectory reward; ``advantage.step_credit`` gives the tokens of step k
the advantage of r(k) against the group's step-k rewards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from calibrl.entities import EARLIER_QUERIES_KEY, repeats_earlier
from calibrl.api.judge import JudgeItem
from calibrl.trainer.rewards import StepReward

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.api.retrieval import RetrievalScore
    from calibrl.trainer.kinds.search.records import SearchRollout
    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.tasks import Task

# Passages of the previous observation sent with a step's judge item (the observation holds top_k of them).
STEP_JUDGE_MAX_PASSAGES = 10
STEP_JUDGE_MAX_PASSAGE_CHARS = 4000


def relevant_flags(result: "RetrievalScore", task: "Task") -> list[bool]:
    """Per hit: gold when the task has gold documents, else silver (contains a gold answer)."""
    flags = result.is_gold if task.gold_doc_ids else result.contains_answer
    return [bool(flags[i]) if i < len(flags) else False for i in range(len(result.hits))]


def step_retrieval_signal(result: "RetrievalScore", task: "Task") -> tuple[float, bool]:
    """``(r_ret, found_new)`` of one step (see the module docstring)."""
    relevant = relevant_flags(result, task)
    new = [bool(result.is_new[i]) if i < len(result.is_new) else True for i in range(len(result.hits))]
    found_new = any(r and n for r, n in zip(relevant, new))
    if task.gold_doc_ids:
        rr = 1.0 / result.first_gold_rank if result.first_gold_rank > 0 else 0.0
    else:
        rr = next((1.0 / (rank + 1) for rank, r in enumerate(relevant) if r), 0.0)
    return 0.5 * float(found_new) + 0.5 * rr, found_new


def step_judge_item(rollout: "SearchRollout", k: int, max_query_chars: int) -> JudgeItem:
    """The judge item of step ``k`` of ``rollout`` (see the module docstring)."""
    previous = rollout.steps[k - 1].result.hits[:STEP_JUDGE_MAX_PASSAGES] if k > 0 else ()
    earlier = [step.query.strip()[:max_query_chars] for step in rollout.steps[:k]]
    return JudgeItem(
        query=rollout.task.query,
        output=rollout.steps[k].query.strip()[:max_query_chars],
        retrieved_texts=tuple(hit.text[:STEP_JUDGE_MAX_PASSAGE_CHARS] for hit in previous),
        retrieved_doc_ids=tuple(hit.doc_id for hit in previous),
        context=((EARLIER_QUERIES_KEY, "\n".join(earlier)),) if earlier else (),
    )


def step_rewards(rollout: "SearchRollout", rubric_totals: Sequence[float], w_retrieval: float,
                 w_rubric: float) -> tuple[StepReward, ...]:
    """The step rewards of one trajectory; ``rubric_totals`` has one judge total per step
    (zeros when the rubric is not used)."""
    rewards = []
    for k, step in enumerate(rollout.steps):
        retrieval, found_new = step_retrieval_signal(step.result, rollout.task)
        rubric = float(rubric_totals[k])
        earlier = [s.query for s in rollout.steps[:k]]
        rewards.append(StepReward(
            reward=w_retrieval * retrieval + w_rubric * rubric,
            retrieval=retrieval,
            rubric=rubric,
            found_new=found_new,
            repeated=repeats_earlier(step.query, earlier),
        ))
    return tuple(rewards)


def mean_step_reward(steps: Sequence[StepReward]) -> float:
    """The mean step reward of a trajectory; 0 for a trajectory that never searched."""
    return sum(s.reward for s in steps) / len(steps) if steps else 0.0


def step_reward_metrics(breakdowns: Sequence["RewardBreakdown"]) -> dict[str, float]:
    """``steps/*`` metrics of a batch whose step rewards were computed (empty otherwise):
    mean step reward, searches per trajectory, share of repeated searches, share of
    searches that found a new relevant document."""
    if not any(b.steps_scored for b in breakdowns):
        return {}
    steps = [s for b in breakdowns for s in b.steps]
    count = len(steps)
    return {
        "steps/reward/mean": sum(s.reward for s in steps) / count if count else 0.0,
        "steps/searches_per_trajectory": count / len(breakdowns),
        "steps/repeated_share": sum(s.repeated for s in steps) / count if count else 0.0,
        "steps/new_gold_share": sum(s.found_new for s in steps) / count if count else 0.0,
    }


__all__ = ["StepReward", "mean_step_reward", "step_judge_item", "step_retrieval_signal", "step_reward_metrics",
           "step_rewards"]
