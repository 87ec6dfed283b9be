"""The manifest of an index folder: what was built, from what, with which libraries,
and the SHA-256 of every file, checked before an index is served.

``encoder`` records what computed the passage vectors (backend, runtime version,
weights SHA-256, and the exporter's versions for ONNX): vectors from another encoder
differ by ~1e-7, so :func:`check_encoder` refuses to serve the index with one that
does not match. A manifest written before this field existed has ``encoder = {}``:
such an index was embedded by the torch backend, so it is served with torch and its
versions are not checked (a warning says so).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from calibrl.errors import FailedPrecondition
from calibrl.retrieval_server.corpus import file_sha256

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class Manifest:
    """Everything a server needs to trust and describe an index folder."""

    doc_count: int
    embedder: str
    dimension: int
    index_type: str
    corpus_sha256: str
    corpus_format: str
    library_versions: dict[str, str]
    params: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relative path -> {sha256, bytes}
    encoder: dict[str, str] = field(default_factory=dict)  # backend, version, weights_sha256 (module doc)
    created_at: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape an index's content."""
    from importlib import metadata

    versions = {}
    for dist in ("faiss-cpu", "faiss-gpu", "bm25s", "PyStemmer", "sentence-transformers", "transformers", "torch",
                 "onnxruntime", "onnx", "numpy", "calibrl"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def checksum_files(index_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, bytes}} of every file under ``index_dir`` except the manifest."""
    entries = {}
    for path in sorted(index_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            entries[path.relative_to(index_dir).as_posix()] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    return entries


def write_manifest(index_dir: pathlib.Path, manifest: Manifest) -> None:
    manifest.files = checksum_files(index_dir)
    (index_dir / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")


def read_manifest(index_dir: str | pathlib.Path) -> Manifest:
    """Parse ``manifest.json``; FailedPrecondition when it is missing or malformed."""
    index_dir = pathlib.Path(index_dir)
    path = index_dir / MANIFEST_FILE
    if not path.is_file():
        raise FailedPrecondition(f"{index_dir} is not an index folder: {MANIFEST_FILE} is missing "
                                 "(build one with `calibrl index build`)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format_version") != FORMAT_VERSION:
            raise FailedPrecondition(
                f"{path}: format_version {raw.get('format_version')!r}, this calibrl reads {FORMAT_VERSION}; "
                "rebuild the index"
            )
        names = {f.name for f in dataclasses.fields(Manifest)}
        return Manifest(**{k: v for k, v in raw.items() if k in names})
    except (json.JSONDecodeError, TypeError, AttributeError) as exc:
        raise FailedPrecondition(f"{path}: malformed manifest ({exc})") from None


def verify_files(index_dir: str | pathlib.Path, manifest: Manifest) -> list[str]:
    """Check every listed file's size and SHA-256. Raises FailedPrecondition naming each
    mismatch; returns the files present but not listed (reported, not fatal)."""
    index_dir = pathlib.Path(index_dir)
    problems = []
    for name, entry in sorted(manifest.files.items()):
        path = index_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {entry['bytes']}")
        elif file_sha256(path) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    if not manifest.files:
        problems.append("the manifest lists no files")
    if problems:
        raise FailedPrecondition(
            f"index folder {index_dir} does not match its manifest: " + "; ".join(problems)
            + ". Rebuild it with `calibrl index build`."
        )
    listed = set(manifest.files)
    return [
        path.relative_to(index_dir).as_posix()
        for path in sorted(index_dir.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE and path.relative_to(index_dir).as_posix() not in listed
    ]


LEGACY_ENCODER_BACKEND = "torch"  # what embedded an index whose manifest has no encoder record


def manifest_backend(manifest: Manifest) -> str:
    """The encoder backend that embedded the index (``torch`` for a manifest without the record)."""
    return manifest.encoder.get("backend", LEGACY_ENCODER_BACKEND)


def check_encoder(manifest: Manifest, served: dict[str, str], index_dir: Any = "") -> None:
    """Raise FailedPrecondition when ``served`` (``SentenceEmbedder.encoder_record()``) is not
    the encoder the index was built with; a manifest without the record is not checked."""
    import logging

    if not manifest.encoder:
        logging.getLogger(__name__).warning(
            "%s: the manifest does not record its encoder (built before calibrl recorded it); serving with %s, "
            "not checked. Rebuild the index to record it.", index_dir or "index", served.get("backend"))
        return
    differing = [f"{key}: index {manifest.encoder.get(key)!r}, server {served.get(key)!r}"
                 for key in sorted(set(manifest.encoder) | set(served)) if manifest.encoder.get(key) != served.get(key)]
    if differing:
        raise FailedPrecondition(
            f"index {index_dir or ''} was embedded by another encoder than this server runs ("
            + "; ".join(differing) + "): query vectors would not match the passage vectors bit for bit. "
            "Serve it with encoder_backend=" + manifest_backend(manifest) + " and the library versions it records, "
            "or rebuild the index with `calibrl index build`."
        )
