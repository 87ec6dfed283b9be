"""The demo report: tables, verdicts computed from the numbers, PNG plots, results.json."""

from __future__ import annotations

import json
import math
import pathlib

from calibrl.demo import report as rep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def steps(n: int, reward: float, zero_std: float, kl_slope: float) -> list[dict]:
    return [
        {"step": s, "reward": reward + 0.01 * s, "frac_reward_zero_std": zero_std, "kl": kl_slope * s,
         "grad_norm": 0.4 + 0.01 * s}
        for s in range(1, n + 1)
    ]


def sample_report(tmp_notes: list[str] | None = None) -> rep.DemoReport:
    rewrite = [
        rep.RunResult("raw", "raw query", "rewrite", {"hit": 0.20}),
        rep.RunResult("base", "base rewriter", "rewrite", {"hit": 0.25}),
        rep.RunResult("binary", "binary reward", "rewrite", {"hit": 0.22}, steps=steps(20, 0.1, 0.75, 0.001),
                      heldout_curve=[(0, 0.25), (10, 0.23), (20, 0.22)]),
        rep.RunResult("dense", "dense reward", "rewrite", {"hit": 0.43}, steps=steps(20, 0.4, 0.05, 0.002),
                      heldout_curve=[(0, 0.25), (10, 0.35), (20, 0.43)]),
    ]
    search = [
        rep.RunResult("base_agent", "base agent", "search", {"em": 0.2, "f1": 0.3, "well_formed": 1.0}),
        rep.RunResult("grpo", "GRPO", "search", {"em": 0.2, "f1": 0.30, "well_formed": 0.9},
                      steps=steps(5, 0.3, 0.3, 0.01), heldout_curve=[(0, 0.3), (5, 0.30)]),
        rep.RunResult("calibadv", "CalibAdv", "search", {"em": 0.3, "f1": 0.36, "well_formed": 1.0},
                      steps=steps(5, 0.3, 0.3, 0.005), heldout_curve=[(0, 0.3), (5, 0.36)]),
    ]
    return rep.DemoReport(
        title="demo", command="calibrl demo --quick", machine="test machine", settings={"seed": 0},
        rewrite_runs=rewrite, search_runs=search, top_k=1, stages=[("distil", 1.5), ("train", 10.0)],
        notes=tmp_notes or [],
    )


def test_report_holds_tables_verdicts_and_real_plots(tmp_path: pathlib.Path) -> None:
    path = rep.write_report(sample_report(["a note"]), tmp_path)
    text = path.read_text()
    assert "| dense reward | 43.0% |" in text
    assert "| binary reward | 22.0% | 0.255 | 75.0% |" in text  # mean reward of steps 11-20: 0.1 + 0.01 * 15.5
    assert "binary reward: held-out hit@1 25.0% (base) -> 22.0%" in text
    assert "dense reward: held-out hit@1 25.0% (base) -> 43.0%" in text
    # without task-by-task records the report makes no comparison it cannot interval
    assert "beats" not in text and "indistinguishable" not in text
    assert "CalibAdv: held-out answer F1 30.0% (base) -> 36.0%" in text
    assert "| total | 11.5 |" in text and "- a note" in text
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert {"rewrite_reward.png", "rewrite_frac_reward_zero_std.png", "rewrite_kl.png", "rewrite_grad_norm.png",
            "rewrite_heldout_hit.png", "search_heldout_f1.png"} <= set(pngs)
    for name in pngs:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC
        assert f"(plots/{name})" in text
    results = json.loads((tmp_path / "results.json").read_text())
    dense = next(r for r in results["rewrite"] if r["name"] == "dense")
    assert dense["heldout"]["hit"] == 0.43 and dense["steps"] == 20
    # A value of the fixture's own fake run (not a trained number), averaged in float64: rel 1e-9.
    assert math.isclose(dense["mean_frac_reward_zero_std"], 0.05)


