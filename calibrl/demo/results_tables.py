"""The figures that README.md and the docs show, generated from committed records.

No figure in the README or the docs is typed by hand. A page marks each generated
block with a pair of comments::

    <!-- BEGIN generated: demo-search -->
    ...
    <!-- END generated: demo-search -->

and :func:`render_block` writes its content from the records under ``results/`` (the
full demo's ``results.json``, the study's summary). ``python scripts/render_results.py``
rewrites every block; ``tests/test_results_tables.py`` fails when a committed block
differs from what the records give. Blocks:

- ``demo-search``: the two-search agents beside the base and the best constant answer,
  with read-out rates and paired, bridge-clustered intervals;
- ``demo-search-analysis``: where the search agents' trajectories fail, their read-out
  rates, how often they answer a constant, and the best constant answers;
- ``demo-rewrite``: the query rewriters, each comparison with its (product, topic)-clustered
  interval, worded by it;
- ``demo-judge``: the judges' agreement with the SME golden set and the gate's decision;
- ``demo-machine``: the command, the seed and the machine line (CPU, cores, kernels, load) the
  demo recorded;
- ``demo-stages``: the demo's wall time per stage, with its machine line;
- ``demo-plots``: the demo's figures, drawn from the records by :func:`demo_plots` (the held-out
  curves of every arm, and the per-step curves where the record holds them); the docs build
  (docs/hooks/reference.py) writes the PNG files beside the page, so no figure is committed;
- ``study``: the study's arms over seeds (or a line saying no study records are committed);
- ``bench-NAME``: the tables of the benchmark record ``benchmarks/records/NAME.json`` (written by a
  benchmark script's ``--record``; benchmarks/bench_record.py), with its command, date and machine.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from typing import TYPE_CHECKING, Callable, Mapping

from calibrl.json_types import JsonObject, JsonRecord

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.report import RunResult

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
DEMO_RESULTS = RESULTS / "demo" / "results.json"
STUDY_RESULTS = RESULTS / "study" / "results.json"
BENCH_RECORDS = ROOT / "benchmarks" / "records"
BLOCK = re.compile(r"(<!-- BEGIN generated: (?P<name>[a-z0-9_-]+) -->\n)(?P<body>.*?)(<!-- END generated: (?P=name) -->)",
                   re.DOTALL)


def _pct(value: object) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{100 * value:.1f}%"


def _num(value: object, digits: int, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _ci(item: JsonRecord | None) -> str:
    if not item:
        return "-"
    mark = "" if item["low"] > 0 or item["high"] < 0 else " (includes 0)"
    return (f"{100 * item['estimate']:+.1f} [{100 * item['low']:+.1f}, {100 * item['high']:+.1f}]{mark}")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _source(demo: JsonRecord) -> str:
    return f"Generated from `results/demo/results.json` (`{demo['command']}`, seed {demo['settings'].get('seed', '?')})."


def demo_search(demo: JsonRecord) -> list[str]:
    from calibrl.demo.error_analysis import BEST_CONSTANT, METRIC_UNITS, comparison
    from calibrl.stats import describe_difference

    analysis = demo["search_analysis"]
    labels = analysis["labels"]
    runs = {r["name"]: r for r in demo["search"]}
    readout = analysis.get("readout", {})
    search = analysis.get("search", {})
    header = ["agent", "answer EM", "answer F1", "bridge found", "answer doc found", "read-out rate",
              "F1 vs base, points [95% CI]", "recall vs base [95% CI]", "F1 vs best constant [95% CI]",
              "EM vs best constant [95% CI]"]
    rows = []
    for name, run in runs.items():
        rows.append([run["label"], _pct(run["heldout"].get("em")), _pct(run["heldout"].get("f1")),
                     _pct(search.get(name, {}).get("bridge_found")), _pct(search.get(name, {}).get("answer_doc_found")),
                     _pct(readout.get(name, {}).get("readout_rate")),
                     _ci(comparison(analysis, name, "base_agent", "f1")),
                     _ci(comparison(analysis, name, "base_agent", "recall")),
                     _ci(comparison(analysis, name, BEST_CONSTANT, "f1")),
                     _ci(comparison(analysis, name, BEST_CONSTANT, "em"))])
    if "constant" in analysis:
        constant = analysis["constant"]
        rows.insert(1, [labels[BEST_CONSTANT], _pct(constant["em"]), _pct(constant["f1"]), "-", "-", "-", "-", "-",
                        "-", "-"])
    lines = [_source(demo), "", *_table(header, rows), "",
             f"{analysis['questions']} held-out questions in {analysis.get('bridge_clusters', '?')} bridge clusters; "
             "intervals pair the same questions and resample whole clusters. The read-out rate is the share of "
             "trajectories that found the answer document and then answered its value exactly."]
    interventions = [r for r in runs.values() if r.get("interventions")]
    if interventions:
        lines += ["", "What CalibAdv changed against GRPO's advantages (means over its training steps):", "",
                  *_table(["arm", "negative search steps per step", "softened", "of those, found a gold document",
                           "softened that found gold", "advantage change, search tokens",
                           "advantage change, answer tokens"],
                          [[r["label"], _num(r["interventions"]["calibadv/neg_search_steps"], 1),
                            _pct(r["interventions"]["calibadv/frac_neg_search_steps_softened"]),
                            _pct(r["interventions"]["calibadv/frac_neg_search_steps_found_gold"]),
                            _pct(r["interventions"]["calibadv/frac_softened_found_gold"]),
                            _num(r["interventions"]["calibadv/adv_change_search"], 3, signed=True),
                            _num(r["interventions"]["calibadv/adv_change_answer"], 3, signed=True)]
                           for r in interventions])]
    trained = [name for name in runs if name != "base_agent"]
    pairs = [(a, b) for i, b in enumerate(trained) for a in trained[i + 1:]]
    if pairs:
        lines.append("")
    for a, b in pairs:
        for metric in ("recall", "f1", "em"):
            item = comparison(analysis, a, b, metric)
            unit = METRIC_UNITS[metric]
            if item:
                lines.append(f"- {describe_difference(labels[a], labels[b], item, unit)}")
    return lines


def demo_search_analysis(demo: JsonRecord) -> list[str]:
    """The error analysis tables of the search agents (categories, read-out, constant answers,
    best constants), without the comparisons the demo-search block already states."""
    from calibrl.demo.error_analysis import analysis_markdown

    analysis = {k: v for k, v in demo["search_analysis"].items() if k != "comparisons"}
    body = analysis_markdown(analysis)[2:]  # the section heading is the page's
    while body and not body[-1]:
        body.pop()
    return [_source(demo), "", *body]


def demo_rewrite(demo: JsonRecord) -> list[str]:
    from calibrl.demo.rewrite_analysis import rewrite_comparison_lines

    k = demo["top_k"]
    header = ["rewriter", f"held-out hit@{k}", "frac_reward_zero_std (mean)"]
    rows = [[r["label"], _pct(r["heldout"].get("hit")), _pct(r.get("mean_frac_reward_zero_std"))]
            for r in demo["rewrite"]]
    lines = [_source(demo), "", *_table(header, rows), ""]
    analysis = demo.get("rewrite_analysis")
    if analysis:
        labels = {**{r["name"]: r["label"] for r in demo["rewrite"]}, "raw": "the raw query", "base": "the base rewriter"}
        lines += [f"Paired by task over {analysis['tasks']} held-out tasks, resampling whole (product, topic) pairs "
                  f"({analysis['clusters']} clusters):", ""]
        lines += [f"- {line}" for line in rewrite_comparison_lines(analysis, labels, k)]
    return lines


def demo_judge(demo: JsonRecord) -> list[str]:
    judge = demo.get("judge", {})
    rows = []
    for row in judge.get("validation", []):
        kappa = f"{row['kappa']:.3f}" if isinstance(row.get("kappa"), (int, float)) else "-"
        if isinstance(row.get("kappa_low"), (int, float)) and isinstance(row.get("kappa_high"), (int, float)):
            kappa += f" [{row['kappa_low']:.3f}, {row['kappa_high']:.3f}]"
        threshold = row.get("pass_threshold")
        threshold_cell = "-" if threshold is None else f"{threshold:.3f}" + (
            " (auto)" if row.get("pass_threshold_source") == "auto" else "")
        gate = f"kappa >= {row['min_kappa']:g}" if "min_kappa" in row else "-"
        if row.get("gate") == "lower_bound":
            gate += " on the interval's lower bound"
        rows.append([row.get("judge", "?"), str(row.get("n_items", "-")), threshold_cell, kappa, gate,
                     "passed" if row.get("passed") else "failed"])
    if not rows:
        return [_source(demo), "", "The demo's results hold no judge validation."]
    dense = judge.get("dense_rubric")
    lines = [_source(demo), "", *_table(["judge", "golden items", "pass threshold", "Cohen's kappa [95% CI]", "gate",
                                        "decision"], rows)]
    if dense:
        lines += ["", f"The rewriter's dense reward used the rubric `{dense}`."]
    return lines


def demo_machine(demo: JsonRecord) -> list[str]:
    return [f"Measured by `{demo['command']}` (seed {demo['settings'].get('seed', '?')}) on: {demo['machine']}."]


def demo_stages(demo: JsonRecord) -> list[str]:
    """The demo's wall time per stage, as its record holds it."""
    stages = demo.get("stages", [])
    if not stages:
        return [_source(demo), "", "The demo's records hold no stage times."]
    total = sum(seconds for _, seconds in stages)
    rows = [[stage, f"{seconds:.1f}"] for stage, seconds in stages] + [["sum of the stages", f"**{total:.1f}**"]]
    return ["", *demo_machine(demo), "", *_table(["stage", "seconds"], rows), ""]


