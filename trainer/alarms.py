"""Every alarm a training step can raise: the one list that the code raising them reads and
the alarms table of docs/concepts/training-signals.md is generated from (docs/hooks/reference.py).

An alarm watches one step metric. A *band* alarm (``Alarm.field`` set) fires when the metric
passes a field of ``health.*`` (``calibrl.trainer.diagnostics.HealthConfig``):
``diagnostics.health_warnings`` walks :data:`BAND_ALARMS` in order, and each warning counts in
``health/warnings``. :data:`SKIPPED_UPDATE` is the loop's own: a step whose gradient norm is not
finite is not applied (``calibrl.trainer.loop``). The review queue's alarms
and the rubric-version log (:data:`REVIEW_ALARMS`) are raised by ``calibrl.sme.queue`` (its drift
text written by ``calibrl.sme.drift``) and ``calibrl.trainer.rubric_versions`` with texts of their
own; each entry holds the words its warning starts with, and tests/test_alarms.py checks that the
module named by ``raised_by`` still writes them.

tests/test_alarms.py reads the trainer's source and fails when a warning is logged that is
neither an alarm listed here nor one of the operational messages it names.

Meanings and what-to-do texts are Markdown; links are relative to docs/concepts/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

__all__ = ["ALARMS", "BAND_ALARMS", "REVIEW_ALARMS", "SKIPPED_UPDATE", "Alarm"]


class _Metrics(dict):
    """A step's metrics for a message template: a metric the step did not log reads 0.0."""

    def __missing__(self, key: str) -> float:
        return 0.0


@dataclass(frozen=True)
class Alarm:
    """One alarm: what it watches, when it fires, what it means and what to try."""

    name: str  # stable name, used in the docs table's anchor and in tests
    metric: str  # the step metric it watches
    meaning: str
    action: str
    # a band alarm: the health.* field it compares the metric with, and the side that fires
    field: str | None = None
    fires_when: Literal["above", "below"] = "above"
    not_finite_fires: bool = False  # NaN or infinity fires too (the gradient norm)
    # the warning logged: str.format fields {value}, {threshold} and {m[<metric>]} (another metric of the step)
    message: str = ""
    condition: str = ""  # for alarms with no band: when it fires, in words
    raised_by: str = "calibrl.trainer.diagnostics.health_warnings"
    starts_with: str = ""  # alarms raised with their own text: the words the warning starts with

    def fires(self, value: float, bands: Any) -> bool:
        """Whether a metric value leaves this band alarm's band (``bands``: a HealthConfig)."""
        if self.not_finite_fires and not math.isfinite(value):
            return True
        threshold = getattr(bands, self.field)
        return value > threshold if self.fires_when == "above" else value < threshold

    def warning(self, value: float, bands: Any, metrics: Mapping[str, float]) -> str:
        threshold = getattr(bands, self.field) if self.field else None
        return self.message.format(value=value, threshold=threshold, m=_Metrics(metrics))

    def when(self, bands: Any = None) -> str:
        """When it fires, in Markdown; with ``bands`` (a HealthConfig), its threshold's value."""
        if self.field is None:
            return self.condition
        side = ">" if self.fires_when == "above" else "<"
        text = f"`{self.metric}` {side} `health.{self.field}`"
        if bands is not None:
            text += f" (default `{getattr(bands, self.field):g}`)"
        return text + " or not finite" if self.not_finite_fires else text


_DENSER = ("a dense reward (`reward.retrieval_signal=mrr`, a rubric weight `reward.w_rubric`), dynamic sampling "
           "(`rollout.dynamic_sampling=true`), a larger `rollout.group_size`")

