"""benchmarks/bench_retrieval.py: the two bounds on what cross-caller batching could give 8
callers at batch 1, as its record's notes word them."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    environ = dict(os.environ)  # the script sets OMP_WAIT_POLICY for its own processes
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_retrieval", ROOT / "benchmarks" / "bench_retrieval.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_retrieval", None)
        sys.path.remove(str(ROOT / "benchmarks"))
        os.environ.clear()
        os.environ.update(environ)


class _Recorder:
    """Stands in for the Retriever: the interface the bounds use, with every call recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.searches: list[int] = []
        self.encodes: list[tuple[int, bool]] = []
        self.embedder = self

    def search(self, batch, top_k, mode):
        with self.lock:
            self.searches.append(len(batch))

    def encode(self, batch, use_cache=True):
        with self.lock:
            self.encodes.append((len(batch), use_cache))


def test_each_round_times_both_batchings_and_embeds_without_the_cache(bench):
    retriever = _Recorder()
    queries = [f"q{i}" for i in range(16)]
    rounds = bench.ceiling_rounds(retriever, queries, threads=2, mode=bench.SearchMode.HYBRID, rounds=3)
    assert len(rounds) == 3 and all(len(r) == 3 and min(r) > 0 for r in rounds)
    # warm-up (4 a call), then per round: 16 calls of one query and 4 calls of 4
    assert sorted(set(retriever.searches)) == [1, 4]
    assert retriever.searches.count(1) == 3 * 16 and retriever.searches.count(4) == 4 + 3 * 4
    # embedding: warm-up (4 a call), then per round 4 a call and one a call; never through the cache
    assert all(use_cache is False for _, use_cache in retriever.encodes)
    assert [n for n, _ in retriever.encodes].count(1) == 3 * 16


def test_the_notes_give_both_bounds_and_say_whether_the_target_is_within_reach(bench):
    cells = [bench.Cell("Search", "grpc", 1, 8, 100, 80.0, 1, 2),
             bench.Cell("Search", "in-process", 1, 8, 100, 100.0, 1, 2)]
    low = bench.verdicts(cells, [(100.0, 110.0, 120.0), (100.0, 112.0, 125.0), (100.0, 108.0, 130.0)])
    assert low[0] == "Search over gRPC with 8 callers at batch 1: 0.80x in-process (target >= 1.5x): not met"
    assert "median 1.10x, range 1.08x to 1.12x" in low[1]
    assert "median 1.25x, range 1.20x to 1.30x" in low[2] and low[2].endswith("the 1.5x target is out of reach here)")
    high = bench.verdicts(cells, [(100.0, 140.0, 160.0)] * 3)
    assert high[2].endswith("the 1.5x target is within reach here)")
