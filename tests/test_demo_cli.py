"""`calibrl demo`: argument errors, the service wrapper, and the whole quick run end to end."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from calibrl import kernels
from calibrl.demo import cli as demo_cli
from calibrl.demo.services import Service, calibrl_command, free_port
from calibrl.errors import Unavailable
from calibrl.sme.items import read_items
from tests.test_tracking import _tensorboard

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_refuses_a_non_empty_out_folder_and_bad_threads(tmp_path: pathlib.Path, capsys) -> None:
    (tmp_path / "old.txt").write_text("an earlier run")
    assert demo_cli.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "old.txt").exists()
    assert demo_cli.main(["--quick", "--out", str(tmp_path / "new"), "--threads", "0"]) == 2
    assert "--threads=0" in capsys.readouterr().err


def test_an_earlier_demo_run_is_replaced_anything_else_needs_overwrite(tmp_path: pathlib.Path) -> None:
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / demo_cli.MARKER).write_text("calibrl demo\n")
    (earlier / "report.md").write_text("old")
    assert demo_cli.prepare_out(earlier, overwrite=False) is None and not earlier.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "--overwrite" in demo_cli.prepare_out(other, overwrite=False)
    assert (other / "notes.txt").exists()
    assert demo_cli.prepare_out(other, overwrite=True) is None and not other.exists()
    (tmp_path / "file").write_text("x")
    assert "is a file" in demo_cli.prepare_out(tmp_path / "file", overwrite=True)


def test_quick_settings_are_smaller_than_full() -> None:
    quick, full = demo_cli.QUICK, demo_cli.FULL
    for field in ("warm_rewriter_steps", "rewrite_steps"):
        assert 0 < getattr(quick, field) < getattr(full, field), field
    for field in ("warm_steps", "steps"):
        assert 0 < getattr(quick.search, field) < getattr(full.search, field), field


def test_a_service_that_exits_early_is_reported_with_its_log(tmp_path: pathlib.Path) -> None:
    port = free_port()
    service = Service("retrieval server", ["serve", "retrieval", "--index", str(tmp_path / "missing"),
                                           "--port", str(port)], port, tmp_path / "serve.log")
    service.start()
    try:
        with pytest.raises(Unavailable, match="exited with code") as info:
            service.wait_healthy(timeout_s=60)
        assert "missing" in str(info.value)  # the log tail names the bad index folder
    finally:
        service.stop()
    assert service.process is not None and service.process.returncode not in (None, 0)


# Stages 1-3b of the demo alone in a process of their own (kernels pinned as the demo pins
# them): the LLM judge with nothing running beside it. Prints the judge's model id last.
_JUDGE_ALONE = """
import pathlib, sys
from calibrl import kernels
kernels.pin()
import torch
torch.set_num_threads(1)
from calibrl.demo import cli
from calibrl.demo.domain import generate_domain, write_domain
from calibrl.demo.judge_model import LLM_RUBRIC_ID, distill_llm_rubric
out = pathlib.Path(sys.argv[1])
domain = generate_domain(cli.DEFAULT_SEED)  # the seed `calibrl demo` runs without --seed
files = write_domain(domain, out / "data")
_, golden = cli.distill_rubric(files.sme_feedback, domain.glossary_terms(), out / "rubrics" / "r.yaml",
                               out / "golden.jsonl")
llm_path = out / "rubrics" / f"{LLM_RUBRIC_ID}.yaml"
llm_rubric = distill_llm_rubric(files.sme_feedback, domain.glossary_terms(), llm_path)
judge = cli.build_llm_judge(cli.QUICK, domain, files.sme_feedback, llm_rubric, llm_path, golden,
                            out / "golden.jsonl", out, cli.DEFAULT_SEED, False)
