"""Validate a rubric + judge against the SME golden set; validation records.

Judge pass/fail is ``total >= pass_threshold``; judge grade is the total mapped to
1-5 in five equal bins (``1 + min(4, floor(5 * total))``). Reported: Cohen's kappa
on pass/fail, quadratic-weighted kappa and Spearman on grades, per-criterion
precision/recall against the expert error tags (a criterion flags an item when its
score is below ``flag_threshold``; the item is positive when the expert gave one of
the criterion's ``tags``), and the confusion matrices. The gate passes when the
golden set has at least ``min_items`` items and kappa >= ``min_kappa``; when it fails, the
record's ``reason`` says the kappa, the gate, the threshold used and what to look at.

Every kappa comes with its 95% bootstrap interval (:func:`calibrl.stats.kappa_interval`,
10,000 resamples, seeded): golden items are resampled in clusters of the same query (the
reviews of one task are not independent). The gate decides on the estimate
(``gate="estimate"``, the default) or on the interval's lower bound
(``gate="lower_bound"``: passes only when the whole interval clears ``min_kappa``); the
decision line states the interval either way.

``pass_threshold`` may instead be picked (``--pass-threshold auto``) by
:func:`pick_pass_threshold` on the NON-golden feedback, so the golden set stays a hold-out
(a feedback record is left out when it is golden or has a golden item's (query, output) text);
the record keeps the choice (``pass_threshold_source``, ``metrics["threshold_selection"]``).

The result is a :class:`~calibrl.judge_server.validation_records.ValidationRecord` bound to (rubric hash, judge model id),
kept next to the rubric in ``<rubric file>.validation.json`` (one record per
(hash, model id); a new run replaces the old one). The judge server serves a rubric
only when a passing record matches its hash and the served model id.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Sequence

from calibrl.errors import ConfigError
from calibrl.json_types import JsonObject
from calibrl.judge_server import metrics
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.judge_server.rubric import Rubric
from calibrl.judge_server.validation_records import (  # noqa: F401 - re-exported: the records this module writes
    VALIDATION_SUFFIX,
    ValidationRecord,
    find_record,
    kappa_bound,
    read_records,
    validation_path,
    write_record,
)
from calibrl.api.judge import ItemScore

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.judge import Judge

GATES = ("estimate", "lower_bound")
KAPPA_RESAMPLES = 10_000  # bootstrap resamples of every kappa interval (seed 0)


@dataclass
class ValidationOptions:
    min_kappa: float = 0.6
    pass_threshold: float = 0.6  # lower edge of judge grade 4, matching the default pass_grade 4
    pass_grade: int = 4
    flag_threshold: float = 0.5
    min_items: int = 10
    gate: str = "estimate"  # "estimate": kappa >= min_kappa; "lower_bound": the interval's low end >= min_kappa

    def validate(self) -> None:
        if self.gate not in GATES:
            raise ConfigError(f"gate={self.gate!r}: must be one of {', '.join(GATES)}")
        if not -1.0 <= self.min_kappa <= 1.0:
            raise ConfigError(f"min_kappa={self.min_kappa}: must be in [-1, 1]")
        for name in ("pass_threshold", "flag_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be in [0, 1]")
        if not 1 <= self.pass_grade <= 5:
            raise ConfigError(f"pass_grade={self.pass_grade}: must be in 1..5")
        if self.min_items < 2:
            raise ConfigError(f"min_items={self.min_items}: must be >= 2")


def judge_grade(total: float) -> int:
    """The judge's total in [0, 1] as a 1-5 grade (five equal bins)."""
    return 1 + min(4, int(math.floor(5.0 * total)))


@dataclass(frozen=True)
class ThresholdChoice:
    """A judge pass threshold picked on calibration records (never the golden set)."""

    threshold: float
    kappa: float | None  # Cohen's kappa on the calibration records at that threshold
    n_items: int
    expert_pass_rate: float

    def to_json(self) -> JsonObject:
        return asdict(self)


