"""Shared fixtures. Tests that need ../shared/data skip with a clear message when it is absent."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = pathlib.Path(os.environ.get("CALIBRL_SHARED_DATA", ROOT.parent / "shared" / "data"))
HOTPOTQA = SHARED_DATA / "hotpotqa" / "dev_400.jsonl"

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers, their subprocesses and the tests share 2 cores: one intra-op thread each avoids
# oversubscription (spinning OpenMP workers made calls many times slower here).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite runs this CPU's own float kernels (and make test-numerics the portable ones): a
# `calibrl demo` or `calibrl study` called in process must not pin them for the tests after it.
# tests/test_kernels.py and the quick demo's end-to-end test check the pinning (calibrl.kernels).
os.environ.setdefault("CALIBRL_KERNELS", "native")


@pytest.fixture(scope="session")
def hotpotqa_path() -> pathlib.Path:
    if not HOTPOTQA.exists():
        pytest.skip(f"shared data not found at {HOTPOTQA} (set CALIBRL_SHARED_DATA to its folder)")
    return HOTPOTQA


def torch_threads_one():
    """Body of the modules' ``one_torch_thread`` fixtures: tiny models and the embedder run fastest
    on one torch thread on a shared, busy machine (the thread count is restored afterwards)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
