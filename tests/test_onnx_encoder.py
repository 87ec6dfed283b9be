"""The ONNX Runtime encoder (calibrl.onnx_encoder): padded buckets and equal-length groups
are bitwise the vector of each text alone, the start-up self-test falls back to equal-length
groups when padding moves a bit and to one text per pass when a kernel is batch-dependent,
the export is cached by weights hash, vectors agree with the torch path to float32 rounding,
and an index refuses a server with another encoder."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest

from tests.conftest import torch_threads_one

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from calibrl import onnx_encoder  # noqa: E402
from calibrl.embedding import SentenceEmbedder  # noqa: E402
from calibrl.errors import ConfigError, FailedPrecondition  # noqa: E402

one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)

# Several texts of one token length (so groups form), and lengths that differ.
SAME_LENGTH = ["who directed the film", "who wrote the book", "who painted the picture", "who founded the city"]
TEXTS = SAME_LENGTH + [
    "Mozart", "Which antibiotic did Alexander Fleming discover in 1928, and what did it change in medicine?",
    "iron tower in Paris", "green pigment " * 40, "programming language by Guido van Rossum",
]


@pytest.fixture(scope="module")
def onnx_embedder():
    return SentenceEmbedder(None, device="cpu", backend="onnx", cache_size=0)


def test_texts_of_one_bucket_really_share_a_forward_pass(onnx_embedder, monkeypatch):
    tokenizer = onnx_embedder._tokenizer
    lengths = {len(tokenizer(t)["input_ids"]) for t in SAME_LENGTH}
    assert len(lengths) == 1, "the probe texts must have one token length"
    runner = onnx_embedder._onnx
    if not runner.self_test.padded_passed:  # invariance is the CPU's and library's: the fallback is tested below
        pytest.skip(f"padded buckets are not invariant here ({runner.self_test.describe()})")
    assert runner.mode == "padded buckets" and runner.self_test.passed
    shapes = []
    real = runner.hidden
    monkeypatch.setattr(runner, "hidden", lambda ids, mask: (shapes.append((ids.shape, int(mask.sum()))),
                                                             real(ids, mask))[1])
    onnx_embedder.encode(TEXTS)
    token_counts = [len(tokenizer(t)["input_ids"]) for t in TEXTS]
    buckets = {onnx_encoder.bucket(n) for n in token_counts}
    assert len(buckets) < len(set(token_counts)), "the texts must have lengths that share a bucket"
    expected = set()
    for b in buckets:
        members = [n for n in token_counts if onnx_encoder.bucket(n) == b]
        width = members[0] if len(set(members)) == 1 else b  # one length: an equal-length group, unpadded
        expected.add(((len(members), width), sum(members)))
    assert any(len({n for n in token_counts if onnx_encoder.bucket(n) == b}) > 1 for b in buckets), \
        "some bucket must mix lengths (a padded pass)"
    assert set(shapes) == expected and len(shapes) == len(buckets)  # one pass per bucket; the mask covers the tokens


def test_equal_length_mode_groups_by_token_length_without_padding(onnx_embedder, monkeypatch):
    tokenizer = onnx_embedder._tokenizer
    runner = onnx_embedder._onnx
    shapes = []
    real = runner.hidden
    monkeypatch.setattr(runner, "hidden", lambda ids, mask: (shapes.append(ids.shape), real(ids, mask))[1])
    ids = runner.tokenize(TEXTS)
    vectors = runner.encode_ids(ids, mode="equal-length groups")
    token_counts = [len(tokenizer(t)["input_ids"]) for t in TEXTS]
    assert set(shapes) == {(token_counts.count(n), n) for n in set(token_counts)}
    alone = runner.encode_ids(ids, mode="per-text")
    assert [v.tobytes() for v in vectors] == [v.tobytes() for v in alone]
    with pytest.raises(ValueError, match="mode="):
        runner.encode_ids(ids, mode="grouped")


def test_onnx_vectors_are_the_same_alone_and_in_any_batch(onnx_embedder):
    alone = {text: onnx_embedder.encode([text])[0].tobytes() for text in TEXTS}
    rng = random.Random(7)
    for seed in range(8):
        batch = [rng.choice(TEXTS) for _ in range(rng.randint(2, 3 * len(TEXTS)))]
        vectors = onnx_embedder.encode(batch, batch_size=[1, 3, 64][seed % 3])
        assert [v.tobytes() for v in vectors] == [alone[t] for t in batch], f"composition {seed}"


def test_onnx_vectors_match_torch_to_float32_rounding(onnx_embedder):
    """Another kernel order, the same function: unit vectors agree to a few float32 ulps
    (2e-6 allows about 30 ulps of a 0.06-sized component; measured max 1.7e-7)."""
    torch_embedder = SentenceEmbedder(None, device="cpu", backend="torch", cache_size=0)
    onnx_vectors, torch_vectors = onnx_embedder.encode(TEXTS), torch_embedder.encode(TEXTS)
    assert np.abs(onnx_vectors - torch_vectors).max() < 2e-6
    norms = np.linalg.norm(onnx_vectors.astype(np.float64), axis=1)
    assert np.all(np.abs(norms - 1.0) < 1e-6)


def test_self_test_falls_back_to_one_text_per_pass_when_a_kernel_depends_on_the_batch(onnx_embedder, monkeypatch,
                                                                                      caplog):
    """A kernel whose arithmetic depends on the number of rows (simulated: the last bit of
    every value moves in a pass of several rows) must be caught and never used grouped."""
    real = onnx_encoder.OnnxRunner.hidden

    def batch_dependent(self, ids, mask):
        hidden = real(self, ids, mask)
        return np.nextafter(hidden, np.float32(np.inf)) if len(ids) > 1 else hidden

    monkeypatch.setattr(onnx_encoder.OnnxRunner, "hidden", batch_dependent)
    layout = onnx_embedder._layout
    with caplog.at_level(logging.ERROR, logger="calibrl.onnx_encoder"):
        runner = onnx_encoder.OnnxRunner(str(onnx_embedder.path), onnx_embedder._tokenizer, layout.pooling,
                                         layout.normalize, layout.max_tokens, threads=1, spinning=False)
    assert not runner.self_test.passed and runner.self_test.rows_differing > 0
    assert runner.self_test.mode == "per-text" and not runner.grouped
    assert "FAILED" in caplog.text and "per-text" in caplog.text
    alone = [runner.encode([t])[0].tobytes() for t in SAME_LENGTH]
    assert [v.tobytes() for v in runner.encode(SAME_LENGTH)] == alone  # per text: invariant again


def test_self_test_keeps_equal_length_groups_when_padding_moves_a_bit(onnx_embedder, monkeypatch, caplog):
    """A kernel whose arithmetic depends on padding (simulated: the last bit of every value
    moves in a pass with masked positions) must be caught; equal-length groups stay in use."""
    real = onnx_encoder.OnnxRunner.hidden

    def padding_dependent(self, ids, mask):
        hidden = real(self, ids, mask)
        return np.nextafter(hidden, np.float32(np.inf)) if not mask.all() else hidden

    monkeypatch.setattr(onnx_encoder.OnnxRunner, "hidden", padding_dependent)
    layout = onnx_embedder._layout
    with caplog.at_level(logging.WARNING, logger="calibrl.onnx_encoder"):
        runner = onnx_encoder.OnnxRunner(str(onnx_embedder.path), onnx_embedder._tokenizer, layout.pooling,
                                         layout.normalize, layout.max_tokens, threads=1, spinning=False)
    test = runner.self_test
    assert test.passed and not test.padded_passed and test.padded_rows_differing > 0
    assert runner.mode == "equal-length groups" and runner.grouped
    assert "padded buckets FAILED" in caplog.text and caplog.text.rstrip().endswith(": equal-length groups")
    alone = [runner.encode([t])[0].tobytes() for t in TEXTS]
    assert [v.tobytes() for v in runner.encode(TEXTS)] == alone


def test_buckets_pad_to_the_first_length_at_or_above_and_never_truncate():
    assert [onnx_encoder.bucket(n) for n in (1, 8, 9, 16, 17, 200, 512, 600)] == [8, 8, 16, 16, 24, 256, 512, 600]


def test_the_export_is_cached_by_weights_hash(onnx_embedder, tmp_path, monkeypatch):
    folder = str(onnx_embedder.path)
    path = onnx_encoder.export_path(folder)
    assert path.is_file() and onnx_encoder.ensure_exported(folder) == path
    mtime = path.stat().st_mtime_ns
    assert onnx_encoder.ensure_exported(folder).stat().st_mtime_ns == mtime  # not exported again
    monkeypatch.setattr(onnx_encoder, "weights_sha256", lambda _: "0" * 64)
    assert onnx_encoder.export_path(folder) != path  # other weights, another graph


def test_onnx_refuses_a_gpu_device_with_a_clear_error(onnx_embedder):
    from calibrl.embedding import _check_backend

    with pytest.raises(ConfigError, match="backend=onnx runs on the CPU"):  # no CUDA here to build one on
        _check_backend("onnx", "cuda:0", onnx_embedder._layout, onnx_embedder.label)
    with pytest.raises(ConfigError, match="must be one of"):
        SentenceEmbedder(None, device="cpu", backend="tensorrt")


# ------------------------------------------------------------------------------ index manifest

@pytest.fixture(scope="module")
def onnx_index(tmp_path_factory):
    from calibrl.testing import build_test_index

    return build_test_index(tmp_path_factory.mktemp("onnx") / "index", encoder_backend="onnx")


def test_the_manifest_records_the_encoder_and_a_server_with_another_is_refused(onnx_index):
    from calibrl.retrieval_server.manifest import read_manifest
    from calibrl.retrieval_server.retriever import SERVED_ENCODER_KEY, Retriever

    manifest = read_manifest(onnx_index)
    assert manifest.encoder["backend"] == "onnx"
    assert manifest.encoder["version"].startswith("onnxruntime ")
    assert len(manifest.encoder["weights_sha256"]) == 64 and manifest.encoder["exporter"].startswith("torch ")
    retriever = Retriever.load(onnx_index, device="cpu")  # auto: the manifest's backend
    assert retriever.embedder.backend == "onnx"
    assert "self-test passed" in retriever.manifest.library_versions[SERVED_ENCODER_KEY]
    assert retriever.search(["Who composed The Magic Flute?"], top_k=1, mode="dense")[0][0].doc_id == "mozart"
    with pytest.raises(FailedPrecondition, match="backend: index 'onnx', server 'torch'"):
        Retriever.load(onnx_index, device="cpu", encoder_backend="torch")


def test_a_manifest_with_another_runtime_version_is_refused(onnx_index, tmp_path):
    import shutil

    from calibrl.retrieval_server.retriever import Retriever

    copy = tmp_path / "index"
    shutil.copytree(onnx_index, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    raw["encoder"]["version"] = "onnxruntime 0.0.1"
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(FailedPrecondition, match="version: index 'onnxruntime 0.0.1'.*rebuild the index"):
        Retriever.load(copy, device="cpu")


def test_an_old_manifest_without_the_record_is_served_with_torch(onnx_index, tmp_path, caplog):
    import shutil

    from calibrl.retrieval_server.retriever import Retriever

    copy = tmp_path / "index"
    shutil.copytree(onnx_index, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    del raw["encoder"]
    (copy / "manifest.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING):
        retriever = Retriever.load(copy, device="cpu")
    assert retriever.embedder.backend == "torch"
    assert "does not record its encoder" in caplog.text


def test_an_unwritable_cache_folder_falls_back_to_the_temporary_folder(onnx_embedder, tmp_path, monkeypatch, caplog):
    """A read-only home (a container) must not stop a server: the graph goes to the temp folder."""
    import tempfile

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(onnx_encoder.CACHE_ENV, str(blocker / "cache"))  # mkdir under a file fails
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level(logging.WARNING, logger="calibrl.onnx_encoder"):
        graph = onnx_encoder.ensure_exported(str(onnx_embedder.path))
    assert graph.is_file() and graph.is_relative_to(tmp_path / "tmp" / "calibrl" / "onnx")
    assert "cannot write the ONNX cache" in caplog.text
    assert onnx_encoder.export_path(str(onnx_embedder.path)) == graph  # found there next time
