"""The blended reward: retrieval correctness plus an SME-calibrated rubric.

Rewrite tasks (one query rewrite per rollout)::

    R = w_retrieval * r_ret + w_rubric * r_rub          (defaults 0.7 / 0.3)

``r_ret`` is the rewrite's retrieval signal at ``top_k`` (hit@k, recall@k, MRR or
nDCG@k, by ``retrieval_signal``) and ``r_rub`` the rubric total of the judge. With
``binary_only`` the reward is hit@k alone (0 or 1) and the judge is not called:
the ablation that starves GRPO of signal.

Search tasks (a multi-step Search-R1 trajectory per rollout)::

    R = w_answer * r_ans + search_w_retrieval * mean_k r_ret(k) + search_w_rubric * r_rub
        + w_steps * mean_k r_step(k)                  (defaults 1.0 / 0.0 / 0.0 / 0.0)

``r_ans`` is the answer's token F1 (or exact match) against the gold answers
times the format (1 when the trajectory follows the format grammar of
:func:`calibrl.trainer.search_format.check_format`, else 0; ``answer_times_format``,
the reward of CalibAdv's authors), 0 when the trajectory gave no answer; ``r_ret(k)`` is step k's retrieval signal
(computed during the rollout), the mean is 0 without steps; ``r_rub`` judges the
final answer. The defaults make R the answer F1 alone, the outcome reward of
Search-R1 and CalibAdv: per-step retrieval quality enters through CalibAdv's
advantage calibration rather than the reward. With ``binary_only`` R is exact
match alone.

``r_step(k)`` is step k's dense reward from both services
(``calibrl.trainer.step_rewards``: ``step_w_retrieval`` x retrieval signal +
``step_w_rubric`` x the search-query rubric total). Step rewards are computed when
``w_steps`` > 0 or ``score_steps`` is on (``advantage.step_credit`` needs them) and
are kept per step in ``RewardBreakdown.steps``; a trajectory that never searched has
mean step reward 0.

Outputs that are empty are scored, not failed: an empty rewrite retrieves
nothing and scores 0 on every component (the retrieval service would reject the
empty query). A reward that could not be COMPUTED is never 0: the whole batch is
retried up to ``max_attempts`` times, then :class:`~calibrl.errors.RewardError`
is raised with the cause. Errors that retrying cannot fix (bad argument, unknown
rubric, missing key) raise at once. A NaN, an infinity or a score outside [0, 1]
from a service counts as a failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from calibrl.config import option
from calibrl.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RewardError,
    Unauthenticated,
)
from calibrl.text import exact_match, token_f1
from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api.retrieval import RetrievalScore, ScoreItem, SearchMode
from calibrl.trainer.aio import gather_all
from calibrl.trainer.clients import JudgeClient, RetrievalClient
from calibrl.trainer.step_rewards import StepReward, mean_step_reward, step_judge_item, step_rewards
from calibrl.trainer.tasks import Task

log = logging.getLogger(__name__)

# Failures that another attempt cannot fix: the request itself is wrong or not allowed.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    InvalidArgument,
    NotFound,
    FailedPrecondition,
    Unauthenticated,
    PermissionDenied,
    ConfigError,
)

_SCORE_TOLERANCE = 1e-6
# Retrieved passages sent along with a judge item: enough for any criterion that reads them (an LLM judge
# shows the first few), and well inside the judge's per-item limits (max_retrieved, max_text_chars).
JUDGE_MAX_PASSAGES = 20
JUDGE_MAX_PASSAGE_CHARS = 4000


@dataclass
class RewardConfig:
    """How rollouts are turned into scalar rewards (see the module docstring for the formulas)."""

    w_retrieval: float = option(0.7, "Rewrite tasks: weight of the retrieval signal.")
    w_rubric: float = option(0.3, "Rewrite tasks: weight of the rubric total; 0 never calls the judge.")
    retrieval_signal: Literal["hit", "recall", "mrr", "ndcg"] = option(
        "recall", "Retrieval signal at top_k: hit (0/1), recall, mrr or ndcg."
    )
    binary_only: bool = option(False, "Ablation: R = hit@k (rewrite) or exact match (search) only; no judge call.")
    top_k: int = option(5, "Cut-off k of the retrieval signals.")
    mode: Literal["dense", "bm25", "hybrid"] | None = option(None, "Retrieval mode; null uses the server default.")
    rubric_id: str = option("", "Judge rubric to score with; required when a rubric weight is > 0.")
    answer_metric: Literal["f1", "em"] = option("f1", "Search tasks: answer score, token F1 or exact match.")
    w_answer: float = option(1.0, "Search tasks: weight of the answer score.")
    answer_times_format: bool = option(
        True,
        "Search tasks: the answer score is F1 (or EM) x format, 0 for a trajectory that breaks the format grammar "
        "(CalibAdv's authors' reward); false scores the raw answer.",
    )
    search_w_retrieval: float = option(0.0, "Search tasks: weight of the mean per-step retrieval signal.")
    search_w_rubric: float = option(0.0, "Search tasks: weight of the rubric total of the final answer.")
    w_steps: float = option(
        0.0, "Search tasks: weight of the mean per-step dense reward in the trajectory reward (0 = off)."
    )
    score_steps: bool = option(
        False, "Search tasks: compute per-step dense rewards even when w_steps is 0 (advantage.step_credit needs them)."
    )
    step_w_retrieval: float = option(0.7, "Search steps: weight of a step's retrieval signal in its step reward.")
    step_w_rubric: float = option(
        0.3, "Search steps: weight of a step's search-query rubric total; 0 never calls the judge for steps."
    )
    step_rubric_id: str = option(
        "search-steps", "Judge rubric of the search steps (configs/rubrics/search-steps.yaml), a second rubric id."
    )
    rubric_sees_retrieval: bool = option(
        False,
        "Rewrite tasks: send the retrieved passages to the judge; the judge call then waits for retrieval "
        "instead of running concurrently with it.",
    )
    max_output_chars: int = option(
        512,
        "Rewrites and answers are cut to this many characters before they are sent to a service "
        "(keep it <= the servers' limits, so a run-on rollout is scored rather than rejected).",
    )
    max_attempts: int = option(3, "Whole-batch attempts before RewardError (transient failures only).")
    retry_backoff_s: float = option(0.5, "Wait before the second attempt; doubles for each further attempt.")

    def validate(self) -> None:
        for name in ("w_retrieval", "w_rubric", "w_answer", "search_w_retrieval", "search_w_rubric", "w_steps",
                     "step_w_retrieval", "step_w_rubric"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"reward.{name}={value}: must be a finite number >= 0")
        if not self.binary_only and self.w_retrieval + self.w_rubric <= 0:
            raise ConfigError(
                "reward.w_retrieval and reward.w_rubric are both 0: every rewrite would score 0; "
                "set at least one of them > 0 (default 0.7 / 0.3)"
            )
        if not self.binary_only and self.w_answer + self.search_w_retrieval + self.search_w_rubric <= 0:
            raise ConfigError(
                "reward.w_answer, search_w_retrieval and search_w_rubric are all 0: every search rollout would "
                "score 0; set w_answer > 0 (default 1.0)"
            )
        if not self.binary_only and (self.w_rubric > 0 or self.search_w_rubric > 0) and not self.rubric_id.strip():
            raise ConfigError(
                f"reward.rubric_id is empty but w_rubric={self.w_rubric}, search_w_rubric={self.search_w_rubric}: "
                "set rubric_id to a rubric the judge serves, or set the rubric weights to 0"
            )
        if self.scores_steps and self.step_w_retrieval + self.step_w_rubric <= 0:
            raise ConfigError(
                "reward.step_w_retrieval and reward.step_w_rubric are both 0: every search step would score 0; "
                "set at least one of them > 0 (default 0.7 / 0.3)"
            )
        if self.uses_rubric_for_steps and not self.step_rubric_id.strip():
            raise ConfigError(
                f"reward.step_rubric_id is empty but step_w_rubric={self.step_w_rubric}: set it to the search-step "
                "rubric the judge serves (search-steps), or set step_w_rubric to 0"
            )
        if self.top_k < 1:
            raise ConfigError(f"reward.top_k={self.top_k}: must be >= 1")
        if self.max_output_chars < 1:
            raise ConfigError(f"reward.max_output_chars={self.max_output_chars}: must be >= 1")
        if self.max_attempts < 1:
            raise ConfigError(f"reward.max_attempts={self.max_attempts}: must be >= 1")
        if not math.isfinite(self.retry_backoff_s) or self.retry_backoff_s < 0:
            raise ConfigError(f"reward.retry_backoff_s={self.retry_backoff_s}: must be >= 0")

    @property
    def uses_rubric_for_rewrites(self) -> bool:
        return not self.binary_only and self.w_rubric > 0

    @property
    def uses_rubric_for_search(self) -> bool:
        return not self.binary_only and self.search_w_rubric > 0

    @property
    def scores_steps(self) -> bool:
        """Whether search steps get dense rewards (w_steps > 0 or score_steps)."""
        return not self.binary_only and (self.score_steps or self.w_steps > 0)

    @property
    def uses_rubric_for_steps(self) -> bool:
        return self.scores_steps and self.step_w_rubric > 0

    @property
    def search_mode(self) -> SearchMode | None:
        return None if self.mode is None else SearchMode(self.mode)

    def rewrite_weights(self) -> dict[str, float]:
        """Component -> weight of a rewrite reward; R is the weighted sum of the components."""
        if self.binary_only:
            return {"retrieval": 1.0}
        weights = {"retrieval": self.w_retrieval}
        if self.uses_rubric_for_rewrites:
            weights["rubric"] = self.w_rubric
        return weights

    def search_weights(self) -> dict[str, float]:
        """Component -> weight of a search reward; R is the weighted sum of the components."""
        if self.binary_only:
            return {"answer": 1.0}
        weights = {"answer": self.w_answer, "retrieval": self.search_w_retrieval}
        if self.uses_rubric_for_search:
            weights["rubric"] = self.search_w_rubric
        if self.scores_steps and self.w_steps > 0:
            weights["steps"] = self.w_steps
        return weights


@dataclass(frozen=True)
class RewriteRollout:
    task: Task
    rewrite: str


@dataclass(frozen=True)
class SearchStepRecord:
    think: str
    query: str
    result: RetrievalScore  # computed during the rollout


@dataclass(frozen=True)
class SearchRollout:
    task: Task
    steps: tuple[SearchStepRecord, ...]
    answer: str | None
    well_formed: bool


@dataclass(frozen=True)
class RewardBreakdown:
    """One rollout's reward: ``total`` is the weighted sum of ``components`` (raw, unweighted scores)."""

    total: float
    components: dict[str, float] = field(default_factory=dict)
    retrieval: RetrievalScore | None = None
    rubric: ItemScore | None = None
    steps: tuple[StepReward, ...] = ()  # search tasks: one dense reward per search step, when computed
    steps_scored: bool = False  # whether step rewards were computed (a trajectory may have no steps)


