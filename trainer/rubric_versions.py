"""Which rubric version scored each step, and the ``rubric_changed`` event when it moves.

The judge names the version behind every score (``ItemScore.rubric_hash``, the content
hash; ``ScoreResponse.rubric_version`` on the wire). A run that asks for a rubric by id
(``reward.rubric_id=query-rewriter``) follows the id's current version, which the judge
may swap mid-run; a run that pins it (``reward.rubric_id=query-rewriter@3f9a61c2d0b4``)
is scored by that version only, so its rewards are reproducible exactly.

:class:`RubricVersionLog` writes ``rubric_versions.jsonl`` in the run folder (rank 0): one
``rubric_version`` record for the first step of each (rubric id, version), and a
``rubric_changed`` record, logged as a warning, whenever a step was scored by another
version than the step before (``review.on_alarm=downweight`` adds its ``rubric_downweighted`` and
``rubric_weight_restored`` records, :mod:`calibrl.trainer.rubric_weight`). Its step metrics: ``rubric/versions`` (distinct versions
that scored the step; more than 1 means the swap happened within the step, between two
calls) and ``rubric/changed`` (1 on a step whose version differs from the previous one).
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Iterable

log = logging.getLogger(__name__)

FILE_NAME = "rubric_versions.jsonl"
VERSION_EVENTS = ("rubric_version", "rubric_changed")  # the others: calibrl.trainer.rubric_weight's


class RubricVersionLog:
    """Follows the rubric versions of a run's steps (see module doc)."""

    def __init__(self, run_dir: str | pathlib.Path | None, resume_step: int = 0) -> None:
        self.path = pathlib.Path(run_dir) / FILE_NAME if run_dir else None
        self.last: dict[str, tuple[str, ...]] = {}  # rubric id -> the versions of the last step it scored
        if self.path is not None and self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    if record["step"] <= resume_step:
                        kept.append(line + "\n")
                        if record["event"] in VERSION_EVENTS:
                            self.last[record["rubric_id"]] = tuple(record["versions"])
            self.path.write_text("".join(kept), encoding="utf-8")

    def observe(self, step: int, scores: Iterable[object]) -> dict[str, float]:
        """Record the versions of a step's rubric scores (``ItemScore``s; None entries skipped); the
        step's metrics (none when no rubric scored the step)."""
        seen: dict[str, dict[str, str]] = {}
        for score in scores:
            if score is None or not getattr(score, "rubric_hash", ""):
                continue
            seen.setdefault(score.rubric_id, {})[score.rubric_hash] = score.model_id  # type: ignore[attr-defined]
        changed = 0.0
        for rubric_id, versions in sorted(seen.items()):
            now = tuple(sorted(versions))
            before = self.last.get(rubric_id)
            if before == now:
                continue
            event = "rubric_version" if before is None else "rubric_changed"
            if before is not None:
                changed = 1.0
                log.warning("step %d: rubric_changed: rubric %s was scored by version %s, the step before by %s",
                            step, rubric_id, ", ".join(h[:12] for h in now), ", ".join(h[:12] for h in before))
            self._write({"step": step, "event": event, "rubric_id": rubric_id, "versions": list(now),
                         "previous": list(before or ()), "model_ids": sorted(set(versions.values()))})
            self.last[rubric_id] = now
        if not seen:
            return {}  # no rubric scored this step: the metrics are undefined, so absent
        return {"rubric/versions": float(sum(len(v) for v in seen.values())), "rubric/changed": changed}

    def event(self, record: dict) -> None:
        """Append another event of the run's rubric (a record with ``step``, ``event``, ``rubric_id``)."""
        self._write(record)

    def _write(self, record: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")


def read_versions(run_dir: str | pathlib.Path) -> list[dict]:
    """The records of a run's ``rubric_versions.jsonl`` (none when it does not exist)."""
    path = pathlib.Path(run_dir) / FILE_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