# where the docs build writes the demo's figures, relative to docs/ (the page is docs/results/demo.md)
DEMO_PLOTS_DIR = "results/demo-plots"


def _run_results(runs: list[JsonRecord], kind: str) -> list["RunResult"]:
    """The report's RunResult of each run record: held-out figures and curve, and the per-step
    series the record holds (``step_series``: metric -> [[step, value], ...])."""
    from calibrl.demo.report import RunResult

    results = []
    for run in runs:
        steps: dict[int, JsonObject] = {}
        for key, points in run.get("step_series", {}).items():
            for step, value in points:
                steps.setdefault(int(step), {"step": int(step)})[key] = value
        results.append(RunResult(name=run["name"], label=run["label"], kind=kind, heldout=run["heldout"],
                                 steps=[steps[s] for s in sorted(steps)],
                                 heldout_curve=[(int(s), float(v)) for s, v in run.get("heldout_curve", [])]))
    return results


def demo_plots(demo: JsonRecord, folder: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """Draw the demo's figures from its records into ``folder``: (caption, PNG path) of each,
    with the report's own plot functions (calibrl.demo.report)."""
    from calibrl.demo.report import STEP_PLOTS, plot_heldout, plot_step_metric

    folder.mkdir(parents=True, exist_ok=True)
    plots = []
    for kind, title, metric, primary in (("rewrite", "Rewriter", f"hit@{demo['top_k']}", "hit"),
                                         ("search", "Search agent", "answer F1", "f1")):
        runs = _run_results(demo.get(kind, []), kind)
        trained = [r for r in runs if r.trained]
        for key, what, stem in STEP_PLOTS:
            path = plot_step_metric(trained, key, f"{title}: {what}", folder / f"{kind}_{stem}.png")
            if path:
                plots.append((f"{title}: {what}", path))
        path = plot_heldout(runs, metric, folder / f"{kind}_heldout_{primary}.png")
        if path:
            plots.append((f"{title}: held-out {metric} over training", path))
    return plots


def demo_plot_lines(demo: JsonRecord) -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        plots = demo_plots(demo, pathlib.Path(scratch))
    if not plots:
        return [_source(demo), "", "The demo's records hold no curve to draw."]
    lines = [_source(demo) + " The figures are drawn from the same records when the site is built.", ""]
    for caption, path in plots:
        lines += [f"![{caption}](demo-plots/{path.name})", ""]
    return lines[:-1]


NO_STUDY = ("No study records are committed yet: `calibrl study` writes them (`results.json`), and "
            "`python scripts/render_results.py` fills this block from `results/study/results.json`.")


def _study_labels() -> dict[str, str]:
    from calibrl.studies import search_arms_report as report
    from calibrl.studies.search_arms import ARMS

    return {report.BASE: "the base", report.CONSTANT: "the best constant", **{a.name: a.label for a in ARMS}}


def study_verdict(records: JsonRecord | None) -> list[str]:
    """The study's source, what did not run, and its verdict lines (the README's summary)."""
    if records is None:
        return [NO_STUDY]
    from calibrl.studies import search_arms_report as report

    plan, summary = records["plan"], records["summary"]
    finished = sorted({str(seed["seed"]) for seed in records.get("seeds", [])}, key=int)
    command = report.commands_text(records, hide_out=True)
    lines = [f"Generated from `results/study/results.json` ({command}; seeds planned "
             f"{', '.join(map(str, plan['seeds']))}, with records from seeds {', '.join(finished) or 'none'}).", ""]
    if summary.get("missing_runs"):
        lines += ["Stopped part way: the figures cover the runs every seed with records finished; not run: "
                  + "; ".join(summary["missing_runs"]) + ".", ""]
    return lines + [f"- {line}" for line in report.verdict(plan, summary, _study_labels())]


def study(records: JsonRecord | None) -> list[str]:
    if records is None:
        return [NO_STUDY]
    from calibrl.studies import search_arms_report as report

    plan, summary, labels = records["plan"], records["summary"], _study_labels()
    lines = study_verdict(records) + ["", report.provenance_line(records, hide_out=True), "",
                                      *report.timing_lines(records.get("seeds", []))]
    for setting in summary["settings"]:
        lines += [f"Held-out answer F1, {setting} setting:", "", report.arm_table(plan, summary, setting, labels), "",
                  f"Paired differences of held-out answer F1 ({setting}), a - b:", "",
                  report.paired_table(summary, setting, labels), ""]
    return lines[:-1]


def bench_record(record: JsonRecord, name: str) -> list[str]:
    """A benchmark record's tables, each under its title, after the command, date and machine."""
    wall = f"; the run took {record['wall_s']:g} s wall" if record.get("wall_s") is not None else ""
    libraries = ", ".join(f"{k} {v}" for k, v in record.get("versions", {}).items())
    lines = ["", "```console", record["command"], "```", "",
             f"Machine: {record['machine']}" + (f"; {libraries}" if libraries else "") + f"{wall}. Generated from "
             f"the record `benchmarks/records/{name}.json`, measured {record['measured']}."]
    for item in record["tables"]:
        lines += ["", item["title"] + ":", "", *_table(item["header"], item["rows"])]
    for note in record.get("notes", []):
        lines += ["", note]
    return lines + [""]


def _load(path: pathlib.Path) -> JsonObject | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def renderers(results: pathlib.Path = RESULTS) -> dict[str, Callable[[], list[str]]]:
    """Block name -> a function giving its lines from the records under ``results``."""
    def demo() -> JsonObject:
        data = _load(results / "demo" / "results.json")
        if data is None:
            raise FileNotFoundError(f"{results / 'demo' / 'results.json'}: no committed demo records")
        return data

    return {
        "demo-search": lambda: demo_search(demo()),
        "demo-rewrite": lambda: demo_rewrite(demo()),
        "demo-judge": lambda: demo_judge(demo()),
        "demo-search-analysis": lambda: demo_search_analysis(demo()),
        "demo-machine": lambda: demo_machine(demo()),
        "demo-stages": lambda: demo_stages(demo()),
        "demo-plots": lambda: demo_plot_lines(demo()),
        "study": lambda: study(_load(results / "study" / "results.json")),
        "study-verdict": lambda: study_verdict(_load(results / "study" / "results.json")),
        **{f"bench-{path.stem}": (lambda path=path: bench_record(_load(path), path.stem))
           for path in sorted(BENCH_RECORDS.glob("*.json"))},
    }


def render_text(text: str, results: pathlib.Path = RESULTS) -> str:
    """``text`` with every generated block rewritten from the records."""
    table = renderers(results)

    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in table:
            raise KeyError(f"unknown generated block {name!r}: one of {sorted(table)}")
        return match.group(1) + "\n".join(table[name]()) + "\n" + match.group(4)

    return BLOCK.sub(fill, text)


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every page that may hold generated blocks: README.md, benchmarks/README.md and the Markdown
    under docs/."""
    return [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").rglob("*.md"))]


__all__ = ["BENCH_RECORDS", "BLOCK", "bench_record", "DEMO_PLOTS_DIR", "DEMO_RESULTS", "RESULTS", "STUDY_RESULTS", "demo_judge", "demo_machine",
           "demo_plot_lines", "demo_plots", "demo_rewrite", "demo_search", "demo_search_analysis", "demo_stages", "pages",
           "render_text", "renderers", "study", "study_verdict"]
