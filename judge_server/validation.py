"""Validate a rubric + judge against the SME golden set; validation records.

Judge pass/fail is ``total >= pass_threshold``; judge grade is the total mapped to
1-5 in five equal bins (``1 + min(4, floor(5 * total))``). Reported: Cohen's kappa
on pass/fail, quadratic-weighted kappa and Spearman on grades, per-criterion
precision/recall against the expert error tags (a criterion flags an item when its
score is below ``flag_threshold``; the item is positive when the expert gave one of
the criterion's ``tags``), and the confusion matrices. The gate passes when the
golden set has at least ``min_items`` items and kappa >= ``min_kappa``.

The result is a :class:`ValidationRecord` bound to (rubric hash, judge model id),
kept next to the rubric in ``<rubric file>.validation.json`` (one record per
(hash, model id); a new run replaces the old one). The judge server serves a rubric
only when a passing record matches its hash and the served model id.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from calibrl.errors import ConfigError
from judge_server import metrics
from judge_server.feedback import FeedbackRecord
from judge_server.rubric import Rubric
from judge_server.types import ItemScore

VALIDATION_SUFFIX = ".validation.json"


@dataclass
class ValidationOptions:
    min_kappa: float = 0.6
    pass_threshold: float = 0.6  # lower edge of judge grade 4, matching the default pass_grade 4
    pass_grade: int = 4
    flag_threshold: float = 0.5
    min_items: int = 10

    def validate(self) -> None:
        if not -1.0 <= self.min_kappa <= 1.0:
            raise ConfigError(f"min_kappa={self.min_kappa}: must be in [-1, 1]")
        for name in ("pass_threshold", "flag_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be in [0, 1]")
        if not 1 <= self.pass_grade <= 5:
            raise ConfigError(f"pass_grade={self.pass_grade}: must be in 1..5")
        if self.min_items < 2:
            raise ConfigError(f"min_items={self.min_items}: must be >= 2")


@dataclass
class ValidationRecord:
    rubric_id: str
    rubric_hash: str
    model_id: str
    passed: bool
    kappa: float | None
    min_kappa: float
    pass_threshold: float
    n_items: int
    golden_sha256: str
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "ValidationRecord":
        known = {f for f in ValidationRecord.__dataclass_fields__}
        return ValidationRecord(**{k: v for k, v in data.items() if k in known})


def judge_grade(total: float) -> int:
    """The judge's total in [0, 1] as a 1-5 grade (five equal bins)."""
    return 1 + min(4, int(math.floor(5.0 * total)))


