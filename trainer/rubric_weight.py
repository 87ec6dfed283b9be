"""``review.on_alarm=downweight``: trust the rubric less once the experts say it drifted.

When the drift check of a review step raises the alarm (:mod:`calibrl.sme.queue`), the
rubric's weight in the blended reward (``reward.w_rubric`` for rewrites,
``reward.search_w_rubric`` for search answers) is multiplied by ``review.downweight_factor``
from the next step on::

    R = w_retrieval * r_ret + (factor * w_rubric) * r_rub       (rewrite tasks; search alike)

The other components keep their weights, so the retrieval signal, which cannot drift, steers
more of the advantage. The weight is restored on the first step scored (in part) by a rubric
version other than those in use when the alarm fired: the judge picked up a new version, which
passed its own validation gate. A run pinned to ``id@version`` is never restored. A second
alarm while the weight is lowered keeps it at ``factor * w_rubric`` (it does not compound).

The blend is redone in the loop's rewards phase, after the scores are in, so it applies exactly
from the next step on however far ahead the rollouts were scored (one step off-policy). Each
change is an event in ``rubric_versions.jsonl`` (``rubric_downweighted``,
``rubric_weight_restored``) and a warning in the log; every step logs ``rubric/weight_scale``
and ``rubric/weight``. The state is part of the checkpoint (:class:`TrainState`), so a
resumed run keeps the lowered weight. Search-step rewards (``reward.step_w_rubric``) are left
as they are: they score the search queries with another rubric.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Iterable

from calibrl.errors import ConfigError
from calibrl.trainer import distributed as dist_util
from calibrl.trainer.rewards import RewardBreakdown, RewardConfig, weighted_total
from calibrl.trainer.task_kinds import task_kind

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.sme.queue import ReviewQueue
    from calibrl.trainer.checkpoint import TrainState
    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.handoff import ScoredBatch
    from calibrl.trainer.rubric_versions import RubricVersionLog

log = logging.getLogger(__name__)


def blend_weights(reward: RewardConfig, kind: str) -> dict[str, float]:
    """Component -> weight of the reward of task kind ``kind`` (its ``TaskKind.reward_weights``)."""
    weights_of = task_kind(kind).reward_weights
    if weights_of is None:
        raise ConfigError(f"review.on_alarm=downweight with tasks of kind {kind!r}: the kind does not say how its "
                          "reward is blended (TaskKind.reward_weights), so its rubric weight cannot be lowered; use "
                          "review.on_alarm=warn or stop")
    return weights_of(reward)


def reblend(breakdowns: Iterable[RewardBreakdown], weights: dict[str, float],
            rubric_scale: float) -> list[RewardBreakdown]:
    """``breakdowns`` with their totals recomputed from their components, the rubric's weight
    multiplied by ``rubric_scale`` (the components themselves are unchanged)."""
    scaled = {name: w * rubric_scale if name == "rubric" else w for name, w in weights.items()}
    return [dataclasses.replace(b, total=weighted_total(b.components, scaled)) for b in breakdowns]


def _hashes(breakdowns: Iterable[RewardBreakdown], rubric_id: str) -> set[str]:
    return {b.rubric.rubric_hash for b in breakdowns
            if b.rubric is not None and b.rubric.rubric_hash and b.rubric.rubric_id == rubric_id}


class RubricWeight:
    """The rubric's weight of a run (see module doc); inert unless ``review.on_alarm=downweight``."""

    def __init__(self, config: "TrainConfig", kind: str, state: "TrainState", ctx: dist_util.DistContext,
                 events: "RubricVersionLog | None" = None) -> None:
        self.enabled = config.review.on_alarm == "downweight"
        self.factor = config.review.downweight_factor
        self.rubric_id = config.reward.rubric_id.partition("@")[0]
        self.state, self.ctx, self.events = state, ctx, events
        self.weights = blend_weights(config.reward, kind) if self.enabled else {}
        if self.enabled and "rubric" not in self.weights:
            raise ConfigError(f"review.on_alarm=downweight but the {kind} reward has no rubric weight "
                              f"(reward.w_rubric={config.reward.w_rubric}, search_w_rubric="
                              f"{config.reward.search_w_rubric}): there is nothing to lower; set it > 0 or use "
                              "review.on_alarm=warn")

    @property
    def scale(self) -> float:
        return self.state.rubric_weight_scale

    def blend(self, scored: "ScoredBatch") -> tuple["ScoredBatch", dict[str, float]]:
        """The rewards phase: restore the weight if a new rubric version scored this step, then
        re-blend the step's rewards with the lowered weight. Returns the batch and its metrics."""
        if not self.enabled:
            return scored, {}
        if self.scale != 1.0:
            new = _hashes(scored.breakdowns, self.rubric_id) - set(self.state.downweighted_versions)
            if dist_util.any_rank(bool(new), self.ctx):
                self._restore(scored.step, sorted(new))
        if self.scale != 1.0:
            scored = dataclasses.replace(scored, breakdowns=reblend(scored.breakdowns, self.weights, self.scale))
        return scored, {"rubric/weight_scale": self.scale, "rubric/weight": self.weights["rubric"] * self.scale}

    def after_step(self, step: int, review: "ReviewQueue", scored: "ScoredBatch") -> None:
        """The log phase: when this step's drift check raised the alarm (rank 0 runs it), lower
        the weight from the next step on, on every rank."""
        if not self.enabled:
            return
        if not dist_util.any_rank(review.alarm_step == step, self.ctx):
            return
        versions = _hashes(scored.breakdowns, self.rubric_id) | ({review.alarm_hash} if review.alarm_hash else set())
        was = self.scale
        self.state.rubric_weight_scale = self.factor
        self.state.downweighted_versions = sorted(set(self.state.downweighted_versions) | versions)
        if was != 1.0:
            log.warning("step %d: drift alarm again: the rubric's weight stays %g x %g", step, self.factor,
                        self.weights["rubric"])
            return
        log.warning("step %d: review.on_alarm=downweight: rubric %s weight %g -> %g from step %d until a new "
                    "rubric version is served", step, self.rubric_id, self.weights["rubric"],
                    self.weights["rubric"] * self.factor, step + 1)
        self._event({"step": step, "event": "rubric_downweighted", "rubric_id": self.rubric_id,
                     "versions": self.state.downweighted_versions, "factor": self.factor,
                     "weight": self.weights["rubric"] * self.factor, "from_step": step + 1})

    def _restore(self, step: int, new_versions: list[str]) -> None:
        log.warning("step %d: rubric %s scored by a new version (%s): its weight is %g again", step, self.rubric_id,
                    ", ".join(h[:12] for h in new_versions) or "on another rank", self.weights["rubric"])
        self._event({"step": step, "event": "rubric_weight_restored", "rubric_id": self.rubric_id,
                     "versions": new_versions, "previous": self.state.downweighted_versions,
                     "weight": self.weights["rubric"]})
        self.state.rubric_weight_scale = 1.0
        self.state.downweighted_versions = []

    def _event(self, record: dict) -> None:
        if self.events is not None:
            self.events.event(record)


__all__ = ["RubricWeight", "blend_weights", "reblend"]