def test_rewrite_verdict_wording_follows_the_interval() -> None:
    """A gap of 5 points is a win only where the paired interval excludes zero."""
    from calibrl.demo.rewrite_analysis import rewrite_results

    base = rep.RunResult("base", "base", "rewrite", {"hit": 0.3})
    binary = rep.RunResult("binary", "binary", "rewrite", {"hit": 0.4}, steps=steps(3, 0.1, 0.8, 0.0))
    dense = rep.RunResult("dense", "dense", "rewrite", {"hit": 0.35}, steps=steps(3, 0.1, 0.1, 0.0))
    clusters = [i // 4 for i in range(120)]
    hits = {"base": [float(i % 10 < 3) for i in range(120)],
            # +10 points on every cluster alike: a clear win over the base
            "binary": [float(i % 10 < 4) for i in range(120)],
            # the same mean gain over binary would be, but made of whole clusters flipping both ways
            "dense": [float((i // 4) % 3 == 0) if (i // 4) % 2 else float(i % 10 < 4) for i in range(120)]}
    analysis = rewrite_results(hits, clusters, resamples=2000)
    lines = rep.rewrite_verdict(base, [binary, dense], 1, analysis)
    assert any(line.startswith("binary beats the base rewriter: +10.0 points of hit@1") for line in lines), lines
    dense_vs_binary = next(line for line in lines if line.startswith("dense") and "binary" in line)
    assert "indistinguishable" in dense_vs_binary or "is below" in dense_vs_binary
    by_pair = {(c["a"], c["b"]): c for c in analysis["comparisons"]}
    assert set(by_pair) == {("binary", "base"), ("dense", "base"), ("dense", "binary")}
    for item in by_pair.values():
        assert item["low"] <= item["estimate"] <= item["high"] and item["units"] == 120
    assert analysis["clusters"] == 30


def test_missing_metrics_print_as_dashes_and_text_table_aligns() -> None:
    runs = [rep.RunResult("base", "base", "rewrite", {"hit": 0.5}),
            rep.RunResult("x", "a much longer label", "rewrite", {}, steps=[{"step": 1, "reward": 0.5}])]
    table = rep.text_table(runs, rep.rewrite_columns(1)).splitlines()
    assert len({len(line) for line in table}) == 1
    assert "50.0%" in table[2] and "-" in table[3].split()


def test_read_log_missing_file_is_empty(tmp_path: pathlib.Path) -> None:
    from calibrl.trainer.diagnostics import read_log

    assert read_log(tmp_path / "nope.jsonl") == []
    (tmp_path / "m.jsonl").write_text('{"step": 1, "reward": 0.5}\n\n{"step": 2, "reward": 0.7}\n')
    assert [r["step"] for r in read_log(tmp_path / "m.jsonl")] == [1, 2]


def test_concurrency_section_shows_spans_overlap_and_server_figures_while_both_ran() -> None:
    from calibrl.demo.judge_report import RubricServerStats, concurrency_section
    from calibrl.demo.services import RunSpan

    spans = {"dense": RunSpan("dense", 0.0, 40.0), "grpo": RunSpan("grpo", 0.5, 80.5),
             "binary": RunSpan("binary", 80.5, 110.5, 0, where="demo process")}
    during = {"llm": RubricServerStats(calls=30, batches=20, batch_items=400, shared_batches=5, beside_batches=7,
                                       cache_misses=410),
              "unused": RubricServerStats()}
    text = "\n".join(concurrency_section(spans, ("dense", "grpo"), {"dense": "dense: blended"}, during))
    assert "| dense: blended | calibrl train process | 0.0 | 40.0 | 40.0 |" in text
    assert "| binary | demo process | 80.5 | 110.5 | 30.0 |" in text
    assert "at the same time for 39.5 s (99% of `dense`'s wall time, 49% of `grpo`'s)" in text
    assert "| llm | 30 | 20 | 20.0 | 5 | 7 | 0 | 410 |" in text and "| unused |" not in text
    # without /metrics: the spans and the overlap only; without the pair: the spans only
    assert "judge server did" not in "\n".join(concurrency_section(spans, ("dense", "grpo"), {}, None))
    assert "at the same time" not in "\n".join(concurrency_section(spans, ("dense", "calibadv"), {}, None))
    assert "over gRPC; the demo trained the rest itself afterwards." in text
    # the full demo: every run a process, nothing left to the demo process
    all_processes = {**{n: spans[n] for n in ("dense", "grpo")}, "calibadv": RunSpan("calibadv", 40.0, 120.0),
                     "binary": RunSpan("binary", 80.5, 110.5)}
    text = "\n".join(concurrency_section(all_processes, ("dense", "grpo"), {}, None))
    assert ("over gRPC; `calibadv`, `binary` then started as processes, each when a running one ended (two at "
            "once). ") in text and "the rest" not in text
