"""The blended reward: retrieval correctness plus an SME-calibrated rubric.

This module holds what every task kind's reward shares: its configuration
(:class:`RewardConfig`, the formulas below), its result (:class:`RewardBreakdown`) and the
calls to the two services (:class:`RewardModel`). Each kind computes its own reward from
them: :func:`calibrl.trainer.kinds.rewrite.score_rewrites` and
:func:`calibrl.trainer.kinds.search.reward.score_search`.

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
(``calibrl.trainer.kinds.search.step_rewards``: ``step_w_retrieval`` x retrieval signal +
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
from typing import TYPE_CHECKING, Awaitable, Callable, Literal

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
from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api.retrieval import RetrievalScore, ScoreItem, SearchMode
from calibrl.trainer.clients import JudgeClient, RetrievalClient

if TYPE_CHECKING:  # pragma: no cover
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
    rubric_id: str = option(
        "", "Judge rubric to score with: its id (the current version) or id@version (pinned, exact "
            "reproducibility); required when a rubric weight is > 0.")
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
                f"reward.rubric_id is empty but reward.w_rubric={self.w_rubric}, reward.search_w_rubric="
                f"{self.search_w_rubric}: set reward.rubric_id to a rubric the judge serves, or set the rubric weights to 0"
            )
        if self.scores_steps and self.step_w_retrieval + self.step_w_rubric <= 0:
            raise ConfigError(
                "reward.step_w_retrieval and reward.step_w_rubric are both 0: every search step would score 0; "
                "set at least one of them > 0 (default 0.7 / 0.3)"
            )
        if self.uses_rubric_for_steps and not self.step_rubric_id.strip():
            raise ConfigError(
                f"reward.step_rubric_id is empty but reward.step_w_rubric={self.step_w_rubric}: set it to the "
                "search-step rubric the judge serves (search-steps), or set reward.step_w_rubric to 0"
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
class StepReward:
    """One search step's dense reward and what it was made of."""

    reward: float  # step_w_retrieval * retrieval + step_w_rubric * rubric
    retrieval: float  # r_ret(k) in [0, 1]
    rubric: float  # the step rubric's total in [0, 1] (0 when the rubric weight is 0 and the judge was not asked)
    found_new: bool  # retrieved a relevant document that no earlier step had
    repeated: bool  # the query repeats an earlier query of the trajectory (word similarity)


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

    # --- service calls and checks -----------------------------------------------------------------------------------

    async def retrieve(self, items: list[ScoreItem], include_text: bool) -> list[RetrievalScore]:
        """Retrieval signals of ``items`` at ``top_k`` (one call), each checked to be a score in [0, 1]."""
        cfg = self.config
        scores = await self.retrieval.score(items, cfg.top_k, cfg.search_mode, include_text)
        if len(scores) != len(items):
            raise _BadServiceResult(f"retrieval service returned {len(scores)} scores for {len(items)} items")
        for n, score in enumerate(scores):
            self.check_retrieval(score, f"item {n} ({items[n].query[:60]!r})")
        return list(scores)

    async def judge_items(self, items: list[JudgeItem], rubric_id: str | None = None) -> list[ItemScore]:
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
    def check_retrieval(score: RetrievalScore, what: str) -> None:
        for name in ("recall", "mrr", "ndcg"):
            value = getattr(score, name)
            if not _in_unit_interval(value):
                raise _BadServiceResult(f"retrieval signal {name}={value!r} for {what}: expected a number in [0, 1]")

    def signal(self, score: RetrievalScore, binary: bool) -> float:
        """The configured retrieval signal of ``score`` (hit@k when ``binary``), in [0, 1]."""
        signal = "hit" if binary else self.config.retrieval_signal
        if signal == "hit":
            return 1.0 if score.hit else 0.0
        return min(1.0, max(0.0, float(getattr(score, signal))))

    def output_text(self, text: str) -> str:
        """``text`` as it is sent to a service: stripped and cut to ``max_output_chars``."""
        return text.strip()[: self.config.max_output_chars].strip()

    async def with_retries(self, attempt: Callable[[], Awaitable[list[RewardBreakdown]]],
                           what: str) -> list[RewardBreakdown]:
        """``attempt()``'s rewards, the whole batch retried on transient failures (see the module docstring)."""
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


def judge_item(task: "Task", output: str, passages: dict[str, str]) -> JudgeItem:
    """The judge item of one output of ``task``: the first ``JUDGE_MAX_PASSAGES`` passages (doc id -> text),
    each cut to ``JUDGE_MAX_PASSAGE_CHARS``, and the task's context."""
    kept = list(passages.items())[:JUDGE_MAX_PASSAGES]
    return JudgeItem(
        query=task.query,
        output=output,
        retrieved_texts=tuple(text[:JUDGE_MAX_PASSAGE_CHARS] for _, text in kept),
        retrieved_doc_ids=tuple(doc_id for doc_id, _ in kept),
        context=task.context,
    )


def weighted_total(components: dict[str, float], weights: dict[str, float]) -> float:
    """R: the weighted sum of the weighted components."""
    return float(sum(weights[name] * components[name] for name in weights))


def _in_unit_interval(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and -_SCORE_TOLERANCE <= value <= 1 + _SCORE_TOLERANCE


__all__ = ["PERMANENT_ERRORS", "RewardBreakdown", "RewardConfig", "RewardModel", "StepReward", "judge_item",
           "weighted_total"]
