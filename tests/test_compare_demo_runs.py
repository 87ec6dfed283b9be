"""scripts/compare_demo_runs.py: two demo folders compare equal less their timing, and any
other difference is reported with its path."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("compare_demo_runs", ROOT / "scripts" / "compare_demo_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_folder(root: pathlib.Path, *, wall_s: float, load: float, reward: float, step_s: float) -> pathlib.Path:
    results = {
        "machine": f"Linux, 2 CPU cores, load average {load:.1f} at the start",
        "stages": [["generate the domain", wall_s], ["train", 2 * wall_s]],
        "rewrite": [{"name": "dense", "heldout": {"hit": 0.25, "mrr": float("nan")}, "wall_s": wall_s}],
        "judge": {"server": {"r": {"calls": 4, "batches": int(wall_s), "mean_batch_size": wall_s}},
                  "training_processes": {"dense": {"where": "demo process", "start_s": 0.0, "end_s": wall_s}}},
    }
    (root / "runs" / "dense").mkdir(parents=True)
    (root / "results.json").write_text(json.dumps(results), encoding="utf-8")
    steps = [{"step": 1, "reward": reward, "timing/step": step_s}, {"step": 2, "reward": 0.5, "timing/step": step_s}]
    (root / "runs" / "dense" / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n",
                                                           encoding="utf-8")
    return root


def test_timing_is_left_out_and_results_must_match(tmp_path):
    compare = _script()
    before = _demo_folder(tmp_path / "before", wall_s=3.0, load=1.5, reward=0.25, step_s=0.4)
    same = _demo_folder(tmp_path / "same", wall_s=7.0, load=2.0, reward=0.25, step_s=0.9)
    other = _demo_folder(tmp_path / "other", wall_s=3.0, load=1.5, reward=0.75, step_s=0.4)
    assert compare.compare(before, same) == []
    assert compare.main([str(before), str(same)]) == 0
    assert compare.compare(before, other) == ["runs/dense/metrics.jsonl[0]/reward: 0.25 != 0.75"]
    assert compare.main([str(before), str(other)]) == 1
    assert compare.main([str(before), str(tmp_path / "missing")]) == 2


def test_a_stage_title_or_a_missing_run_is_a_difference(tmp_path):
    compare = _script()
    before = _demo_folder(tmp_path / "before", wall_s=3.0, load=1.5, reward=0.25, step_s=0.4)
    after = _demo_folder(tmp_path / "after", wall_s=3.0, load=1.5, reward=0.25, step_s=0.4)
    results = json.loads((after / "results.json").read_text(encoding="utf-8"))
    results["stages"][0][0] = "generate"
    (after / "results.json").write_text(json.dumps(results), encoding="utf-8")
    (after / "runs" / "extra").mkdir()
    (after / "runs" / "extra" / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    assert compare.compare(before, after) == ["results.json/stages[0]: 'generate the domain' != 'generate'",
                                              "runs/extra/metrics.jsonl: only after"]