def golden_digest(records: Sequence[FeedbackRecord]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(record.record_hash.encode())
    return digest.hexdigest()


def agreement(rubric: Rubric, model_id: str, golden: Sequence[FeedbackRecord], scores: Sequence[ItemScore],
              options: ValidationOptions | None = None) -> ValidationRecord:
    """Compare judge ``scores`` (one per golden record) with the experts and apply the gate."""
    options = options or ValidationOptions()
    options.validate()
    if len(scores) != len(golden):
        raise ValueError(f"{len(scores)} scores for {len(golden)} golden records")
    expert_pass = ["pass" if r.expert_pass(options.pass_grade) else "fail" for r in golden]
    judge_pass = ["pass" if s.total >= options.pass_threshold else "fail" for s in scores]
    kappa = metrics.cohen_kappa(expert_pass, judge_pass, ["pass", "fail"])
    agree = sum(a == b for a, b in zip(expert_pass, judge_pass)) / len(golden) if golden else None

    graded = [(r.grade, s) for r, s in zip(golden, scores) if r.grade is not None]
    expert_grades = [g for g, _ in graded]
    judge_grades = [judge_grade(s.total) for _, s in graded]
    grade_metrics = {
        "n": len(graded),
        "quadratic_weighted_kappa": metrics.quadratic_weighted_kappa(expert_grades, judge_grades) if graded else None,
        "spearman": metrics.spearman(expert_grades, judge_grades) if graded else None,
        "spearman_total": metrics.spearman(expert_grades, [s.total for _, s in graded]) if graded else None,
        "confusion": {"labels": [1, 2, 3, 4, 5], "rows": "expert", "columns": "judge",
                      "matrix": metrics.confusion(expert_grades, judge_grades, [1, 2, 3, 4, 5])},
    }
    per_criterion = {}
    for criterion in rubric.criteria:
        if not criterion.tags:
            continue
        flagged = [s.by_name()[criterion.name] < options.flag_threshold for s in scores]
        tagged = [bool(set(criterion.tags) & set(_canonical_tags(r))) for r in golden]
        per_criterion[criterion.name] = {"tags": list(criterion.tags), **metrics.precision_recall(flagged, tagged)}

    reasons = []
    if len(golden) < options.min_items:
        reasons.append(f"golden set has {len(golden)} items, fewer than min_items={options.min_items}")
    if kappa is None:
        reasons.append("kappa is undefined (experts and judge each used a single class)")
    elif kappa < options.min_kappa:
        reasons.append(f"kappa {kappa:.3f} < min_kappa {options.min_kappa}")
    passed = not reasons
    reason = "; ".join(reasons) if reasons else f"kappa {kappa:.3f} >= min_kappa {options.min_kappa}"
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
                "kappa": kappa, "agreement": agree,
                "expert_pass_rate": expert_pass.count("pass") / len(golden) if golden else None,
                "judge_pass_rate": judge_pass.count("pass") / len(golden) if golden else None,
                "confusion": {"labels": ["pass", "fail"], "rows": "expert", "columns": "judge",
                              "matrix": metrics.confusion(expert_pass, judge_pass, ["pass", "fail"])},
            },
            "grades": grade_metrics,
            "criteria": per_criterion,
            "options": asdict(options),
        },
        created_at=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    )


def _canonical_tags(record: FeedbackRecord) -> list[str]:
    from judge_server.distill import canonical_tag

    return [canonical_tag(t) for t in record.error_tags]


def validate_judge(rubric: Rubric, golden: Sequence[FeedbackRecord], config: Any,
                   options: ValidationOptions) -> ValidationRecord:
    """Score the golden set with the judge of ``config`` (a ``JudgeConfig``) and compare
    it with the SME grades: the validation record of ``rubric`` for that judge (not
    written; :func:`write_record` does that). Raises on items the judge rejects."""
    from judge_server.judge import Judge, load_llm

    options.validate()
    judge = Judge([rubric], config, llm=load_llm(config))
    items = [r.to_item() for r in golden]
    step = config.max_batch_size  # a golden set may be larger than one request
    for start in range(0, len(items), step):
        judge.check_items(items[start : start + step])
    scores = judge.compute(judge.resolve(rubric.id), items)
    return agreement(rubric, judge.model_id, golden, scores, options)


def validation_path(rubric_path: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(str(rubric_path) + VALIDATION_SUFFIX)


def read_records(path: str | pathlib.Path) -> list[ValidationRecord]:
    """Records of a validation file ([] when it does not exist)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [ValidationRecord.from_json(r) for r in data["records"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"validation file {path} is malformed ({exc}); delete it and run "
                          "'calibrl rubric validate' again") from None


def write_record(path: str | pathlib.Path, record: ValidationRecord) -> list[ValidationRecord]:
    """Add ``record`` to the file, replacing an older record for the same (hash, model id)."""
    path = pathlib.Path(path)
    records = [r for r in read_records(path)
               if (r.rubric_hash, r.model_id) != (record.rubric_hash, record.model_id)]
    records.append(record)
    records.sort(key=lambda r: (r.rubric_hash, r.model_id))
    payload = {"records": [r.to_json() for r in records]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return records


def find_record(records: Sequence[ValidationRecord], rubric_hash: str, model_id: str) -> ValidationRecord | None:
    for record in records:
        if record.rubric_hash == rubric_hash and record.model_id == model_id:
            return record
    return None
