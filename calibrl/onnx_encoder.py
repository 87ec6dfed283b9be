"""MiniLM (any BERT-style encoder folder) on ONNX Runtime: texts of equal token length
run together, without padding, and a start-up self-test proves that this is invariant.

Export: the folder's weights are exported once with ``torch.onnx.export`` (a fresh
copy of the model, eager attention, dynamic batch and length) into a cache folder keyed
by the weights' SHA-256 and the exporter's versions (:func:`export_path`), written
atomically; nothing is downloaded. The graph takes ``input_ids`` only: no text is ever
padded, so the attention mask is all ones and the token types all zero.

Grouping: a batch of texts is tokenised, texts of the same token length go through one
forward pass (``(rows, length)``), and each row is pooled on its own. A group has no
padding, so a row can only change with its companions if a kernel's arithmetic
depends on the number of rows; ONNX Runtime's CPU kernels block over the inner
dimension independently of it (measured: ``benchmarks/bench_invariance.py --probe``),
and :func:`self_test` checks this on the machine and library that actually run:
if any bit differs, the encoder runs one text per forward pass instead (``per-text``).

Pooling and normalisation match the torch path (mean over the tokens, L2 norm); the
norm is computed exactly (``math.fsum`` in float64), so it never depends on a
vector kernel either.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger(__name__)

EXPORT_FORMAT = 1  # bump when the exported graph changes (inputs, opset, wrapper)
OPSET = 17
CACHE_ENV = "CALIBRL_CACHE_DIR"
MAX_GROUP_TOKENS = 8192  # rows x length of one forward pass at most (memory bound)
# Probe of the self-test: (token length, sequences) pairs; 16 rows cover the larger groups.
PROBE_SHAPES = ((3, 6), (9, 16), (24, 6), (61, 6), (128, 4))


def _cache_roots() -> list[pathlib.Path]:
    """Where graphs are cached: ``$CALIBRL_CACHE_DIR`` (else ``~/.cache/calibrl``), then the
    temporary folder for a home that cannot be written (a read-only container)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "calibrl")
    return [pathlib.Path(root).expanduser() / "onnx", pathlib.Path(tempfile.gettempdir()) / "calibrl" / "onnx"]


@functools.lru_cache(maxsize=8)
def weights_sha256(folder: str) -> str:
    """SHA-256 of the model's weights file (safetensors, else the PyTorch pickle)."""
    path = pathlib.Path(folder)
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            digest = hashlib.sha256()
            with open(path / name, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            return digest.hexdigest()
    raise FileNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin to export")


def exporter_versions() -> str:
    """The libraries that shape the exported graph, e.g. ``torch 2.13.0, transformers 5.24.0, opset 17``."""
    from importlib import metadata

    return f"torch {metadata.version('torch')}, transformers {metadata.version('transformers')}, opset {OPSET}"


def runtime_version() -> str:
    from importlib import metadata

    return f"onnxruntime {metadata.version('onnxruntime')}"


def export_path(folder: str) -> pathlib.Path:
    """Where the graph of ``folder`` is cached: keyed by weights hash + exporter versions
    (the first cache folder that holds it, else the first one)."""
    key = hashlib.sha256(f"{weights_sha256(folder)}|{exporter_versions()}|{EXPORT_FORMAT}".encode()).hexdigest()
    paths = [root / key[:32] / "encoder.onnx" for root in _cache_roots()]
    return next((path for path in paths if path.is_file()), paths[0])


def ensure_exported(folder: str) -> pathlib.Path:
    """The cached ONNX graph of ``folder``, exported first if it is not there yet (into the
    temporary folder when the cache folder cannot be written)."""
    target = export_path(folder)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=target.parent)
        probe.close()
    except OSError as exc:
        fallback = _cache_roots()[1] / target.parent.name / target.name
        log.warning("cannot write the ONNX cache %s (%s); exporting to %s", target.parent, exc, fallback)
        target = fallback
        if target.is_file():
            return target
    return _export(folder, target)


def _export(folder: str, target: pathlib.Path) -> pathlib.Path:
    import torch
    from transformers import AutoModel

    log.info("exporting %s to ONNX (once per weights and exporter version): %s", folder, target)
    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()

    class _LastHiddenState(torch.nn.Module):
        def __init__(self, encoder: Any) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: Any) -> Any:
            return self.encoder(input_ids=input_ids).last_hidden_state

    target.parent.mkdir(parents=True, exist_ok=True)
    sample = torch.tensor([[101, 2000, 2001, 102], [101, 2002, 2003, 102]])
    handle, staging = tempfile.mkstemp(prefix=".encoder-", suffix=".onnx", dir=target.parent)
    os.close(handle)
    try:
        import warnings

        with warnings.catch_warnings():  # the tracer's notes on shape-dependent Python branches
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _LastHiddenState(model), (sample,), staging, dynamo=False, opset_version=OPSET,
                input_names=["input_ids"], output_names=["last_hidden_state"],
                dynamic_axes={"input_ids": {0: "rows", 1: "tokens"}, "last_hidden_state": {0: "rows", 1: "tokens"}},
            )
        os.replace(staging, target)  # atomic: a concurrent process sees the whole file or none
    except BaseException:
        pathlib.Path(staging).unlink(missing_ok=True)
        raise
    return target


