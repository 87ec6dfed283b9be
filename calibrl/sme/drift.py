"""The drift monitor: does the judge still agree with the experts on what the policy writes now?

A rubric is validated on grades of the base policy's outputs; the policy then moves into
outputs the golden set never covered. :func:`drift_report` takes items the experts graded
*recently* (feedback records, e.g. from the trainer's review queue) and the judge's scores of
the same items, and measures the judge's agreement with the experts the way validation does
(:func:`calibrl.judge_server.authoring.validation.agreement`: Cohen's kappa on pass/fail with its 95%
bootstrap interval, items resampled in clusters of one query, the same gate), so a drift
figure and a validation figure compare directly.

Below the gate it raises an **alarm** and names the criteria that disagree with the experts:

- a criterion that does not separate what the experts pass from what they fail: its mean
  score on expert-passed items minus its mean on expert-failed items (the *separation*) is
  below ``min_separation``. A criterion the policy has learnt to satisfy with outputs the
  experts reject scores those failed items high, so its separation falls;
- a criterion with error tags whose flags (score below ``flag_threshold``) match the experts'
  tags with an F1 below ``min_f1`` (validation's per-criterion precision and recall).

They are listed by how much they let through: the criterion's share of the rubric's weight times
the share of expert-failed items it approves. Fewer than ``min_items`` graded items give no verdict (``status == "too_few"``, no alarm): the
report says how many more are needed. Everything here is a pure function of its inputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

from calibrl.errors import ConfigError
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.judge_server.rubric import Rubric
from calibrl.api.judge import ItemScore
from calibrl.judge_server.authoring.validation import GATES, ValidationOptions, agreement

DRIFT_GATES = (*GATES, "upper_bound")

Status = Literal["ok", "alarm", "too_few"]


@dataclass
class DriftOptions:
    """The gate and what makes a criterion "disagree"."""

    min_kappa: float = 0.6  # the gate, as in validation
    # what must reach min_kappa: "estimate", "lower_bound" (the interval's low end: the strict
    # gate of validation) or "upper_bound" (drift only: the alarm needs the whole interval below
    # min_kappa, so a few fresh grades that disagree by chance raise none)
    gate: str = "estimate"
    pass_threshold: float = 0.6  # judge pass = total >= this (use the validation record's)
    pass_grade: int = 4  # expert pass = grade >= this, for records without a verdict
    flag_threshold: float = 0.5  # a criterion flags an item when its score is below this
    min_items: int = 10  # fewer fresh grades: no verdict
    min_separation: float = 0.1  # a criterion whose pass-minus-fail mean score is below this disagrees
    min_f1: float = 0.5  # a tagged criterion whose F1 against the expert tags is below this disagrees
    min_items_name: str = "min_items"  # what the caller calls min_items, for messages ("--min-items", ...)

    def validate(self) -> None:
        self.validation_options().validate()
        if not -1.0 <= self.min_separation <= 1.0:
            raise ConfigError(f"min_separation={self.min_separation}: must be in [-1, 1]")
        if not 0.0 <= self.min_f1 <= 1.0:
            raise ConfigError(f"min_f1={self.min_f1}: must be in [0, 1]")
        if self.gate not in DRIFT_GATES:
            raise ConfigError(f"gate={self.gate!r}: must be one of {', '.join(DRIFT_GATES)}")

    def validation_options(self) -> ValidationOptions:
        return ValidationOptions(min_kappa=self.min_kappa, pass_threshold=self.pass_threshold,
                                 pass_grade=self.pass_grade, flag_threshold=self.flag_threshold,
                                 min_items=max(2, self.min_items), gate=self.gate if self.gate in GATES else "estimate")

    def agrees(self, record: Any) -> bool:
        """Whether the judge still agrees under this gate (``record``: the agreement's validation record)."""
        if self.gate != "upper_bound":
            return bool(record.passed)
        return record.kappa_high is not None and record.kappa_high >= self.min_kappa


@dataclass
class CriterionDrift:
    """One criterion against the fresh expert grades."""

    name: str
    mean_on_pass: float | None  # its mean score on the items the experts passed
    mean_on_fail: float | None  # ... and failed
    separation: float | None  # mean_on_pass - mean_on_fail (None without both classes)
    approves_failed: float | None  # share of expert-failed items it does not flag (score >= flag_threshold)
    tags: list[str] = field(default_factory=list)
    precision: float | None = None  # its flags against the expert tags (tagged criteria only)
    recall: float | None = None
    f1: float | None = None
    disagrees: bool = False
    why: str = ""


@dataclass
class DriftReport:
    """The judge's agreement with fresh expert grades, and the alarm."""

    rubric_id: str
    rubric_hash: str
    n_items: int
    status: Status
    kappa: float | None
    kappa_low: float | None
    kappa_high: float | None
    agreement: float | None  # share of items where judge and experts give the same pass/fail
    expert_pass_rate: float | None
    judge_pass_rate: float | None
    criteria: list[CriterionDrift]
    reason: str

    @property
    def alarm(self) -> bool:
        return self.status == "alarm"

    @property
    def disagreeing(self) -> list[str]:
        """Names of the criteria that disagree, the one that lets the most expert-failed items
        through first (its weight share times the share of failed items it approves)."""
        return [c.name for c in self.criteria if c.disagrees]

    def metrics(self) -> dict[str, float]:
        """Step metrics (``drift/*``); a figure that is undefined is absent."""
        out = {"drift/items": float(self.n_items), "drift/alarm": 1.0 if self.alarm else 0.0}
        for name in ("kappa", "kappa_low", "kappa_high", "agreement"):
            value = getattr(self, name)
            if value is not None:
                out[f"drift/{name}"] = float(value)
        return out

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "alarm": self.alarm, "disagreeing": self.disagreeing}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def drift_report(rubric: Rubric, records: Sequence[FeedbackRecord], scores: Sequence[ItemScore],
                 options: DriftOptions | None = None, model_id: str = "") -> DriftReport:
    """The drift report of ``rubric`` on freshly graded ``records`` (one judge score each, same order)."""
    options = options or DriftOptions()
    options.validate()
    if len(scores) != len(records):
        raise ConfigError(f"{len(scores)} judge scores for {len(records)} graded records")
    for i, score in enumerate(scores):
        if [c.name for c in score.criteria] != [c.name for c in rubric.criteria]:
            raise ConfigError(f"scores[{i}] has criteria {[c.name for c in score.criteria]}, the rubric "
                              f"{rubric.id!r} {[c.name for c in rubric.criteria]}: score with this rubric version")
    if not records:
        return DriftReport(rubric.id, rubric.hash, 0, "too_few", None, None, None, None, None, None, [],
                           f"no graded items yet; the gate needs at least {options.min_items_name}={options.min_items}")
    record = agreement(rubric, model_id, records, scores, options.validation_options())
    pass_fail = record.metrics["pass_fail"]
    tagged = record.metrics["criteria"]
    expert_pass = [r.expert_pass(options.pass_grade) for r in records]
    criteria = []
    for criterion in rubric.criteria:
        values = [s.by_name()[criterion.name] for s in scores]
        on_pass = _mean([v for v, p in zip(values, expert_pass) if p])
        on_fail = _mean([v for v, p in zip(values, expert_pass) if not p])
        failed = [v for v, p in zip(values, expert_pass) if not p]
        drift = CriterionDrift(
            name=criterion.name, mean_on_pass=on_pass, mean_on_fail=on_fail,
            separation=None if on_pass is None or on_fail is None else on_pass - on_fail,
            approves_failed=(sum(v >= options.flag_threshold for v in failed) / len(failed)) if failed else None,
            tags=list(criterion.tags))
        if criterion.name in tagged:
            stats = tagged[criterion.name]
            drift.precision, drift.recall, drift.f1 = stats.get("precision"), stats.get("recall"), stats.get("f1")
        whys = []
        if drift.separation is not None and drift.separation < options.min_separation:
            whys.append(f"does not separate what the experts pass from what they fail: mean {on_pass:.2f} on "
                        f"passed, {on_fail:.2f} on failed items (separation {drift.separation:+.2f} < "
                        f"{options.min_separation:g}); it approves {drift.approves_failed:.0%} of the failed items")
        if criterion.name in tagged and tagged[criterion.name].get("support") and (drift.f1 or 0.0) < options.min_f1:
            whys.append(f"its flags match the expert tags {drift.tags} with F1 {drift.f1 or 0.0:.2f} < {options.min_f1:g}")
        drift.disagrees, drift.why = bool(whys), "; ".join(whys)
        criteria.append(drift)
    # the criteria that push the most expert-failed items through first: weight share x approval of failed items
    positive = sum(c.weight for c in rubric.criteria if not c.penalty) or 1.0
    share = {c.name: (c.weight / positive if not c.penalty else c.weight) for c in rubric.criteria}
    criteria.sort(key=lambda c: (not c.disagrees, -share[c.name] * (c.approves_failed or 0.0), c.name))
    kappa_text = record.kappa_text()
    if len(records) < options.min_items:
        status: Status = "too_few"
        reason = (f"{len(records)} graded items, fewer than {options.min_items_name}={options.min_items}: no verdict yet "
                  f"(kappa {kappa_text} so far)")
    elif options.agrees(record) and not record.passed:  # the upper-bound gate: not shown to drift
        status = "ok"
        reason = (f"no drift shown on {len(records)} freshly graded items: kappa {kappa_text} is below min_kappa "
                  f"{options.min_kappa:g}, but its 95% interval reaches it (gate on the upper_bound: the alarm "
                  "needs the whole interval below)")
    elif options.agrees(record):
        status = "ok"
        reason = f"the judge still agrees with the experts: {record.reason}"
    else:
        status = "alarm"
        named = [c for c in criteria if c.disagrees]
        reason = (f"DRIFT: the judge no longer agrees with the experts on {len(records)} freshly graded items "
                  f"(kappa {kappa_text}, gate min_kappa {options.min_kappa:g} on the {options.gate}; experts pass "
                  f"{pass_fail['expert_pass_rate']:.0%}, the judge {pass_fail['judge_pass_rate']:.0%}). ")
        reason += ("Criteria that disagree: " + "; ".join(f"{c.name} ({c.why})" for c in named) if named
                   else "No single criterion stands out: the criteria together order the items unlike the experts")
        reason += (". Distil the next version from the old and the new feedback "
                   "(calibrl rubric distill + validate); the judge server picks it up")
    return DriftReport(
        rubric_id=rubric.id, rubric_hash=rubric.hash, n_items=len(records), status=status, kappa=record.kappa,
        kappa_low=record.kappa_low, kappa_high=record.kappa_high, agreement=pass_fail["agreement"],
        expert_pass_rate=pass_fail["expert_pass_rate"], judge_pass_rate=pass_fail["judge_pass_rate"],
        criteria=criteria, reason=reason)
