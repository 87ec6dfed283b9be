"""Every figure the README and the docs show is generated from committed records: a page
whose generated block differs from what its records give fails here."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from calibrl.demo import results_tables as rt

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_committed_block_equals_what_its_records_give() -> None:
    checked = 0
    for page in rt.pages(ROOT):
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        blocks = list(rt.BLOCK.finditer(text))
        if not blocks:
            continue
        rendered = rt.render_text(text)
        assert rendered == text, (f"{page.relative_to(ROOT)}: a generated block differs from results/; run "
                                  "`python scripts/render_results.py` after updating the records")
        checked += len(blocks)
    assert checked >= 1, "no page shows a generated block"


def test_the_readme_shows_the_demo_search_table_from_the_records() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- BEGIN generated: demo-search -->" in text


def _demo_records() -> dict:
    def interval(estimate: float, low: float, high: float) -> dict:
        return {"estimate": estimate, "low": low, "high": high, "units": 40, "confidence": 0.95}

    return {
        "command": "calibrl demo", "top_k": 1, "settings": {"seed": "0"},
        "rewrite": [
            {"name": "raw", "label": "raw query", "heldout": {"hit": 0.2}, "mean_frac_reward_zero_std": None},
            {"name": "base", "label": "base rewriter", "heldout": {"hit": 0.3}, "mean_frac_reward_zero_std": None},
            {"name": "dense", "label": "dense reward", "heldout": {"hit": 0.5}, "mean_frac_reward_zero_std": 0.1},
        ],
        "rewrite_analysis": {"tasks": 40, "clusters": 10, "resamples": 1000, "comparisons": [
            {"a": "dense", "b": "base", "metric": "hit", **interval(0.2, 0.05, 0.35)},
            {"a": "base", "b": "raw", "metric": "hit", **interval(0.1, -0.05, 0.25)},
        ]},
        "search": [
            {"name": "base_agent", "label": "base agent", "heldout": {"em": 0.1, "f1": 0.3}},
            {"name": "grpo", "label": "GRPO", "heldout": {"em": 0.2, "f1": 0.4}},
            {"name": "calibadv", "label": "CalibAdv", "heldout": {"em": 0.2, "f1": 0.4}, "interventions": {
                "calibadv/neg_search_steps": 3.5, "calibadv/frac_neg_search_steps_softened": 0.4,
                "calibadv/frac_neg_search_steps_found_gold": 0.9, "calibadv/frac_softened_found_gold": 0.95,
                "calibadv/adv_change_search": 0.12, "calibadv/adv_change_answer": -0.05}},
        ],
        "search_analysis": {
            "questions": 40, "bridge_clusters": 12, "labels": {"base_agent": "base agent", "grpo": "GRPO",
                                                               "calibadv": "CalibAdv", "best_constant": "best constant"},
            "readout": {"grpo": {"readout_rate": 0.25}},
            "search": {"grpo": {"bridge_found": 0.5, "answer_doc_found": 0.25, "recall": 0.375}},
            "constant": {"em": 0.15, "f1": 0.35, "per_aspect": {}},
            "comparisons": [
                {"a": "grpo", "b": "base_agent", "metric": "f1", **interval(0.1, 0.02, 0.18)},
                {"a": "grpo", "b": "base_agent", "metric": "recall", **interval(0.04, 0.01, 0.07)},
                {"a": "calibadv", "b": "grpo", "metric": "recall", **interval(0.02, -0.01, 0.05)},
                {"a": "grpo", "b": "best_constant", "metric": "f1", **interval(0.05, -0.03, 0.12)},
                {"a": "grpo", "b": "best_constant", "metric": "em", **interval(0.05, -0.01, 0.1)},
            ],
        },
        "judge": {"validation": [{"judge": "programmatic judge", "kappa": 0.8, "passed": True, "n_items": 90,
                                  "kappa_low": 0.7, "kappa_high": 0.9, "pass_threshold": 0.75,
                                  "pass_threshold_source": "auto", "min_kappa": 0.6, "gate": "lower_bound"}],
                  "dense_rubric": "demo-rewriter"},
    }


def test_blocks_render_the_records_with_their_intervals(tmp_path: pathlib.Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "results.json").write_text(json.dumps(_demo_records()))
    page = ("intro\n<!-- BEGIN generated: demo-search -->\nstale 99.9%\n<!-- END generated: demo-search -->\n"
            "<!-- BEGIN generated: demo-rewrite -->\n<!-- END generated: demo-rewrite -->\n"
            "<!-- BEGIN generated: demo-judge -->\n<!-- END generated: demo-judge -->\n"
            "<!-- BEGIN generated: study -->\n<!-- END generated: study -->\nend\n")
    text = rt.render_text(page, tmp_path)
    assert "stale 99.9%" not in text and text.startswith("intro\n") and text.endswith("end\n")
    assert ("| GRPO | 20.0% | 40.0% | 50.0% | 25.0% | 25.0% | +10.0 [+2.0, +18.0] | +4.0 [+1.0, +7.0] "
            "| +5.0 [-3.0, +12.0] (includes 0) |") in text
    assert "| best constant | 15.0% | 35.0% | - |" in text
    # CalibAdv's interventions, from the run's means over its training steps
    assert "| CalibAdv | 3.5 | 40.0% | 90.0% | 95.0% | +0.120 | -0.050 |" in text
    assert "40 held-out questions in 12 bridge clusters" in text
    assert "- CalibAdv and GRPO are indistinguishable" in text and "points of search recall" in text
    # the rewriter's comparisons are worded by their intervals
    assert "- dense reward beats the base rewriter: +20.0 points of hit@1" in text
    assert "- the base rewriter and the raw query are indistinguishable" in text
    assert ("| programmatic judge | 90 | 0.750 (auto) | 0.800 [0.700, 0.900] | kappa >= 0.6 on the interval's lower "
            "bound | passed |") in text
    assert "The rewriter's dense reward used the rubric `demo-rewriter`." in text
    assert "No study records are committed yet" in text
    assert rt.render_text(text, tmp_path) == text  # rendering is idempotent


def test_an_unknown_block_or_missing_records_fail_loudly(tmp_path: pathlib.Path) -> None:
    with pytest.raises(KeyError, match="unknown generated block 'demo-nothing'"):
        rt.render_text("<!-- BEGIN generated: demo-nothing -->\n<!-- END generated: demo-nothing -->", tmp_path)
    with pytest.raises(FileNotFoundError, match="no committed demo records"):
        rt.render_text("<!-- BEGIN generated: demo-search -->\n<!-- END generated: demo-search -->", tmp_path)


# --------------------------------------------------------------------------- the demo page's machine and plots

DEMO_PAGE = ROOT / "docs" / "results" / "demo.md"


def _docs_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_the_demo_page_names_the_machine_of_its_record() -> None:
    record = json.loads(rt.DEMO_RESULTS.read_text(encoding="utf-8"))
    page = DEMO_PAGE.read_text(encoding="utf-8")
    [block] = [m.group("body") for m in rt.BLOCK.finditer(page) if m.group("name") == "demo-machine"]
    assert record["machine"] and record["machine"] in block
    assert "CPU cores" in record["machine"] and "load average" in record["machine"]


def test_every_image_of_the_demo_page_is_drawn_from_the_records() -> None:
    import posixpath
    import re

    page = DEMO_PAGE.read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert len(images) >= 2, images  # the held-out curves of the rewriter and of the search agent
    files = _docs_hook().demo_plot_files()
    for image in images:
        uri = posixpath.normpath(posixpath.join("results", image))
        assert uri in files, f"{image}: the docs build draws no such figure (it draws {sorted(files)})"
        assert files[uri].startswith(b"\x89PNG\r\n\x1a\n"), uri
    # no figure is committed: every one comes from the record at build time
    assert not list((ROOT / "docs").rglob("*.png"))


def test_demo_plots_draw_the_step_series_a_record_holds(tmp_path) -> None:
    demo = _demo_records()
    demo["machine"] = "Linux x86_64, 2 CPU cores, no GPU, load average 1.0 at the start"
    demo["rewrite"][2].update(heldout_curve=[[0, 0.3], [10, 0.5]],
                              step_series={"reward": [[1, 0.1], [2, 0.4]], "kl": [[1, 0.0], [2, 0.01]]})
    plots = rt.demo_plots(demo, tmp_path)
    names = [path.name for _, path in plots]
    assert names == ["rewrite_reward.png", "rewrite_kl.png", "rewrite_heldout_hit.png"]
    assert all(path.read_bytes().startswith(b"\x89PNG") for _, path in plots)
    assert rt.demo_machine(demo) == [f"Measured by `calibrl demo` (seed 0) on: {demo['machine']}."]
    assert "![Rewriter: held-out hit@1 over training](demo-plots/rewrite_heldout_hit.png)" in rt.demo_plot_lines(demo)


# --------------------------------------------------------------------------- benchmark records

def _bench_record_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_record", ROOT / "benchmarks" / "bench_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_record_is_shown_and_holds_what_a_script_wrote() -> None:
    records = sorted(rt.BENCH_RECORDS.glob("*.json"))
    assert len(records) >= 2, records
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    shown = {m.group("name") for m in rt.BLOCK.finditer(readme)}
    for path in records:
        record = json.loads(path.read_text(encoding="utf-8"))
        assert f"bench-{path.stem}" in shown, f"{path.name}: no `bench-{path.stem}` block in benchmarks/README.md"
        assert record["command"].startswith("python benchmarks/") and f"--record benchmarks/records/{path.name}" in \
            record["command"], record["command"]
        assert "CPU cores" in record["machine"] and "load average" in record["machine"]
        script = ROOT / record["command"].split()[1]
        assert "--record" in script.read_text(encoding="utf-8"), script
        for table in record["tables"]:
            assert table["title"] and table["rows"]
            assert all(len(row) == len(table["header"]) for row in table["rows"]), table["title"]
    # the README's block is the record, cell for cell
    encoders = json.loads((rt.BENCH_RECORDS / "encoders-bm25.json").read_text(encoding="utf-8"))
    assert "| " + " | ".join(encoders["tables"][0]["rows"][0]) + " |" in readme


def test_a_printed_markdown_table_becomes_a_record_table(tmp_path) -> None:
    bench_record = _bench_record_module()
    lines = ["BM25, top 10 (queries/s):", "", "| a | b |", "| --- | ---: |", "| 1 | 2.5x |", "",
             "Second:", "| c |", "|---|", "| 3 |"]
    tables = bench_record.tables_from_markdown(lines)
    assert tables == [{"title": "BM25, top 10 (queries/s)", "header": ["a", "b"], "rows": [["1", "2.5x"]]},
                      {"title": "Second", "header": ["c"], "rows": [["3"]]}]
    path = bench_record.write_record(tmp_path / "x.json", tables, argv=[str(ROOT / "benchmarks" / "bench_x.py"), "--n",
                                                                        "2"])
    record = json.loads(path.read_text(encoding="utf-8"))
    assert record["command"] == "python benchmarks/bench_x.py --n 2" and record["tables"] == tables
    lines = rt.bench_record(record, "x")
    assert "| 1 | 2.5x |" in lines and "python benchmarks/bench_x.py --n 2" in lines


def test_dict_rows_become_a_table_and_a_record_can_be_rendered_anew(tmp_path) -> None:
    bench_record = _bench_record_module()
    rows = [{"service": "judge", "codes": {"OK": 3, "CANCELLED": 1}, "p99_ms": 12.5},
            {"service": "retrieval", "p99_ms": None, "extra": 2}]
    table = bench_record.rows_table("Phases", rows, drop=("extra",))
    assert table == {"title": "Phases", "header": ["service", "codes", "p99_ms"],
                     "rows": [["judge", "CANCELLED 1, OK 3", "12.5"], ["retrieval", "-", "-"]]}
    path = bench_record.write_record(tmp_path / "x.json", [table], notes=["first"],
                                     argv=[str(ROOT / "benchmarks" / "bench_x.py")])
    measured = json.loads(path.read_text(encoding="utf-8"))
    bench_record.retable(path, [bench_record.table("Other", ["a"], [[1]])])
    again = json.loads(path.read_text(encoding="utf-8"))
    assert again["tables"] == [{"title": "Other", "header": ["a"], "rows": [["1"]]}] and "notes" not in again
    assert {k: again[k] for k in ("command", "measured", "machine", "wall_s")} == \
        {k: measured[k] for k in ("command", "measured", "machine", "wall_s")}


def test_no_benchmark_table_is_typed_by_hand() -> None:
    """Every table of benchmarks/README.md lies inside a generated block (rendered from a record);
    measurements that have no record are dated in benchmarks/HISTORY.md."""
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    outside = rt.BLOCK.sub("", readme)
    typed = [line for line in outside.splitlines() if re.fullmatch(r"\|(?:\s*:?-{3,}:?\s*\|)+", line.strip())]
    assert not typed, f"{len(typed)} table(s) of benchmarks/README.md outside a generated block"
