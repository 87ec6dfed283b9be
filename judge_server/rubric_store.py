"""Rubric versions served like model versions: immutable, named by content hash, swapped live.

A **version** of a rubric is its content (:attr:`Rubric.hash`, the SHA-256 of everything
that decides scores); it never changes. A rubric **id** points to its *current* version.
Callers name what they want in ``ScoreRequest.rubric_id``:

- ``query-rewriter``: the current version, whatever it is at the time of the call;
- ``query-rewriter@3f9a61c2d0b4``: a pinned version, by its hash or a unique prefix of at
  least :data:`MIN_VERSION_CHARS` hex characters (``ScoreRequest.rubric_hash`` pins the same
  way, by the full hash).

The semantics follow TensorFlow Serving's availability-preserving version transition: a new
version is loaded (checked, validated, a probe item scored) *before* it becomes current, and
the previous version is unloaded only afterwards. Unlike TF Serving's default ``latest``
policy, which unloads the old version at once, the previous version stays servable to pinned
callers for ``rubric_retention_s`` seconds (a running trainer pinned to it keeps working), and
is then retired: a call that pins it gets NOT_FOUND naming the id, the version, when and why it
was retired. A new version whose validation record for the served judge is missing or failed
is refused (logged, counted in ``calibrl_judge_rubric_versions_total{action="refused"}``,
reported by the ReloadRubrics admin call) and the current version keeps serving.

:class:`RubricVersions` is the table (thread-safe; one call resolves its version once, so it
never mixes versions). :class:`RubricFolder` rereads the rubric folder (a changed file or
validation record is a candidate version) for the server's poller and the admin call.
"""

from __future__ import annotations

import datetime
import logging
import pathlib
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Literal

from calibrl import telemetry
from calibrl.errors import CalibrlError, ConfigError, FailedPrecondition, InvalidArgument, NotFound
from calibrl.judge_server.rubric import Rubric, load_rubric, rubric_files
from calibrl.judge_server.validation_records import ValidationRecord, find_record, read_records, validation_path

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.judge_server.judge import Judge

log = logging.getLogger(__name__)

MIN_VERSION_CHARS = 8  # shortest hash prefix accepted as a version name
RETIRED_KEPT = 32  # retired versions remembered per rubric id (for the NOT_FOUND message)
_HEX = re.compile(r"^[0-9a-f]+$")

State = Literal["current", "retained", "retired", "refused"]
Action = Literal["loaded", "refused", "removed", "retired"]


def short(rubric_hash: str) -> str:
    """A version's name as shown in messages (the first 12 hex characters of its hash)."""
    return rubric_hash[:12]


