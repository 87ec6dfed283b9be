"""Rubric versions that survive a judge restart.

With ``rubric_state_dir=DIR`` (default ``none``: in memory only) the judge server keeps in ``DIR``

- ``<hash>.yaml``: the text of every current and retained version, written once (a superseded
  version's file is gone from the folder, so this copy is what a restarted server serves to the
  callers that pin it);
- ``state.json``: per rubric id, which version it points to, the retained versions with their
  retention clocks (``retires_at``, Unix seconds, so the retention time runs on across the
  restart), the retired ones (for the NOT_FOUND message), and each version's validation record.

Every write goes to a temporary file that is renamed over the old one, so a crash leaves the
previous state or the new one, never half of one. Nothing is written into the rubric folder (it may
be read-only, or tracked by git): its files are never written, moved or deleted. ``DIR`` belongs to
one server; two servers sharing one would overwrite each other's state. At start the server loads
the folder's files as before, then :meth:`VersionStore.restore` puts back what ``state.json`` holds
and reconciles the two
(:meth:`calibrl.judge_server.rubric_store.RubricVersions.restore`: a file that changed while the
server was down is a new version if it may be served, else it is refused and the persisted one
keeps serving). A persisted version is only put back when it still parses to the same hash and
this judge may still serve it (same model, validation record still passing); otherwise it is
dropped with a warning. A ``state.json`` that cannot be read is kept aside
(``state.json.unreadable-<time>``), logged as an error, and the server starts from the folder.
"""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import time
from typing import TYPE_CHECKING, Any

from calibrl.errors import ConfigError
from calibrl.judge_server.rubric import parse_rubric
from calibrl.judge_server.rubric_store import RubricVersions, Version
from calibrl.judge_server.validation_records import ValidationRecord
from calibrl.sme.store import atomic_write_text

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.judge_server.judge import Judge
    from calibrl.judge_server.rubric_store import Change

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
FORMAT = 1


class VersionStore:
    """The persisted versions of one rubric folder (see module doc)."""

    def __init__(self, rubric_folder: str | pathlib.Path, directory: str | pathlib.Path) -> None:
        self.folder = pathlib.Path(rubric_folder)
        self.directory = pathlib.Path(directory)
        self.path = self.directory / STATE_FILE
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ writing

    def save(self, versions: RubricVersions) -> None:
        """Write the served versions (called after every change). A failure is logged, never raised:
        the server keeps serving what it has in memory."""
        try:
            with self._lock:  # one writer at a time, each with the state at its own time
                snapshot = versions.snapshot()
                self.directory.mkdir(parents=True, exist_ok=True)
                keep = set()
                for rubric_id, entry in snapshot.items():
                    for record in [entry["current"], *entry["retained"]]:
                        if record is None:
                            continue
                        keep.add(record["hash"])
                        copy = self.directory / f"{record['hash']}.yaml"
                        if not copy.exists():
                            rubric = versions.by_hash(record["hash"])
                            atomic_write_text(copy, rubric.source_yaml)
                atomic_write_text(self.path, json.dumps({"format": FORMAT, "rubrics": snapshot}, indent=1,
                                                        sort_keys=True) + "\n")
                for copy in self.directory.glob("*.yaml"):
                    if copy.stem not in keep:
                        copy.unlink(missing_ok=True)
        except OSError as exc:
            log.error("rubric folder %s: could not persist the rubric versions in %s: %s; they are served from "
                      "memory and will be lost at a restart", self.folder, self.directory, exc)

    # ------------------------------------------------------------------ reading

    def read(self) -> dict[str, Any]:
        """The persisted state (empty when there is none, or when it cannot be read: kept aside)."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("rubrics"), dict):
                raise ValueError(f"expected {{'format': {FORMAT}, 'rubrics': {{...}}}}")
            return data["rubrics"]
        except (OSError, ValueError) as exc:
            aside = self.path.with_name(f"{STATE_FILE}.unreadable-{int(time.time())}")
            try:
                self.path.replace(aside)
            except OSError:
                aside = self.path
            log.error("rubric folder %s: the persisted rubric versions cannot be read (%s: %s), kept as %s; starting "
                      "from the folder's files only", self.folder, type(exc).__name__, exc, aside)
            return {}

    def restore(self, judge: "Judge") -> list["Change"]:
        """Put the persisted versions back into ``judge.versions`` (its retention time already set)."""
        changes: list["Change"] = []
        for rubric_id, entry in sorted(self.read().items()):
            try:
                current = self._version(judge, rubric_id, entry.get("current"), "current")
                retained = [v for v in (self._version(judge, rubric_id, r, "retained")
                                        for r in entry.get("retained", [])) if v is not None]
                retired = [self._retired(judge, rubric_id, r) for r in entry.get("retired", [])]
            except (KeyError, TypeError, ValueError) as exc:
                log.error("rubric %s: its persisted versions in %s are malformed (%s); starting it from its file",
                          rubric_id, self.path, exc)
                continue
            changes.extend(judge.versions.restore(rubric_id, current, retained, [v for v in retired if v],
                                                  entry.get("removed_at")))
            log.info("rubric %s: restored from %s: current %s, %d retained, %d retired", rubric_id, self.path,
                     "persisted" if current is not None else "from its file", len(retained), len(retired))
        return changes

    def _version(self, judge: "Judge", rubric_id: str, record: dict | None, state: str) -> Version | None:
        if record is None:
            return None
        rubric_hash = record["hash"]
        copy = self.directory / f"{rubric_hash}.yaml"
        try:
            rubric = parse_rubric(copy.read_text(encoding="utf-8"), record.get("source_path") or str(copy),
                                  self.folder)
        except (OSError, ConfigError) as exc:
            log.warning("rubric %s version %s: not restored, its saved text %s cannot be read: %s", rubric_id,
                        rubric_hash[:12], copy, exc)
            return None
        if rubric.hash != rubric_hash or rubric.id != rubric_id:
            log.warning("rubric %s version %s: not restored, its saved text %s now gives %s@%s (a file it reads changed)",
                        rubric_id, rubric_hash[:12], copy, rubric.id, rubric.hash[:12])
            return None
        validation = ValidationRecord.from_json(record["validation"]) if record.get("validation") else None
        status = judge.rubric_status(rubric, validation)
        if not status.usable:
            log.warning("rubric %s version %s: not restored, this judge may not serve it: %s", rubric_id,
                        rubric_hash[:12], status.reason)
            return None
        return Version(status, state, float(record["loaded_at"]), record.get("superseded_at"),
                       record.get("superseded_by", ""), record.get("retires_at"), record.get("reason", ""))

    def _retired(self, judge: "Judge", rubric_id: str, record: dict) -> Version | None:
        """A retired version, kept for its NOT_FOUND message (its text is not needed, nor kept)."""
        from calibrl.judge_server.rubric import Rubric
        from calibrl.judge_server.rubric_store import RubricStatus

        stub = _HashedStub(Rubric(id=rubric_id, version=record.get("rubric_version", ""), description="",
                                  criteria=(), tenants=tuple(record.get("tenants", ()))), record["hash"])
        return Version(RubricStatus(stub, None, False, "retired"), "retired", float(record["loaded_at"]),  # type: ignore[arg-type]
                       record.get("superseded_at"), record.get("superseded_by", ""), record.get("retires_at"),
                       record.get("reason", ""))


class _HashedStub:
    """A retired version's rubric: its id, label and hash (what the NOT_FOUND message names)."""

    def __init__(self, rubric: Any, rubric_hash: str) -> None:
        self._rubric = rubric
        self.hash = rubric_hash

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rubric, name)


__all__ = ["VersionStore"]
