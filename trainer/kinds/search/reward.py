"""The search agent's reward (the formula is in :mod:`calibrl.trainer.rewards`): the answer
score times the format, the per-step retrieval signals recorded by the rollout, the rubric of the
final answer and, when on, the per-step dense rewards of :mod:`.step_rewards`."""

from __future__ import annotations

from typing import Sequence

from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.text import exact_match, token_f1
from calibrl.trainer.aio import gather_all
from calibrl.trainer.kinds.search.records import SearchRollout
from calibrl.trainer.kinds.search.step_rewards import mean_step_reward, step_judge_item, step_rewards
from calibrl.trainer.rewards import RewardBreakdown, RewardModel, StepReward, judge_item, weighted_total


async def score_search(rewards: RewardModel, rollouts: Sequence[SearchRollout]) -> list[RewardBreakdown]:
    """Rewards of a batch of search trajectories (step results come from the rollout; the judge is
    called once for the batch when ``search_w_rubric`` > 0)."""
    if not rollouts:
        return []
    for rollout in rollouts:
        for k, step in enumerate(rollout.steps):
            rewards.check_retrieval(step.result, f"task {rollout.task.task_id} step {k}")
    return await rewards.with_retries(lambda: _score_search_once(rewards, rollouts), f"{len(rollouts)} trajectories")


async def _score_search_once(rewards: RewardModel, rollouts: Sequence[SearchRollout]) -> list[RewardBreakdown]:
    cfg = rewards.config
    weights = cfg.search_weights()
    answers = [(r.answer or "").strip() for r in rollouts]
    judged = [i for i, a in enumerate(answers) if a] if cfg.uses_rubric_for_search else []
    step_keys = [(i, k) for i, r in enumerate(rollouts) for k in range(len(r.steps))]
    judged_steps = step_keys if cfg.uses_rubric_for_steps else []
    answer_items = [_search_judge_item(rollouts[i], rewards.output_text(answers[i])) for i in judged]
    step_items = [step_judge_item(rollouts[i], k, cfg.max_output_chars) for i, k in judged_steps]
    answer_scores, step_scores = await gather_all(
        rewards.judge_items(answer_items), rewards.judge_items(step_items, cfg.step_rubric_id)
    )
    rubric_scores: dict[int, ItemScore] = dict(zip(judged, answer_scores))
    step_totals = {key: score.total for key, score in zip(judged_steps, step_scores)}

    results = []
    for i, rollout in enumerate(rollouts):
        golds = rollout.task.answers
        if cfg.answer_times_format and not rollout.well_formed:
            answer = 0.0
        elif cfg.binary_only or cfg.answer_metric == "em":
            answer = exact_match(answers[i], golds) if answers[i] else 0.0
        else:
            answer = token_f1(answers[i], golds) if answers[i] else 0.0
        components = {"answer": answer}
        if "retrieval" in weights:
            signals = [rewards.signal(step.result, False) for step in rollout.steps]
            components["retrieval"] = sum(signals) / len(signals) if signals else 0.0
        rubric = rubric_scores.get(i)
        if "rubric" in weights:
            components["rubric"] = rubric.total if rubric else 0.0
        steps: tuple[StepReward, ...] = ()
        if cfg.scores_steps:
            totals = [step_totals.get((i, k), 0.0) for k in range(len(rollout.steps))]
            steps = step_rewards(rollout, totals, cfg.step_w_retrieval,
                                 cfg.step_w_rubric if cfg.uses_rubric_for_steps else 0.0)
        if "steps" in weights:
            components["steps"] = mean_step_reward(steps)
        results.append(RewardBreakdown(weighted_total(components, weights), components, None, rubric, steps,
                                       cfg.scores_steps))
    return results


def _search_judge_item(rollout: SearchRollout, answer: str) -> JudgeItem:
    passages: dict[str, str] = {}  # every passage the trajectory retrieved, in order of first retrieval
    for step in rollout.steps:
        for hit in step.result.hits:
            passages.setdefault(hit.doc_id, hit.text)
    return judge_item(rollout.task, answer, passages)


__all__ = ["score_search"]