def shown(value: str, limit: int = 140) -> str:
    """``repr`` of a caller-supplied identifier, cut so an error message stays small
    (gRPC status details travel in metadata, which has a hard size limit)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


@dataclass(frozen=True)
class RubricStatus:
    """A served rubric and whether (and why not) this judge may use it."""

    rubric: Rubric
    validation: ValidationRecord | None
    usable: bool
    reason: str

    @property
    def validated(self) -> bool:
        return self.validation is not None and self.validation.passed


def split_ref(ref: str) -> tuple[str, str]:
    """``"id"`` -> ``("id", "")``; ``"id@version"`` -> ``("id", "version")``, the version
    checked (lower-case hex, :data:`MIN_VERSION_CHARS` to 64 characters)."""
    rubric_id, at, version = ref.partition("@")
    if not at:
        return ref, ""
    version = version.lower()
    if not _HEX.match(version) or not MIN_VERSION_CHARS <= len(version) <= 64:
        shown = version if len(version) <= 70 else version[:70] + "..."
        raise InvalidArgument("rubric_id", f"version {shown!r} after '@' must be the rubric's content hash or a "
                              f"prefix of it: {MIN_VERSION_CHARS} to 64 hex characters (ListRubrics shows them)")
    if not rubric_id:
        raise InvalidArgument("rubric_id", "empty id before '@'; write <rubric id>@<version>")
    return rubric_id, version


def _iso(timestamp: float | None) -> str:
    if timestamp is None:
        return "never"
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).replace(microsecond=0).isoformat()


@dataclass(frozen=True)
class Version:
    """One version of a rubric and its place in the life cycle (times are Unix seconds)."""

    status: "RubricStatus"
    state: State
    loaded_at: float
    superseded_at: float | None = None  # when another version became current (or the file was removed)
    superseded_by: str = ""  # that version's hash ("" when the file was removed)
    retires_at: float | None = None  # retained: when it is retired
    reason: str = ""  # refused or retired: why

    @property
    def rubric(self) -> Rubric:
        return self.status.rubric

    @property
    def hash(self) -> str:
        return self.status.rubric.hash


@dataclass(frozen=True)
class Change:
    """What one reload did to one rubric version (the ReloadRubrics answer, the log line)."""

    rubric_id: str
    hash: str
    version: str  # the rubric file's version label
    action: Action
    reason: str
    source: str = ""


class RubricVersions:
    """Current, retained, retired and refused versions of every rubric id (see module doc)."""

    def __init__(self, statuses: Iterable["RubricStatus"], retention_s: float = 600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.retention_s = float(retention_s)
        self.clock = clock
        self._lock = threading.RLock()
        now = clock()
        self._current: dict[str, Version] = {}
        self._retained: dict[str, dict[str, Version]] = {}
        self._retired: dict[str, dict[str, Version]] = {}
        self._refused: dict[str, dict[str, Version]] = {}
        self._removed: dict[str, float] = {}  # rubric id -> when its file was removed
        # called (outside the lock) after every change of the served versions: the server persists them
        self.on_change: Callable[["RubricVersions"], None] | None = None
        for status in statuses:
            self._current[status.rubric.id] = Version(status, "current", now)

    # ------------------------------------------------------------------ reading

    def current(self, rubric_id: str) -> "RubricStatus | None":
        with self._lock:
            version = self._current.get(rubric_id)
            return version.status if version is not None else None

    def statuses(self) -> list["RubricStatus"]:
        """The current version of every rubric id, by id."""
        with self._lock:
            return [v.status for _, v in sorted(self._current.items())]

    def versions(self, rubric_id: str) -> list[Version]:
        """Every version of ``rubric_id`` this server knows: current first, then retained, refused
        and retired, newest first within each."""
        with self._lock:
            self._expire()
            out = [self._current[rubric_id]] if rubric_id in self._current else []
            for table in (self._retained, self._refused, self._retired):
                out.extend(sorted(table.get(rubric_id, {}).values(), key=lambda v: -v.loaded_at))
            return out

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(set(self._current) | set(self._retained))

    def by_hash(self, rubric_hash: str) -> Rubric:
        """The rubric of a version a call has resolved (also after it was retired: a call in a
        batch when its version retires still finishes with it)."""
        with self._lock:
            for version in self._current.values():
                if version.hash == rubric_hash:
                    return version.rubric
            for table in (self._retained, self._retired):
                for versions in table.values():
                    if rubric_hash in versions:
                        return versions[rubric_hash].rubric
        raise KeyError(rubric_hash)

    def lookup(self, ref: str, tenant: str | None = None, rubric_hash: str = "") -> "RubricStatus":
        """The version ``ref`` (``id`` or ``id@version``) and ``rubric_hash`` name, visible to
        ``tenant``; NotFound / InvalidArgument / FailedPrecondition naming what and why."""
        if not ref:
            raise InvalidArgument("rubric_id", "empty; name the rubric to use (ListRubrics shows them)")
        rubric_id = ref.partition("@")[0]
        with self._lock:
            self._expire()
            current = self._current.get(rubric_id)
            retained = self._retained.get(rubric_id, {})
            if current is None and not retained and rubric_id not in self._retired:
                raise NotFound(f"rubric {shown(ref)} not found")
            if current is not None and not current.rubric.visible_to(tenant):
                raise NotFound(f"rubric {shown(ref)} not found")
            version = split_ref(ref)[1]  # the id is known: a malformed version is the caller's mistake
            if not version and not rubric_hash:
                if current is None:
                    when = _iso(self._removed.get(rubric_id))
                    raise NotFound(f"rubric {rubric_id!r} has no current version: its file was removed from the "
                                   f"rubric folder at {when}; pinned versions stay servable for rubric_retention_s="
                                   f"{self.retention_s:g} s (ListRubrics shows them)")
                return current.status
            servable = ([current] if current is not None else []) + list(retained.values())
            if rubric_hash:
                matches = [v for v in servable if v.hash == rubric_hash]
                if version and matches and not matches[0].hash.startswith(version):
                    raise InvalidArgument("rubric_hash", f"{shown(rubric_hash)} is not version {version!r} named "
                                          f"in rubric_id {shown(ref)}")
            else:
                matches = [v for v in servable if v.hash.startswith(version)]
            wanted = version or rubric_hash
            if len(matches) > 1:
                raise InvalidArgument("rubric_id", f"version {wanted!r} of rubric {rubric_id!r} is ambiguous: "
                                      f"{', '.join(short(v.hash) for v in matches)}; give more characters")
            if matches:
                found = matches[0]
                if not found.rubric.visible_to(tenant):
                    raise NotFound(f"rubric {shown(rubric_id)} not found")
                return found.status
            retired = [v for v in self._retired.get(rubric_id, {}).values() if v.hash.startswith(wanted)]
            if retired:
                v = retired[0]
                raise NotFound(f"rubric {rubric_id!r} version {short(v.hash)} was retired at {_iso(v.retires_at)}: "
                               f"{v.reason}; ask for {rubric_id!r} (its current version) or pin a served version "
                               "(ListRubrics shows them)")
            refused = [v for v in self._refused.get(rubric_id, {}).values() if v.hash.startswith(wanted)]
            if refused:
                raise FailedPrecondition(f"rubric {rubric_id!r} version {short(refused[0].hash)} was refused: "
                                         f"{refused[0].reason}")
            served = ", ".join(short(v.hash) for v in servable) or "none"
            if rubric_hash and not version:
                current_hash = current.hash if current is not None else "none"
                raise InvalidArgument("rubric_hash", f"{shown(rubric_hash)} does not match the served rubric "
                                      f"{rubric_id!r} (hash {current_hash}; servable versions: {served})")
            raise NotFound(f"rubric {rubric_id!r} has no version {wanted!r} (servable versions: {served})")

    # ------------------------------------------------------------------ changing

    def install(self, status: "RubricStatus", source: str = "") -> Change:
        """Make ``status`` (usable, probed) the current version of its id; the previous one is
        retained for ``retention_s`` seconds."""
        rubric = status.rubric
        with self._lock:
            now = self.clock()
            previous = self._current.get(rubric.id)
            self._retained.get(rubric.id, {}).pop(rubric.hash, None)
            self._refused.get(rubric.id, {}).pop(rubric.hash, None)
            self._retired.get(rubric.id, {}).pop(rubric.hash, None)
            self._removed.pop(rubric.id, None)
            if previous is not None and previous.hash != rubric.hash:
                self._retain(previous, now, rubric.hash)
            self._current[rubric.id] = Version(status, "current", now)
            self._expire(now)
        self._persist()
        was = f"replacing {short(previous.hash)}" if previous is not None and previous.hash != rubric.hash else "new"
        return self._changed(Change(rubric.id, rubric.hash, rubric.version, "loaded",
                                    f"current version ({was}); {status.reason}", source))

    def refuse(self, status: "RubricStatus", reason: str, source: str = "") -> Change:
        """Record a refused candidate version; the current version (if any) keeps serving. A rubric
        id with no version yet gets the refused one as its (unusable) current version, as at start-up,
        so Score says FAILED_PRECONDITION with the reason."""
        rubric = status.rubric
        with self._lock:
            now = self.clock()
            current = self._current.get(rubric.id)
            if current is None and not self._retained.get(rubric.id):
                self._current[rubric.id] = Version(replace(status, usable=False, reason=reason), "current", now)
            elif current is not None and current.hash == rubric.hash:
                pass  # the current version's validation changed: it keeps serving as it was loaded
            else:
                table = self._refused.setdefault(rubric.id, {})
                table[rubric.hash] = Version(status, "refused", now, reason=reason)
                _trim(table)
        return self._changed(Change(rubric.id, rubric.hash, rubric.version, "refused", reason, source))

    def remove(self, rubric_id: str, source: str = "") -> Change | None:
        """The id's file is gone: its current version is retained (pinned callers keep working)
        and unpinned calls get NOT_FOUND saying so."""
        with self._lock:
            now = self.clock()
            current = self._current.pop(rubric_id, None)
            if current is None:
                return None
            self._removed[rubric_id] = now
            self._retain(current, now, "")
        self._persist()
        return self._changed(Change(rubric_id, current.hash, current.rubric.version, "removed",
                                    f"the file was removed; version {short(current.hash)} stays servable to pinned "
                                    f"callers for {self.retention_s:g} s", source))

    def expire(self) -> list[Change]:
        """Retire every retained version whose retention has passed."""
        with self._lock:
            changes = self._expire()
        if changes:
            self._persist()
        return changes

    def _persist(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    # ------------------------------------------------------------------ persisted across restarts

    def snapshot(self) -> dict:
        """What a restart needs (calibrl.judge_server.version_store): per rubric id, its current
        version (when usable), its retained versions with their retention clock, its retired ones."""
        with self._lock:
            out: dict[str, dict] = {}
            for rubric_id in sorted(set(self._current) | set(self._retained) | set(self._retired)):
                current = self._current.get(rubric_id)
                out[rubric_id] = {
                    "current": _version_json(current) if current is not None and current.status.usable else None,
                    "removed_at": self._removed.get(rubric_id),
                    "retained": [_version_json(v) for v in self._retained.get(rubric_id, {}).values()],
                    "retired": [_version_json(v) for v in self._retired.get(rubric_id, {}).values()],
                }
            return out

    def restore(self, rubric_id: str, current: Version | None, retained: Iterable[Version],
                retired: Iterable[Version], removed_at: float | None = None) -> list[Change]:
        """Put back what a snapshot held for ``rubric_id`` (rebuilt by the caller), reconciled with
        the version the folder's file gives now (this table's current one, loaded at start):

        - the file gives the persisted current version: it keeps its load time;
        - the file gives another version this judge may serve: that one is current and the
          persisted one is retained from now on (as a reload would have done);
        - the file gives a version this judge may not serve (not validated...), or the file is gone
          while the persisted version was current: the persisted version stays current (a refused
          candidate never replaces a served version) or, with the file gone, is retained;
        - retained versions keep their retention clock: those past it are retired now."""
        changes: list[Change] = []
        with self._lock:
            now = self.clock()
            from_file = self._current.get(rubric_id)
            if current is not None:
                if from_file is not None and from_file.hash == current.hash:
                    self._current[rubric_id] = replace(from_file, loaded_at=current.loaded_at)
                elif from_file is not None and from_file.status.usable:
                    self._retain(current, now, from_file.hash)
                    changes.append(Change(rubric_id, from_file.hash, from_file.rubric.version, "loaded",
                                          f"current version (its file changed while the server was down, "
                                          f"replacing {short(current.hash)})"))
                elif from_file is not None:
                    self._current[rubric_id] = current
                    table = self._refused.setdefault(rubric_id, {})
                    table[from_file.hash] = replace(from_file, state="refused", reason=from_file.status.reason)
                    changes.append(Change(rubric_id, from_file.hash, from_file.rubric.version, "refused",
                                          from_file.status.reason))
                else:
                    self._removed[rubric_id] = removed_at or now
                    self._retain(current, now, "")
            elif removed_at is not None and from_file is None:
                self._removed[rubric_id] = removed_at
            served = self._current.get(rubric_id)
            for version in retained:
                if served is None or version.hash != served.hash:
                    self._retained.setdefault(rubric_id, {}).setdefault(version.hash, version)
            for version in retired:
                if served is None or version.hash != served.hash:
                    self._retired.setdefault(rubric_id, {})[version.hash] = version
            changes.extend(self._expire(now))
        for change in changes:
            if change.action != "retired":  # _expire logged those
                self._changed(change)
        return changes

    def _retain(self, version: Version, now: float, by: str) -> None:
        if not version.status.usable:
            return  # a version that never served has no caller to keep working
        table = self._retained.setdefault(version.rubric.id, {})
        table[version.hash] = replace(version, state="retained", superseded_at=now, superseded_by=by,
                                      retires_at=now + self.retention_s)

    def _expire(self, now: float | None = None) -> list[Change]:
        now = self.clock() if now is None else now
        changes = []
        for rubric_id, table in list(self._retained.items()):
            for rubric_hash, version in list(table.items()):
                if version.retires_at is None or version.retires_at > now:
                    continue
                del table[rubric_hash]
                what = (f"superseded by version {short(version.superseded_by)} at {_iso(version.superseded_at)}"
                        if version.superseded_by else f"its file was removed at {_iso(version.superseded_at)}")
                reason = f"{what} and kept for rubric_retention_s={self.retention_s:g} s"
                retired = self._retired.setdefault(rubric_id, {})
                retired[rubric_hash] = replace(version, state="retired", reason=reason)
                _trim(retired)
                changes.append(Change(rubric_id, rubric_hash, version.rubric.version, "retired", reason))
            if not table:
                del self._retained[rubric_id]
        for change in changes:
            self._changed(change)
        return changes

    @staticmethod
    def _changed(change: Change) -> Change:
        telemetry.record("judge_rubric_versions", 1, rubric=change.rubric_id, action=change.action)
        line = "rubric %s version %s (%s): %s: %s"
        args = (change.rubric_id, short(change.hash), change.version, change.action.upper(), change.reason)
        if change.action == "refused":
            log.error(line, *args)
        else:
            log.info(line, *args)
        return change


def _version_json(version: Version) -> dict:
    record = version.status.validation
    return {"hash": version.hash, "rubric_version": version.rubric.version, "source_path": version.rubric.source_path,
            "tenants": list(version.rubric.tenants), "loaded_at": version.loaded_at, "superseded_at": version.superseded_at,
            "superseded_by": version.superseded_by, "retires_at": version.retires_at, "reason": version.reason,
            "validation": record.to_json() if record is not None else None}


def _trim(table: dict[str, Version]) -> None:
    while len(table) > RETIRED_KEPT:
        del table[min(table, key=lambda h: table[h].loaded_at)]


class RubricFolder:
    """Rereads a rubric folder into a judge's :class:`RubricVersions` (the poller and the
    ReloadRubrics admin call share one, so reloads never overlap).

    A file or its validation record that changed since the last reload makes its content a
    candidate version: one whose content is already current is left alone; one that cannot be
    parsed, or whose validation record for the served judge is missing or failed, is refused;
    otherwise a probe item is scored with it and it becomes current. A file that disappeared
    removes its id (see :meth:`RubricVersions.remove`). A file with an id another file already
    has is refused."""

    def __init__(self, judge: "Judge", directory: str | pathlib.Path,
                 probe: Callable[["Judge", Rubric], None] | None = None) -> None:
        self.judge = judge
        self.directory = pathlib.Path(directory)
        self.probe = probe
        self._lock = threading.Lock()
        self._seen: dict[pathlib.Path, tuple] = {}
        self._ids: dict[pathlib.Path, str] = {}
        self._reported: set[tuple] = set()  # (path, signature) refusals already logged
        for path in self._files():
            self._seen[path] = self._signature(path)
        for status in judge.versions.statuses():
            if status.rubric.source_path:
                self._ids[pathlib.Path(status.rubric.source_path)] = status.rubric.id

    def _files(self) -> list[pathlib.Path]:
        try:
            return rubric_files(self.directory)
        except ConfigError:
            return []

    @staticmethod
    def _signature(path: pathlib.Path) -> tuple:
        out = []
        for p in (path, validation_path(path)):
            try:
                stat = p.stat()
                out.append((stat.st_mtime_ns, stat.st_size))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def reload(self, force: bool = False) -> list[Change]:
        """One pass over the folder; the changes it made (``force``: reconsider unchanged files,
        and report refusals again)."""
        with self._lock:
            changes: list[Change] = []
            files = self._files()
            present = set(files)
            for path in sorted(set(self._seen) - present):
                self._seen.pop(path, None)
                rubric_id = self._ids.pop(path, None)
                if rubric_id is not None and rubric_id not in self._ids.values():
                    change = self.judge.versions.remove(rubric_id, str(path))
                    if change is not None:
                        changes.append(change)
            for path in files:
                signature = self._signature(path)
                if not force and self._seen.get(path) == signature:
                    continue
                self._seen[path] = signature
                change = self._consider(path, signature, force)
                if change is not None:
                    changes.append(change)
            changes.extend(self.judge.versions.expire())
            return changes

    def _consider(self, path: pathlib.Path, signature: tuple, force: bool) -> Change | None:
        try:
            rubric = load_rubric(path)
            records = read_records(validation_path(path))
        except ConfigError as exc:
            if not force and (path, signature) in self._reported:
                return None
            self._reported.add((path, signature))
            stub = Rubric(id=path.stem, version="", description="", criteria=())
            change = Change(stub.id, "", "", "refused", f"{path}: {exc}", str(path))
            return RubricVersions._changed(change)
        owner = next((p for p, i in self._ids.items() if i == rubric.id and p != path and p.exists()), None)
        if owner is not None:
            return RubricVersions._changed(Change(rubric.id, rubric.hash, rubric.version, "refused",
                                                  f"{path}: rubric id {rubric.id!r} is already used by {owner}",
                                                  str(path)))
        self._ids[path] = rubric.id
        versions = self.judge.versions
        current = versions.current(rubric.id)
        record = find_record(records, rubric.hash, self.judge.scorer_id(rubric))
        status: RubricStatus = self.judge.rubric_status(rubric, record)
        if current is not None and current.rubric.hash == rubric.hash and (current.usable or not status.usable):
            return None  # unchanged content (a touched file, a record of another model)
        if not status.usable:
            if not force and (path, signature) in self._reported:
                return None
            self._reported.add((path, signature))
            return versions.refuse(status, status.reason, str(path))
        if self.probe is not None:
            try:
                self.probe(self.judge, rubric)
            except CalibrlError as exc:
                return versions.refuse(status, f"the probe item could not be scored: {exc}", str(path))
        return versions.install(status, str(path))


# --------------------------------------------------------------------------- the server's side

def versions_to_proto(judge: "Judge", rubric_id: str, tenant: str | None = None) -> list:
    """``RubricVersion`` messages of every version of ``rubric_id`` that ``tenant`` may see."""
    from calibrl.v1 import judge_pb2 as pb

    return [pb.RubricVersion(hash=v.hash, version=v.rubric.version, state=v.state, validated=v.status.validated,
                             loaded_at=v.loaded_at, retires_at=v.retires_at or 0.0, reason=v.reason)
            for v in judge.versions.versions(rubric_id) if v.rubric.visible_to(tenant)]


async def reload_call(folder: RubricFolder | None, tenant: str | None, admin_tenants: Iterable[str]):
    """The ReloadRubrics admin call: authorise ``tenant``, reread the folder, say what changed."""
    import asyncio

    from calibrl.errors import PermissionDenied
    from calibrl.v1 import judge_pb2 as pb

    if tenant is None:
        raise PermissionDenied("ReloadRubrics needs an API key: start the judge with serving.api_keys_file and "
                               "list the caller's tenant in rubric_admin_tenants")
    if tenant not in set(admin_tenants):
        raise PermissionDenied(f"ReloadRubrics: tenant {tenant!r} is not in rubric_admin_tenants")
    if folder is None:
        raise FailedPrecondition("ReloadRubrics: this judge was not started from a rubrics folder")
    changes = await asyncio.to_thread(folder.reload, True)
    return pb.ReloadRubricsResponse(changes=[
        pb.RubricVersionChange(rubric_id=c.rubric_id, hash=c.hash, version=c.version, action=c.action,
                               reason=c.reason, source=c.source) for c in changes])


class RubricPoller:
    """Rereads a :class:`RubricFolder` every ``interval_s`` seconds on the server's event loop
    (the reread runs in a worker thread, so calls keep being served meanwhile)."""

    def __init__(self, folder: RubricFolder, interval_s: float) -> None:
        self.folder = folder
        self.interval_s = interval_s
        self._task = None

    def start(self) -> None:
        import asyncio

        if self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rubric-poller")

    async def _run(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.folder.reload)
            except Exception:  # noqa: BLE001 - a bad folder state must not stop the poller or the server
                log.exception("rubric folder %s: reload failed; the served versions are unchanged",
                              self.folder.directory)

    async def stop(self) -> None:
        import asyncio

        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
