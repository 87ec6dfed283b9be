"""Validation records: the judge's certificate that a rubric agrees with the SME golden set.

``calibrl rubric validate`` (:mod:`calibrl.judge_server.authoring.validation`) writes one
:class:`ValidationRecord` per (rubric hash, judge model id) next to the rubric, in
``<rubric file>.validation.json`` (a new run replaces the old record). The judge server
(:mod:`calibrl.judge_server.judge`) reads them: it serves a rubric only when a passing record
matches its hash and the served model id. This module is the one both halves share.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Sequence

from calibrl.errors import ConfigError
from calibrl.json_types import JsonObject

VALIDATION_SUFFIX = ".validation.json"


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
    metrics: JsonObject = field(default_factory=dict)
    created_at: str = ""
    # Where pass_threshold came from: "given" (the command line) or "auto" (picked on the
    # non-golden feedback, see metrics["threshold_selection"]).
    pass_threshold_source: str = "given"
    # Cohen's kappa's 95% bootstrap interval (golden items resampled in clusters of one query) and
    # what the gate decided on ("estimate" or "lower_bound").
    kappa_low: float | None = None
    kappa_high: float | None = None
    gate: str = "estimate"

    def kappa_text(self) -> str:
        """The kappa with its interval, e.g. ``0.744 [0.60, 0.88]``."""
        if self.kappa is None:
            return "n/a"
        if self.kappa_low is None or self.kappa_high is None:
            return f"{self.kappa:.3f}"
        return f"{self.kappa:.3f} [{kappa_bound(self.kappa_low)}, {kappa_bound(self.kappa_high)}]"

    def to_json(self) -> JsonObject:
        return asdict(self)

    @staticmethod
    def from_json(data: JsonObject) -> "ValidationRecord":
        known = {f for f in ValidationRecord.__dataclass_fields__}
        return ValidationRecord(**{k: v for k, v in data.items() if k in known})


def kappa_bound(value: float) -> str:
    """A kappa interval bound, two decimals (no "-0.00" for float noise around 0)."""
    return f"{value + 0.0:.2f}".replace("-0.00", "0.00")




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


__all__ = ["VALIDATION_SUFFIX", "ValidationRecord", "find_record", "kappa_bound", "read_records", "validation_path",
           "write_record"]