@functools.lru_cache(maxsize=8)
def load_session(graph: str, threads: int, spinning: bool) -> Any:
    """One ONNX Runtime CPU session per (graph, threads, spinning) in the process."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    # idle workers sleep instead of spinning (as OMP_WAIT_POLICY=PASSIVE does for torch)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def pool(hidden: Any, pooling: str, normalize: bool) -> Any:
    """(tokens, dimension) float32 -> (dimension,) float32: mean or CLS, then the exact L2 norm."""
    import numpy as np

    pooled = hidden[0].copy() if pooling == "cls" else hidden.sum(axis=0, dtype=np.float32) / np.float32(len(hidden))
    if not normalize:
        return pooled.astype(np.float32)
    wide = pooled.astype(np.float64)
    norm = math.sqrt(math.fsum((wide * wide).tolist()))
    return (wide / max(norm, 1e-12)).astype(np.float32)


@dataclass(frozen=True)
class SelfTest:
    """What the start-up self-test found (see the module doc)."""

    passed: bool
    rows_checked: int
    rows_differing: int
    threads: int

    @property
    def mode(self) -> str:
        return "equal-length groups" if self.passed else "per-text"

    def describe(self) -> str:
        verdict = "passed" if self.passed else f"FAILED ({self.rows_differing} of {self.rows_checked} rows differed)"
        return f"self-test {verdict} at {self.threads} thread(s): {self.mode}"


class OnnxRunner:
    """Runs an exported encoder graph on ONNX Runtime (see the module doc)."""

    def __init__(self, folder: str, tokenizer: Any, pooling: str, normalize: bool, max_tokens: int,
                 threads: int, spinning: bool) -> None:
        self.tokenizer = tokenizer
        self.pooling, self.normalize, self.max_tokens = pooling, normalize, max_tokens
        self.graph = ensure_exported(folder)
        self.session = load_session(str(self.graph), threads, spinning)
        self.threads = threads
        self.self_test = self_test(self)
        self.grouped = self.self_test.passed
        if not self.grouped:
            log.error("ONNX encoder %s: %s; every text now runs its own forward pass (slower, still "
                      "invariant)", folder, self.self_test.describe())

    def hidden(self, ids: Any) -> Any:
        """(rows, tokens) int64 -> (rows, tokens, dimension) float32."""
        return self.session.run(None, {"input_ids": ids})[0]

    def encode_ids(self, token_ids: Sequence[Sequence[int]], grouped: bool | None = None) -> list[Any]:
        """One unit vector per token sequence; equal lengths share a forward pass when ``grouped``."""
        import numpy as np

        grouped = self.grouped if grouped is None else grouped
        out: list[Any] = [None] * len(token_ids)
        by_length: dict[int, list[int]] = {}
        for row, ids in enumerate(token_ids):
            by_length.setdefault(len(ids), []).append(row)
        for length, rows in by_length.items():
            step = max(1, MAX_GROUP_TOKENS // max(1, length)) if grouped else 1
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                hidden = self.hidden(np.array([token_ids[r] for r in chunk], dtype=np.int64))
                for offset, row in enumerate(chunk):
                    out[row] = pool(hidden[offset], self.pooling, self.normalize)
        return out

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, truncated as the model is (the tokenizer is not
        thread-safe: callers that share it take turns; the forward passes need not)."""
        return self.tokenizer(list(texts), truncation=True, max_length=self.max_tokens)["input_ids"]

    def encode(self, texts: Sequence[str]) -> list[Any]:
        return self.encode_ids(self.tokenize(texts))


def probe_sequences(cls_id: int, sep_id: int, vocab_size: int) -> list[list[int]]:
    """The fixed, seeded token sequences of the self-test (:data:`PROBE_SHAPES`)."""
    import random

    rng = random.Random(1234)
    sequences = []
    for length, count in PROBE_SHAPES:
        for _ in range(count):
            middle = [rng.randrange(1000, min(vocab_size, 30000)) for _ in range(max(0, length - 2))]
            sequences.append([cls_id, *middle, sep_id][:length])
    return sequences


def self_test(runner: OnnxRunner) -> SelfTest:
    """Each probe sequence alone vs in mixed equal-length groups (whole, reversed, and
    shuffled with repeats), at the session's thread count; bitwise comparison."""
    import random

    tokenizer = runner.tokenizer
    sequences = probe_sequences(tokenizer.cls_token_id or 101, tokenizer.sep_token_id or 102,
                                int(getattr(tokenizer, "vocab_size", 30522)))
    alone = [v.tobytes() for v in runner.encode_ids(sequences, grouped=False)]
    rng = random.Random(5678)
    orders = [list(range(len(sequences))), list(reversed(range(len(sequences))))]
    orders.append([rng.randrange(len(sequences)) for _ in range(2 * len(sequences))])
    checked = differing = 0
    for order in orders:
        vectors = runner.encode_ids([sequences[i] for i in order], grouped=True)
        checked += len(order)
        differing += sum(1 for i, v in zip(order, vectors) if v.tobytes() != alone[i])
    return SelfTest(differing == 0, checked, differing, runner.threads)