print(judge.model_id)
"""


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path: pathlib.Path) -> None:
    """What CI runs: `calibrl demo --quick` with real servers on loopback, no download."""
    out = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name in (kernels.NATIVE_SWITCH, *kernels.PINNED):  # as a user runs it: the demo pins its kernels
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "calibrl", "demo", "--quick", "--out", str(out), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    if kernels.cpu_has_avx2():
        assert "float kernels: pinned to AVX2" in stdout
    for stage in range(1, 13):
        assert f"[{stage}/12]" in stdout
    # the programmatic judge and the trained LLM judge: each gate's decision states its kappa interval
    # (passing is a result of the run, not pinned here); the experts' own agreement is printed first
    gates = re.findall(r"gate (PASSED|FAILED): kappa -?\d\.\d{3} \[-?\d\.\d\d, -?\d\.\d\d\]", stdout)
    assert len(gates) == 2, stdout[-3000:]
    assert "experts' pairwise Cohen's kappa on pass/fail" in stdout
    assert re.search(r"retrieval server SERVING on 127\.0\.0\.1:\d+", stdout)
    assert re.search(r"judge server SERVING on 127\.0\.0\.1:\d+", stdout)

    # the printed table and the report hold real numbers for every policy
    for label in ("base rewriter (untrained)", "GRPO, binary hit@1 reward", "GRPO, blended dense reward",
                  "base search agent (untrained)", "GRPO (answer F1)", "CalibAdv, gold as silver (answer F1)",
                  "CalibAdv, authors' silver (answer F1)"):
        line = next(line for line in stdout.splitlines() if line.startswith(label))
        assert re.search(r"\d+\.\d%", line), line
    report = (out / "report.md").read_text()
    assert "| GRPO, binary hit@1 reward |" in report and "## Plots" in report
    plots = sorted((out / "plots").glob("*.png"))
    assert len(plots) == 12
    for plot in plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
        assert f"(plots/{plot.name})" in report

    # the SME-time study (calibrl/studies/sme_time.py): a kappa per budget for both samplers, and the verdict
    assert "## SME time: representative vs random sampling" in report and "Reviews needed to pass the gate" in report
    study = json.loads((out / "sme_study.json").read_text())
    assert {p["method"] for p in study["points"]} == {"representative", "random"}
    assert sorted({p["budget"] for p in study["points"]}) == [5, 10, 20, 40]
    assert len(read_items(out / "sme_items.jsonl")) == study["pool_size"]  # ready for calibrl sme sample

    results = json.loads((out / "results.json").read_text())
    if kernels.cpu_has_avx2():  # the report says which kernels computed its figures
        mkl = "AVX2" if kernels.cpu_vendor() == "GenuineIntel" else "AUTO"  # MKL pins on Intel CPUs only
        assert f"float kernels ATen AVX2, MKL code path {mkl}" in results["machine"], results["machine"]
    by_name = {r["name"]: r for r in results["rewrite"] + results["search"]}
    assert set(by_name) == {"raw", "base", "binary", "binary_ds", "dense", "base_agent", *demo_cli.SEARCH_ARMS}
    for name in ("raw", "base", "binary", "binary_ds", "dense"):
        assert 0.0 <= by_name[name]["heldout"]["hit"] <= 1.0
    for name in ("binary", "binary_ds", "dense", *demo_cli.SEARCH_ARMS):
        run = by_name[name]
        assert run["steps"] == (demo_cli.QUICK.rewrite_steps if name in demo_cli.REWRITE_ARMS
                                else demo_cli.QUICK.search.steps)
        assert len(run["heldout_curve"]) >= 2 and run["wall_s"] > 0
        records = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert all(0.0 <= r["frac_reward_zero_std"] <= 1.0 and r["grad_norm"] >= 0 for r in records)
    # the search agent's error analysis: every held-out question of every agent in one category,
    # and each trained agent's paired F1 gain over the base with its interval
    analysis = results["search_analysis"]
    assert analysis["questions"] == demo_cli.QUICK.search.eval_questions
    assert analysis["independent_questions"] == analysis["questions"]  # one phrasing per held-out question
    assert "## Two-search agent: where the trajectories fail" in report
    agents = ("base_agent", *demo_cli.SEARCH_ARMS)
    for name in agents:
        assert sum(analysis["categories"][name]["counts"].values()) == analysis["questions"]
        figures = analysis["search"][name]  # search recall beside F1: bridge and answer document found
        assert 0.0 <= figures["bridge_found"] <= 1.0 and 0.0 <= figures["answer_doc_found"] <= 1.0
    lines = [json.loads(line) for line in (out / "search_records.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * analysis["questions"] and {r["model"] for r in lines} == set(agents)
    # each trained agent against the base and the best constant answer, in F1 and exact match, and
    # the two agents against each other: paired, bridge-clustered, the interval holding its estimate
    pairs = {(c["a"], c["b"], c["metric"]) for c in analysis["comparisons"]}
    for name in demo_cli.SEARCH_ARMS:
        for other in ("base_agent", "best_constant"):
            assert {(name, other, "f1"), (name, other, "em")} <= pairs
        assert (name, "base_agent", "recall") in pairs and (name, "best_constant", "recall") not in pairs
    for calibadv in ("calibadv", "calibadv_silver"):  # H1 and H2 of experiments/LOG.md D11
        assert {(calibadv, "grpo", "f1"), (calibadv, "grpo", "recall")} <= pairs
    for diff in analysis["comparisons"]:
        assert diff["low"] <= diff["estimate"] <= diff["high"] and diff["units"] == analysis["questions"]
    assert 0.0 <= analysis["constant"]["em"] <= 1.0 and analysis["bridge_clusters"] <= analysis["questions"]
    for name in agents:
        readout = analysis["readout"][name]
        assert readout["found_answer_doc"] <= analysis["questions"]
        assert set(analysis["modal_answers"][name]) <= set(demo_cli.search_aspects())
    # the rewriter arms compared task by task, clustered by (product, topic)
    rewrite = results["rewrite_analysis"]
    assert {(c["a"], c["b"]) for c in rewrite["comparisons"]} >= {("dense", "base"), ("dense", "binary_ds")}
    assert rewrite["clusters"] < rewrite["tasks"]
    # the dense reward really used the judge: a rubric component was logged, the binary run has none
    dense_log = (out / "runs" / "dense" / "metrics.jsonl").read_text()
    assert "rewards/rubric/mean" in dense_log
    assert "rewards/rubric/mean" not in (out / "runs" / "binary" / "metrics.jsonl").read_text()
    assert "rewards/judge_retrieval_disagreement" in dense_log
    assert "sampling/kept_groups" in (out / "runs" / "binary_ds" / "metrics.jsonl").read_text()

    # the LLM judge: trained, validated beside the programmatic judge, serving the dense reward
    # from the one judge server that also serves the programmatic and step rubrics
    judge = results["judge"]
    assert [row["judge"] for row in judge["validation"]] == ["programmatic judge", "LLM judge"]
    llm_row = judge["validation"][1]
    assert llm_row["model_id"].startswith("transformers:judge@")
    assert -1.0 <= llm_row["kappa"] <= 1.0 and -1.0 <= llm_row["quadratic_weighted_kappa"] <= 1.0
    for row in judge["validation"]:  # the demo's gate decides on the interval's lower bound
        assert row["kappa_low"] <= row["kappa"] <= row["kappa_high"] and row["gate"] == "lower_bound"
        assert row["passed"] == (row["kappa_low"] >= row["min_kappa"]) and row["pass_threshold_source"] == "auto"
    assert [g == "PASSED" for g in gates] == [row["passed"] for row in judge["validation"]]
    # the index built beside the judge's stages (`calibrl index build`, a process of its own) left
    # the judge's trained weights alone: the same model id as stages 1-3b with nothing beside them
    # (an index built in a thread of the demo process once changed them)
    assert (out / "logs" / "index_build.log").is_file()
    alone = subprocess.run([sys.executable, "-c", _JUDGE_ALONE, str(tmp_path / "judge_alone")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert llm_row["model_id"] == alone.stdout.split()[-1]
    # the dense reward uses the LLM rubric when it passed its gate, else the programmatic one
    dense_rubric = "demo-rewriter-llm" if llm_row["passed"] else "demo-rewriter"
    assert judge["dense_rubric"] == dense_rubric and f"(0.7 MRR@10 + 0.3 rubric {dense_rubric})" in report
    assert set(judge["served"]) == {"demo-rewriter", "demo-rewriter-llm", "search-steps"}
    dense_steps = demo_cli.QUICK.rewrite_steps
    dense_server = judge["server"][dense_rubric]
    assert dense_server["calls"] >= dense_steps and 0 < dense_server["batch_items"] <= dense_server["cache_misses"]
    assert "## Two judges on the SME golden set" in report and "## One judge server, every rubric" in report
    # the search agent is the second agent on that server: every search step scored on the step rubric
    step_server = judge["server"]["search-steps"]
    search_steps = sum(by_name[name]["steps"] for name in demo_cli.SEARCH_ARMS)
    assert step_server["calls"] >= search_steps and step_server["batch_items"] > 0
    assert "| search-steps | programmatic criteria | grpo, calibadv, calibadv_silver |" in report
    search_log = (out / "runs" / "grpo" / "metrics.jsonl").read_text()
    assert "steps/reward/mean" in search_log and "steps/new_gold_share" in search_log
    # two agents at once: the dense rewriter and the GRPO search agent were two `calibrl train`
    # processes started together that overlapped; the demo trained the other three itself afterwards
    # (the full demo starts CalibAdv as a third process when the first of the pair ends)
    processes, in_process = demo_cli.QUICK.processes(), demo_cli.QUICK.in_process()
    assert processes == demo_cli.CONCURRENT_PAIR and set(in_process) == {"binary", "binary_ds", "calibadv",
                                                                          "calibadv_silver"}
    assert demo_cli.FULL.processes() == (*demo_cli.CONCURRENT_PAIR, "calibadv", "calibadv_silver", "binary_ds",
                                         "binary")
    assert demo_cli.FULL.in_process() == ()
    spans = judge["training_processes"]
    assert list(spans) == [*processes, *in_process] and judge["pair"] == ["dense", "grpo"]
    assert judge["pair_overlap_s"] > 0 and spans["dense"]["start_s"] < 5 and spans["grpo"]["start_s"] < 5
    assert {n: s["where"] for n, s in spans.items()} == {
        **{n: "calibrl train process" for n in processes}, **{n: "demo process" for n in in_process}}
    later = [spans[n] for n in in_process]
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(later, later[1:]))
    assert later[0]["start_s"] >= max(spans[n]["end_s"] for n in processes)
    during = judge["server_during_pair"]
    assert set(during) == {dense_rubric, "search-steps"}  # both agents called the server while both ran
    for rubric_id, figures in during.items():
        whole = judge["server"][rubric_id]
        assert 0 < figures["calls"] <= whole["calls"] and figures["beside_batches"] <= figures["batches"]
    assert "## Two agents on one judge server at once" in report and "ran at the same time for" in report
    for name in processes:
        assert (out / "logs" / f"train_{name}.log").read_text().startswith(calibrl_command()[0])
    for name in (*processes, *in_process):
        scalars, texts = _tensorboard(out / "runs" / name)  # the run's own tracker run: its steps, then the table
        assert "reward" in scalars and texts["heldout"].startswith("| step |")
        assert len(texts["heldout"].splitlines()) == 2 + len(by_name[name]["heldout_curve"]) - 1  # less step 0
    # both services were stopped at the end (SIGTERM: NOT_SERVING, drain, exit)
    for log in ("serve_retrieval.log", "serve_judge.log"):
        assert (out / "logs" / log).stat().st_size > 0