def pick_pass_threshold(records: Sequence[FeedbackRecord], scores: Sequence[ItemScore], pass_grade: int = 4,
                        prefer: float = 0.6) -> ThresholdChoice:
    """The judge pass threshold with the best Cohen's kappa against the experts' pass/fail on
    ``records`` (the non-golden feedback; its ``scores`` from the judge under validation).

    Candidates are the midpoints between consecutive distinct totals (every distinct split of
    the records), plus 0 and 1; ties go to the candidate nearest ``prefer`` (the default
    threshold), so the choice is deterministic."""
    if len(scores) != len(records):
        raise ValueError(f"{len(scores)} scores for {len(records)} calibration records")
    if len(records) < 2:
        raise ConfigError(f"--pass-threshold auto needs at least 2 non-golden feedback records, got {len(records)}")
    expert = ["pass" if r.expert_pass(pass_grade) else "fail" for r in records]
    if len(set(expert)) < 2:
        raise ConfigError(f"--pass-threshold auto: the {len(records)} non-golden records are all expert "
                          f"'{expert[0]}', so no threshold can be told from another; give --pass-threshold VALUE")
    totals = sorted({round(s.total, 12) for s in scores})
    candidates = {0.0, 1.0, *((a + b) / 2 for a, b in zip(totals, totals[1:]))}
    best: tuple[float, float, float] | None = None  # (kappa, -distance to prefer, threshold)
    for threshold in sorted(candidates):
        judged = ["pass" if s.total >= threshold else "fail" for s in scores]
        kappa = metrics.cohen_kappa(expert, judged, ["pass", "fail"])
        key = (kappa if kappa is not None else -2.0, -abs(threshold - prefer), threshold)
        if best is None or key > best:
            best = key
    assert best is not None
    kappa = best[0] if best[0] > -2.0 else None
    return ThresholdChoice(threshold=round(best[2], 6), kappa=kappa, n_items=len(records),
                           expert_pass_rate=expert.count("pass") / len(records))