class _BadServiceResult(RewardError):
    """A service answered, but with something that is not a score (retried like a transient failure)."""


class RewardModel:
    """Scores batches of rollouts with the retrieval and judge services."""

    def __init__(self, config: RewardConfig, retrieval: RetrievalClient, judge: JudgeClient | None) -> None:
        config.validate()
        if judge is None and (config.uses_rubric_for_rewrites or config.uses_rubric_for_search
                              or config.uses_rubric_for_steps):
            raise ConfigError(
                f"RewardModel: the rubric weights (w_rubric={config.w_rubric}, search_w_rubric="
                f"{config.search_w_rubric}, step_w_rubric={config.step_w_rubric} with step rewards on) need a "
                "judge client; pass one or set the rubric weights to 0"
            )
        self.config = config
        self.retrieval = retrieval
        self.judge = judge

    # --- rewrite tasks ----------------------------------------------------------------------------------------------

    async def score_rewrites(self, rollouts: Sequence[RewriteRollout]) -> list[RewardBreakdown]:
        """Rewards of a batch of rewrites: one retrieval call and one judge call for the whole batch."""
        if not rollouts:
            return []
        return await self._with_retries(lambda: self._score_rewrites_once(rollouts), f"{len(rollouts)} rewrites")

    async def _score_rewrites_once(self, rollouts: Sequence[RewriteRollout]) -> list[RewardBreakdown]:
        cfg = self.config
        queries = [self._output_text(r.rewrite) for r in rollouts]
        scorable = [i for i, q in enumerate(queries) if q]
        items = [ScoreItem(query=queries[i], gold_doc_ids=rollouts[i].task.gold_doc_ids,
                           gold_answers=rollouts[i].task.answers) for i in scorable]
        use_rubric = cfg.uses_rubric_for_rewrites and bool(scorable)
        include_text = use_rubric and cfg.rubric_sees_retrieval

        retrieval_scores: list[RetrievalScore] = []
        rubric_scores: list[ItemScore] = []
        if items and use_rubric and cfg.rubric_sees_retrieval:
            retrieval_scores = await self._retrieve(items, include_text)
            judge_items = [self._rewrite_judge_item(rollouts[i], queries[i], retrieval_scores[n])
                           for n, i in enumerate(scorable)]
            rubric_scores = await self._judge(judge_items)
        elif items and use_rubric:
            judge_items = [self._rewrite_judge_item(rollouts[i], queries[i], None) for i in scorable]
            retrieval_scores, rubric_scores = await gather_all(
                self._retrieve(items, include_text), self._judge(judge_items)
            )
        elif items:
            retrieval_scores = await self._retrieve(items, include_text)

        weights = cfg.rewrite_weights()
        by_index = {i: n for n, i in enumerate(scorable)}
        results = []
        for i in range(len(rollouts)):
            n = by_index.get(i)
            retrieval = retrieval_scores[n] if n is not None else None
            rubric = rubric_scores[n] if (n is not None and rubric_scores) else None
            components = {"retrieval": self._signal(retrieval, cfg.binary_only) if retrieval is not None else 0.0}
            if "rubric" in weights:
                components["rubric"] = rubric.total if rubric else 0.0
            results.append(RewardBreakdown(_weighted(components, weights), components, retrieval, rubric))
        return results

    def _rewrite_judge_item(self, rollout: RewriteRollout, output: str, retrieved: RetrievalScore | None) -> JudgeItem:
        passages = {h.doc_id: h.text for h in retrieved.hits} if retrieved is not None else {}
        return _judge_item(rollout.task, output, passages)

    # --- search tasks -----------------------------------------------------------------------------------------------

    async def score_search(self, rollouts: Sequence[SearchRollout]) -> list[RewardBreakdown]:
        """Rewards of a batch of search trajectories (step results come from the rollout; the judge is
        called once for the batch when ``search_w_rubric`` > 0)."""
        if not rollouts:
            return []
        for rollout in rollouts:
            for k, step in enumerate(rollout.steps):
                self._check_retrieval(step.result, f"task {rollout.task.task_id} step {k}")
        return await self._with_retries(lambda: self._score_search_once(rollouts), f"{len(rollouts)} trajectories")

    async def _score_search_once(self, rollouts: Sequence[SearchRollout]) -> list[RewardBreakdown]:
        cfg = self.config
        weights = cfg.search_weights()
        answers = [(r.answer or "").strip() for r in rollouts]
        judged = [i for i, a in enumerate(answers) if a] if cfg.uses_rubric_for_search else []
        step_keys = [(i, k) for i, r in enumerate(rollouts) for k in range(len(r.steps))]
        judged_steps = step_keys if cfg.uses_rubric_for_steps else []
        answer_items = [self._search_judge_item(rollouts[i], self._output_text(answers[i])) for i in judged]
        step_items = [step_judge_item(rollouts[i], k, cfg.max_output_chars) for i, k in judged_steps]
        answer_scores, step_scores = await gather_all(
            self._judge(answer_items), self._judge(step_items, cfg.step_rubric_id)
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
                signals = [self._signal(step.result, False) for step in rollout.steps]
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
            results.append(RewardBreakdown(_weighted(components, weights), components, None, rubric, steps,
                                           cfg.scores_steps))
        return results

    def _search_judge_item(self, rollout: SearchRollout, answer: str) -> JudgeItem:
        passages: dict[str, str] = {}  # every passage the trajectory retrieved, in order of first retrieval
        for step in rollout.steps:
            for hit in step.result.hits:
                passages.setdefault(hit.doc_id, hit.text)
        return _judge_item(rollout.task, answer, passages)

    # --- service calls and checks -----------------------------------------------------------------------------------

    async def _retrieve(self, items: list[ScoreItem], include_text: bool) -> list[RetrievalScore]:
        cfg = self.config
        scores = await self.retrieval.score(items, cfg.top_k, cfg.search_mode, include_text)
        if len(scores) != len(items):
            raise _BadServiceResult(f"retrieval service returned {len(scores)} scores for {len(items)} items")
        for n, score in enumerate(scores):
            self._check_retrieval(score, f"item {n} ({items[n].query[:60]!r})")
        return list(scores)

    async def _judge(self, items: list[JudgeItem], rubric_id: str | None = None) -> list[ItemScore]:
        """Judge scores of ``items`` under ``rubric_id`` (default ``rubric_id``); no call for no items."""
        if not items:
            return []
        assert self.judge is not None  # guaranteed by __init__ when a rubric weight is > 0
        rubric_id = rubric_id or self.config.rubric_id
        scores = await self.judge.score(rubric_id, items)
        if len(scores) != len(items):
            raise _BadServiceResult(f"judge returned {len(scores)} scores for {len(items)} items")
        for n, score in enumerate(scores):
            if not _in_unit_interval(score.total):
                raise _BadServiceResult(
                    f"judge returned rubric total {score.total!r} for item {n} under rubric "
                    f"{rubric_id!r}: expected a number in [0, 1]"
                )
        return list(scores)

    @staticmethod
    def _check_retrieval(score: RetrievalScore, what: str) -> None:
        for name in ("recall", "mrr", "ndcg"):
            value = getattr(score, name)
            if not _in_unit_interval(value):
                raise _BadServiceResult(f"retrieval signal {name}={value!r} for {what}: expected a number in [0, 1]")

    def _signal(self, score: RetrievalScore, binary: bool) -> float:
        signal = "hit" if binary else self.config.retrieval_signal
        if signal == "hit":
            return 1.0 if score.hit else 0.0
        return min(1.0, max(0.0, float(getattr(score, signal))))

    def _output_text(self, text: str) -> str:
        return text.strip()[: self.config.max_output_chars].strip()

    async def _with_retries(self, attempt, what: str) -> list[RewardBreakdown]:
        cfg = self.config
        last: BaseException | None = None
        for number in range(1, cfg.max_attempts + 1):
            try:
                results = await attempt()
            except PERMANENT_ERRORS as exc:
                raise RewardError(f"reward of {what} cannot be computed: {type(exc).__name__}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - any other failure is retried, then reported with its cause
                last = exc
                log.warning("reward attempt %d/%d for %s failed: %s: %s", number, cfg.max_attempts, what,
                            type(exc).__name__, exc)
                if number < cfg.max_attempts:
                    await asyncio.sleep(cfg.retry_backoff_s * 2 ** (number - 1))
                continue
            for result in results:
                if not math.isfinite(result.total):
                    raise RewardError(f"reward of {what}: non-finite total {result.total!r} ({result.components})")
            return results
        raise RewardError(
            f"reward of {what} failed after {cfg.max_attempts} attempts; last error: {type(last).__name__}: {last}"
        ) from last


def _judge_item(task: Task, output: str, passages: dict[str, str]) -> JudgeItem:
    kept = list(passages.items())[:JUDGE_MAX_PASSAGES]
    return JudgeItem(
        query=task.query,
        output=output,
        retrieved_texts=tuple(text[:JUDGE_MAX_PASSAGE_CHARS] for _, text in kept),
        retrieved_doc_ids=tuple(doc_id for doc_id, _ in kept),
        context=task.context,
    )


def _weighted(components: dict[str, float], weights: dict[str, float]) -> float:
    return float(sum(weights[name] * components[name] for name in weights))


def _in_unit_interval(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and -_SCORE_TOLERANCE <= value <= 1 + _SCORE_TOLERANCE


__all__ = [
    "RewardBreakdown",
    "RewardConfig",
    "RewardModel",
    "RewriteRollout",
    "SearchRollout",
    "SearchStepRecord",
    "StepReward",
]