BAND_ALARMS: tuple[Alarm, ...] = (
    Alarm("frac_reward_zero_std_high", "frac_reward_zero_std", field="max_frac_reward_zero_std",
          meaning="most groups have all-equal rewards: their advantages are 0 and they teach nothing",
          action=_DENSER,
          message="frac_reward_zero_std={value:.3f} > {threshold}: most groups carry no learning signal; use a "
                  "denser reward (reward.retrieval_signal=mrr, reward.w_rubric) or larger groups "
                  "(rollout.group_size)"),
    Alarm("reward_std_low", "reward_std", field="min_reward_std", fires_when="below",
          meaning="rewards barely differ within the batch: the reward has (nearly) collapsed",
          action="as for `frac_reward_zero_std`; check that the judge's rubric is not saturated (every total near 1)",
          message="reward_std={value:.4f} < {threshold}: rewards have (nearly) collapsed"),
    Alarm("reward_std_high", "reward_std", field="max_reward_std",
          meaning="the reward's scale is outside the band you set (off by default: the band is 1e9)",
          action="check the reward weights (`reward.w_retrieval`, `reward.w_rubric`, `reward.w_answer`) and that "
                 "every component stays in [0, 1]",
          message="reward_std={value:.4f} > {threshold}: reward scale outside its band"),
    Alarm("kl_high", "kl", field="kl_target",
          meaning="the policy is drifting from the reference",
          action="lower `optimizer.lr`, raise `loss.beta`; watch `policy/ref_ppl` and `search/well_formed` "
                 "for collapse",
          message="kl={value:.4f} > kl_target={threshold}: the policy is drifting from the reference"),
    Alarm("grad_norm_high", "grad_norm", field="max_grad_norm_warn", not_finite_fires=True,
          meaning="an unstable update: the gradient norm before clipping is very large, NaN or infinite",
          action="lower `optimizer.lr`; `precision=fp32`",
          message="grad_norm={value:.3g} > {threshold}: unstable update"),
    Alarm("judge_retrieval_disagreement_high", "rewards/judge_retrieval_disagreement",
          field="max_judge_retrieval_disagreement",
          meaning="the judge approves rewrites that retrieve nothing, or rejects ones that hit "
                  "(a rubric total `>= health.rubric_high` counts as approving)",
          action="revalidate the rubric on fresh expert feedback ([the gate](../guides/rubric-from-feedback.md)); "
                 "the policy may be gaming the judge",
          message="rewards/judge_retrieval_disagreement={value:.3f} > {threshold} (judge high, retrieval miss "
                  "{m[rewards/judge_high_retrieval_miss]:.3f}; retrieval hit, judge low "
                  "{m[rewards/judge_low_retrieval_hit]:.3f}): the rubric and retrieval reward different rewrites; "
                  "check the judge against its golden set before trusting the rubric weight"),
)

SKIPPED_UPDATE = Alarm(
    "update_skipped", "grad_norm", raised_by="calibrl.trainer.loop",
    condition="`grad_norm` is NaN or infinite (counted in `health/skipped_updates_total`)",
    meaning="the step's update was not applied: the weights stay as they were",
    action="lower `optimizer.lr`; `precision=fp32`",
    message="grad_norm={value} is not finite: update skipped, weights unchanged")

REVIEW_ALARMS: tuple[Alarm, ...] = (
    Alarm("judge_drift", "drift/alarm", raised_by="calibrl.sme.drift", starts_with="DRIFT:",
          condition="on a review step, the judge's agreement with the experts' fresh grades falls below "
                    "`review.min_kappa` (with at least `review.drift_min_items` graded items)",
          meaning="the judge no longer agrees with the experts on the rollouts the policy now writes",
          action="distil the next rubric version from the old and the new feedback "
                 "([Rubric life cycle](rubric-lifecycle.md)); `review.on_alarm=stop` stops the run after the step"),
    Alarm("review_queue_empty", "review/queued", raised_by="calibrl.sme.queue", starts_with="review queue: no rollout",
          condition="on a review step, no rollout of the review window (`review.window_steps`, or "
                    "`review.every_steps` when 0) has an output to review",
          meaning="the experts get nothing to grade this time",
          action="check that the policy produces outputs (`search/answered`, `completions/mean_length`)"),
    Alarm("rubric_changed", "rubric/changed", raised_by="calibrl.trainer.rubric_versions",
          starts_with="rubric_changed:",
          condition="the rubric version that scores the rollouts differs from the step before's",
          meaning="the reward's definition moved under the run (a new version was served)",
          action="expected after a swap you made; otherwise see [Rubric life cycle](rubric-lifecycle.md)"),
    Alarm("rubric_downweighted", "rubric/weight_scale", raised_by="calibrl.trainer.rubric_weight",
          starts_with="review.on_alarm=downweight:",
          condition="`review.on_alarm=downweight` and a drift alarm (`judge_drift`): from the next step the rubric's "
                    "blend weight is `review.downweight_factor` times its own, until a new rubric version scores a "
                    "step (logged again when it is restored; a second alarm does not compound it)",
          meaning="the judge's part of the reward is trusted less while the experts disagree with it",
          action="publish the next rubric version ([Rubric life cycle](rubric-lifecycle.md)); the weight comes "
                 "back when the judge serves it"),
)

ALARMS: tuple[Alarm, ...] = (*BAND_ALARMS, SKIPPED_UPDATE, *REVIEW_ALARMS)