def golden_digest(records: Sequence[FeedbackRecord]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(record.record_hash.encode())
    return digest.hexdigest()


def agreement(rubric: Rubric, model_id: str, golden: Sequence[FeedbackRecord], scores: Sequence[ItemScore],
              options: ValidationOptions | None = None,
              threshold_choice: ThresholdChoice | None = None) -> ValidationRecord:
    """Compare judge ``scores`` (one per golden record) with the experts and apply the gate.
    ``threshold_choice``: the threshold was picked by :func:`pick_pass_threshold` (recorded)."""
    options = options or ValidationOptions()
    if threshold_choice is not None:
        options = replace(options, pass_threshold=threshold_choice.threshold)
    options.validate()
    if len(scores) != len(golden):
        raise ValueError(f"{len(scores)} scores for {len(golden)} golden records")
    expert_pass = ["pass" if r.expert_pass(options.pass_grade) else "fail" for r in golden]
    judge_pass = ["pass" if s.total >= options.pass_threshold else "fail" for s in scores]
    kappa = metrics.cohen_kappa(expert_pass, judge_pass, ["pass", "fail"])
    low, high, n_clusters = _kappa_bounds(golden, expert_pass, judge_pass, kappa)
    agree = sum(a == b for a, b in zip(expert_pass, judge_pass)) / len(golden) if golden else None

    grade_metrics = _grade_metrics(golden, scores)
    per_criterion = _criterion_metrics(rubric, golden, scores, options.flag_threshold)

    interval = "n/a" if kappa is None else f"{kappa:.3f}" + (
        "" if low is None else f" [{kappa_bound(low)}, {kappa_bound(high)}]")
    reasons = []
    if len(golden) < options.min_items:
        reasons.append(f"golden set has {len(golden)} items, fewer than min_items={options.min_items}")
    if kappa is None:
        reasons.append("kappa is undefined (experts and judge each used a single class)")
    elif options.gate == "lower_bound" and (low is None or low < options.min_kappa):
        reasons.append(f"kappa {interval}: its 95% interval reaches below min_kappa {options.min_kappa} "
                       "(the gate needs the whole interval above it)")
    elif kappa < options.min_kappa:
        reasons.append(f"kappa {interval} < min_kappa {options.min_kappa}")
    passed = not reasons
    judged_at = (f"judge pass = total >= pass_threshold {options.pass_threshold:g}; 95% bootstrap interval over "
                 f"{len(golden)} golden items in {n_clusters} query clusters")
    if passed and options.gate == "lower_bound":
        reason = f"kappa {interval}: the whole 95% interval is >= min_kappa {options.min_kappa} ({judged_at})"
    elif passed:
        reason = f"kappa {interval} >= min_kappa {options.min_kappa} ({judged_at})"
    else:
        reason = "; ".join(reasons) + f" ({judged_at}). " + _advice(expert_pass, judge_pass, per_criterion, options,
                                                                   auto=threshold_choice is not None)
    return ValidationRecord(
        rubric_id=rubric.id,
        rubric_hash=rubric.hash,
        model_id=model_id,
        passed=passed,
        kappa=kappa,
        min_kappa=options.min_kappa,
        pass_threshold=options.pass_threshold,
        n_items=len(golden),
        golden_sha256=golden_digest(golden),
        reason=reason,
        metrics={
            "pass_fail": {
                "kappa": kappa, "kappa_low": low, "kappa_high": high, "kappa_clusters": n_clusters,
                "kappa_resamples": KAPPA_RESAMPLES, "agreement": agree,
                "expert_pass_rate": expert_pass.count("pass") / len(golden) if golden else None,
                "judge_pass_rate": judge_pass.count("pass") / len(golden) if golden else None,
                "confusion": {"labels": ["pass", "fail"], "rows": "expert", "columns": "judge",
                              "matrix": metrics.confusion(expert_pass, judge_pass, ["pass", "fail"])},
            },
            "grades": grade_metrics,
            "criteria": per_criterion,
            "options": asdict(options),
            **({"threshold_selection": {"method": "best Cohen's kappa on the non-golden feedback",
                                        **threshold_choice.to_json()}} if threshold_choice else {}),
        },
        created_at=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        pass_threshold_source="auto" if threshold_choice else "given",
        kappa_low=low,
        kappa_high=high,
        gate=options.gate,
    )


def _grade_metrics(golden: Sequence[FeedbackRecord], scores: Sequence[ItemScore]) -> JsonObject:
    """Agreement of the judge's 1-5 grades with the experts' (the records that have a grade)."""
    graded = [(r.grade, s) for r, s in zip(golden, scores) if r.grade is not None]
    expert_grades = [g for g, _ in graded]
    judge_grades = [judge_grade(s.total) for _, s in graded]
    return {
        "n": len(graded),
        "quadratic_weighted_kappa": metrics.quadratic_weighted_kappa(expert_grades, judge_grades) if graded else None,
        "spearman": metrics.spearman(expert_grades, judge_grades) if graded else None,
        "spearman_total": metrics.spearman(expert_grades, [s.total for _, s in graded]) if graded else None,
        "confusion": {"labels": [1, 2, 3, 4, 5], "rows": "expert", "columns": "judge",
                      "matrix": metrics.confusion(expert_grades, judge_grades, [1, 2, 3, 4, 5])},
    }


def _criterion_metrics(rubric: Rubric, golden: Sequence[FeedbackRecord], scores: Sequence[ItemScore],
                       flag_threshold: float) -> JsonObject:
    """Per tagged criterion: precision/recall of its flags (score < ``flag_threshold``) against the expert tags."""
    per_criterion = {}
    for criterion in rubric.criteria:
        if not criterion.tags:
            continue
        flagged = [s.by_name()[criterion.name] < flag_threshold for s in scores]
        tagged = [bool(set(criterion.tags) & set(_canonical_tags(r))) for r in golden]
        per_criterion[criterion.name] = {"tags": list(criterion.tags), **metrics.precision_recall(flagged, tagged)}
    return per_criterion


def _kappa_bounds(golden: Sequence[FeedbackRecord], expert_pass: Sequence[str], judge_pass: Sequence[str],
                  kappa: float | None) -> tuple[float | None, float | None, int]:
    """(low, high, query clusters) of kappa's 95% bootstrap interval; bounds None where undefined."""
    from calibrl.stats import kappa_interval

    clusters = [" ".join(r.query.lower().split()) for r in golden]
    if kappa is None or not golden:
        return None, None, len(set(clusters))
    interval = kappa_interval([e == "pass" for e in expert_pass], [j == "pass" for j in judge_pass],
                              clusters=clusters, resamples=KAPPA_RESAMPLES, seed=0)
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return None, None, len(set(clusters))
    return interval.low, interval.high, len(set(clusters))


def _advice(expert_pass: Sequence[str], judge_pass: Sequence[str], per_criterion: JsonObject,
            options: ValidationOptions, auto: bool = False) -> str:
    """What to look at when the gate fails: the threshold against the SME pass line, and the
    criteria that disagree most with the experts' error tags."""
    n = max(len(expert_pass), 1)
    expert_rate, judge_rate = expert_pass.count("pass") / n, judge_pass.count("pass") / n
    hints = [f"Experts passed {expert_rate:.0%} of the golden items (grade >= {options.pass_grade} or verdict "
             f"'pass'), the judge {judge_rate:.0%} at pass_threshold {options.pass_threshold:g}"]
    if auto and abs(judge_rate - expert_rate) > 0.1:
        hints.append("the threshold was the best-kappa one on the non-golden feedback, so a better one for "
                     "these items would be chosen on the golden set itself: the judge orders items unlike the "
                     "experts; check the criteria")
    elif judge_rate < expert_rate - 0.1:
        hints.append("the threshold looks too strict for the SME pass line: try a lower --pass-threshold, "
                     "or --pass-threshold auto --feedback <the distilled feedback>")
    elif judge_rate > expert_rate + 0.1:
        hints.append("the threshold looks too lenient for the SME pass line: try a higher --pass-threshold, "
                     "or --pass-threshold auto --feedback <the distilled feedback>")
    else:
        hints.append("the pass rates are within 10 points, so the threshold is not the main cause: the judge "
                     "orders items unlike the experts; check the criteria")
    weak = sorted(((c.get("f1") if c.get("f1") is not None else 0.0, name, c) for name, c in per_criterion.items()
                   if c.get("support") and (c.get("f1") or 0.0) < 0.9), key=lambda entry: (entry[0], entry[1]))[:3]
    if weak:
        hints.append("criteria that disagree most with the expert tags: " + ", ".join(
            f"{name} (precision {_fmt(c.get('precision'))}, recall {_fmt(c.get('recall'))})" for _, name, c in weak))
    return "; ".join(hints) + ". Full report: the validation record's metrics"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _canonical_tags(record: FeedbackRecord) -> list[str]:
    from calibrl.judge_server.authoring.distill import canonical_tag

    return [canonical_tag(t) for t in record.error_tags]


def validate_judge(rubric: Rubric, golden: Sequence[FeedbackRecord], config: "JudgeConfig",
                   options: ValidationOptions,
                   calibration: Sequence[FeedbackRecord] | None = None) -> ValidationRecord:
    """Score the golden set with the judge of ``config`` (a ``JudgeConfig``) and compare
    it with the SME grades: the validation record of ``rubric`` for that judge (not
    written; :func:`write_record` does that). Raises on items the judge rejects.

    ``calibration``: non-golden feedback records (``--pass-threshold auto``); the pass
    threshold is then picked on them by :func:`pick_pass_threshold` and recorded, and
    ``options.pass_threshold`` is ignored. Records that are also in ``golden``, or share a
    golden item's (query, output) text, are left out, so the golden set never decides its
    own threshold."""
    from calibrl.judge_server.judge import Judge, load_llm

    options.validate()
    judge = Judge([rubric], config, llm=load_llm(config))
    choice = None
    if calibration is not None:
        from calibrl.judge_server.authoring.distill import text_key

        golden_keys = {r.record_hash for r in golden} | {text_key(r) for r in golden}
        calibration = [r for r in calibration if r.record_hash not in golden_keys and text_key(r) not in golden_keys]
        choice = pick_pass_threshold(calibration, _judge_scores(judge, rubric, config, calibration),
                                     options.pass_grade)
    scores = _judge_scores(judge, rubric, config, golden)
    return agreement(rubric, judge.scorer_id(rubric), golden, scores, options, threshold_choice=choice)


def _judge_scores(judge: "Judge", rubric: Rubric, config: "JudgeConfig",
                  records: Sequence[FeedbackRecord]) -> list[ItemScore]:
    items = [r.to_item() for r in records]
    step = config.max_batch_size  # a record set may be larger than one request
    for start in range(0, len(items), step):
        judge.check_items(items[start : start + step])
    return judge.compute(judge.resolve(rubric.id), items)
