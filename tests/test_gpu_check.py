"""benchmarks/gpu_check.py: its CPU dry run exercises the code paths it times on a GPU, and
the committed GPU record's tables are what its numbers give."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
RECORD = ROOT / "benchmarks" / "records" / "gpu_check.json"


def test_the_cpu_dry_run_passes_its_checks_and_writes_a_record(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--checks",
                           "dense_search,trainer", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["passed"] is True and set(record["checks"]) == {"dense_search", "trainer"}
    trainer = record["checks"]["trainer"]["numbers"]
    assert trainer["loss_relative_error"] == 0.0  # CPU against CPU: the same arithmetic
    assert [table["title"].split(" ")[0] for table in record["tables"]] == ["cpu", "Speed", "bfloat16", "A"]
    # A group's prompt run once: the same log-probs and gradient as the one-pass forward within the
    # check's float32 tolerance, and the same greedy tokens from a shared prefill.
    assert trainer["shared_fp32_logp_relative_error"] <= 1e-4 and trainer["shared_fp32_gradient_relative_error"] <= 1e-4
    assert trainer["shared_prefill_greedy_rows_differing"] == 0 and trainer["shared_prefill_rows"] > 0


def test_the_committed_record_s_tables_come_from_its_numbers(tmp_path):
    copy = tmp_path / "gpu_check.json"
    shutil.copy(RECORD, copy)
    done = subprocess.run([sys.executable, str(SCRIPT), "--tables-only", "--json", str(copy)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(copy.read_text())["tables"] == json.loads(RECORD.read_text())["tables"]
