"""MiniLM (any BERT-style encoder folder) on ONNX Runtime: texts share forward passes, and a
start-up self-test proves that a text's vector is bitwise the same as when it runs alone.

Export: the folder's weights are exported once with ``torch.onnx.export`` (a fresh
copy of the model, eager attention, dynamic batch and length) into a cache folder keyed
by the weights' SHA-256, the exporter's versions and :data:`EXPORT_FORMAT`
(:func:`export_path`), written atomically; nothing is downloaded. The graph takes
``input_ids`` and ``attention_mask``; token types are all zero.

Reference: a text alone, unpadded (mask all ones): the vector calibrl serves. Grouping,
in the mode the self-test proved (best first):

- ``padded buckets``: a text is padded at the end to its bucket length (:data:`BUCKETS`,
  the first at or above its token count) with the mask zero there, and texts of one bucket
  share a forward pass; each row is pooled over its own tokens only. Padding at the end
  leaves a row's arithmetic unchanged where the kernels add the masked positions' exact
  zeros after the real ones (measured: ``benchmarks/probe_padded_encoder.py``).
- ``equal-length groups``: texts of the same token length share a pass, without padding;
  a row can only change with its companions if a kernel's arithmetic depends on the
  number of rows; ONNX Runtime's CPU kernels block over the inner dimension independently
  of it (``benchmarks/bench_invariance.py --probe``).
- ``per-text``: every text runs alone.

:func:`self_test` checks each mode on the machine and library that actually run, against
the reference, bit for bit; a mode with any differing bit is not used (logged).

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

EXPORT_FORMAT = 2  # bump when the exported graph changes (inputs, opset, wrapper); 2: attention_mask input
OPSET = 17
CACHE_ENV = "CALIBRL_CACHE_DIR"
MAX_GROUP_TOKENS = 8192  # rows x length of one forward pass at most (memory bound)
# Probe of the self-test: (token length, sequences) pairs; 16 rows cover the larger groups, and
# several lengths share a bucket (9 and 12 in 16, 50 and 61 in 64) so padded groups mix them.
PROBE_SHAPES = ((3, 6), (9, 16), (12, 6), (24, 6), (50, 4), (61, 6), (128, 4))
# Padded lengths of the ``padded buckets`` mode; a text longer than the last runs unpadded.
BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MODES = ("padded buckets", "equal-length groups", "per-text")


def bucket(length: int) -> int:
    """The padded length of a text of ``length`` tokens (its own length past the last bucket)."""
    return next((b for b in BUCKETS if b >= length), length)


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

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    target.parent.mkdir(parents=True, exist_ok=True)
    sample = (torch.tensor([[101, 2000, 2001, 102], [101, 2002, 102, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    handle, staging = tempfile.mkstemp(prefix=".encoder-", suffix=".onnx", dir=target.parent)
    os.close(handle)
    try:
        import warnings

        with warnings.catch_warnings():  # the tracer's notes on shape-dependent Python branches
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _LastHiddenState(model), sample, staging, dynamo=False, opset_version=OPSET,
                input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                dynamic_axes={name: {0: "rows", 1: "tokens"}
                              for name in ("input_ids", "attention_mask", "last_hidden_state")},
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
    """What the start-up self-test found (see the module doc): per grouped mode, the rows
    checked against the reference and how many differed."""

    passed: bool  # equal-length groups
    rows_checked: int
    rows_differing: int
    threads: int
    padded_passed: bool = False
    padded_rows_checked: int = 0
    padded_rows_differing: int = 0

    @property
    def mode(self) -> str:
        return MODES[0] if self.padded_passed else MODES[1] if self.passed else MODES[2]

    def describe(self) -> str:
        """One line: "self-test passed at N thread(s): MODE" when padded buckets passed; what
        failed, with its rows, otherwise."""
        if self.padded_passed:
            return f"self-test passed at {self.threads} thread(s): {self.mode}"
        padded = f"padded buckets FAILED ({self.padded_rows_differing} of {self.padded_rows_checked} rows differed)"
        if self.passed:
            return f"self-test passed at {self.threads} thread(s) for equal-length groups, {padded}: {self.mode}"
        return (f"self-test FAILED ({self.rows_differing} of {self.rows_checked} rows differed in equal-length groups; "
                f"{padded}) at {self.threads} thread(s): {self.mode}")


class OnnxRunner:
    """Runs an exported encoder graph on ONNX Runtime (see the module doc)."""

    def __init__(self, folder: str, tokenizer: Any, pooling: str, normalize: bool, max_tokens: int,
                 threads: int, spinning: bool) -> None:
        self.tokenizer = tokenizer
        self.pooling, self.normalize, self.max_tokens = pooling, normalize, max_tokens
        self.graph = ensure_exported(folder)
        self.session = load_session(str(self.graph), threads, spinning)
        self.threads = threads
        self._unpadded_groups = False  # the self-test checks padding alone
        self.self_test = self_test(self)
        self.mode = self.self_test.mode
        # a padded-bucket group whose texts all have one length runs unpadded: an equal-length
        # group, proven by the same self-test (a lone text is its own reference)
        self._unpadded_groups = self.self_test.passed
        if self.mode != MODES[0]:  # still invariant, but texts share fewer forward passes (slower)
            log.log(logging.ERROR if self.mode == MODES[2] else logging.WARNING, "ONNX encoder %s: %s", folder,
                    self.self_test.describe())

    @property
    def grouped(self) -> bool:
        """Whether texts share forward passes (any mode but ``per-text``)."""
        return self.mode != MODES[2]

    def hidden(self, ids: Any, mask: Any) -> Any:
        """(rows, tokens) int64 ids and mask -> (rows, tokens, dimension) float32."""
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

    def encode_ids(self, token_ids: Sequence[Sequence[int]], mode: str | None = None) -> list[Any]:
        """One unit vector per token sequence, its texts grouped as ``mode`` says (default:
        the mode the self-test proved)."""
        import numpy as np

        mode = self.mode if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: one of {MODES}")
        out: list[Any] = [None] * len(token_ids)
        groups: dict[int, list[int]] = {}
        for row, ids in enumerate(token_ids):
            width = bucket(len(ids)) if mode == MODES[0] else len(ids)
            groups.setdefault(width, []).append(row)
        for width, rows in groups.items():
            step = max(1, MAX_GROUP_TOKENS // max(1, width)) if mode != MODES[2] else 1
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                lengths = {len(token_ids[row]) for row in chunk}
                columns = lengths.pop() if self._unpadded_groups and len(lengths) == 1 else width
                ids_array = np.zeros((len(chunk), columns), dtype=np.int64)
                mask = np.zeros((len(chunk), columns), dtype=np.int64)
                for offset, row in enumerate(chunk):
                    ids_array[offset, : len(token_ids[row])] = token_ids[row]
                    mask[offset, : len(token_ids[row])] = 1
                hidden = self.hidden(ids_array, mask)
                for offset, row in enumerate(chunk):
                    out[row] = pool(hidden[offset, : len(token_ids[row])], self.pooling, self.normalize)
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
    """Each probe sequence alone (the reference) vs in mixed groups (whole, reversed, and
    shuffled with repeats), in each grouped mode, at the session's thread count; bitwise."""
    import random

    tokenizer = runner.tokenizer
    sequences = probe_sequences(tokenizer.cls_token_id or 101, tokenizer.sep_token_id or 102,
                                int(getattr(tokenizer, "vocab_size", 30522)))
    alone = [v.tobytes() for v in runner.encode_ids(sequences, mode=MODES[2])]
    rng = random.Random(5678)
    orders = [list(range(len(sequences))), list(reversed(range(len(sequences))))]
    orders.append([rng.randrange(len(sequences)) for _ in range(2 * len(sequences))])
    found = {}
    for mode in MODES[:2]:
        checked = differing = 0
        for order in orders:
            vectors = runner.encode_ids([sequences[i] for i in order], mode=mode)
            checked += len(order)
            differing += sum(1 for i, v in zip(order, vectors) if v.tobytes() != alone[i])
        found[mode] = (checked, differing)
    (padded_checked, padded_differing), (checked, differing) = found[MODES[0]], found[MODES[1]]
    return SelfTest(differing == 0, checked, differing, runner.threads,
                    padded_passed=padded_differing == 0, padded_rows_checked=padded_checked,
                    padded_rows_differing=padded_differing)
