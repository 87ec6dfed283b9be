"""The demo's results: a table for the terminal, PNG plots and a Markdown report.

Inputs are plain: each training run's ``metrics.jsonl`` (one JSON object per step,
as ``calibrl.trainer.diagnostics.RunLog`` writes it) and the final held-out figures of
each policy. The report states what was measured, whatever it is: the verdict
lines are computed from the numbers, never written in advance.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TextIO

from calibrl.json_types import JsonObject, JsonRecord

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from calibrl.demo.training import Concurrency

# Per-step curves drawn for every training run: (metric key in metrics.jsonl, title, file stem).
STEP_PLOTS = (
    ("reward", "Mean reward per step", "reward"),
    ("frac_reward_zero_std", "Groups whose rewards are all equal (frac_reward_zero_std)", "frac_reward_zero_std"),
    ("kl", "KL to the reference policy", "kl"),
    ("grad_norm", "Gradient norm (before clipping)", "grad_norm"),
)


@dataclass
class RunResult:
    """One policy of the comparison: its final held-out figures and, for a trained
    policy, the per-step log and the held-out curve."""

    name: str  # short key, e.g. "binary"
    label: str  # what the table says, e.g. "GRPO, binary hit@3 reward"
    kind: str  # "rewrite" | "search"
    heldout: dict[str, float]  # final held-out metrics, e.g. {"hit": 0.28, "mrr": 0.21}
    steps: list[JsonRecord] = field(default_factory=list)  # metrics.jsonl records
    heldout_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out primary metric)
    wall_s: float = 0.0
    notes: str = ""

    @property
    def trained(self) -> bool:
        return bool(self.steps)

    def mean_of(self, key: str, last: int | None = None) -> float:
        """Mean of a per-step metric (over the last ``last`` steps); NaN when never logged."""
        values = [float(r[key]) for r in self.steps if _is_number(r.get(key))]
        if last:
            values = values[-last:]
        return sum(values) / len(values) if values else math.nan


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: float, percent: bool = False, digits: int = 3) -> str:
    if not _is_number(value):
        return "-"
    return f"{100 * value:.1f}%" if percent else f"{value:.{digits}g}"


# --- tables ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[["RunResult"], float]
    percent: bool = False


def rewrite_columns(k: int) -> list[Column]:
    return [
        Column(f"held-out hit@{k}", lambda r: r.heldout.get("hit", math.nan), percent=True),
        Column("mean reward (last 10 steps)", lambda r: r.mean_of("reward", 10)),
        Column("frac_reward_zero_std (mean)", lambda r: r.mean_of("frac_reward_zero_std"), percent=True),
        Column("KL (last 10)", lambda r: r.mean_of("kl", 10)),
        Column("grad norm (mean)", lambda r: r.mean_of("grad_norm")),
    ]


def search_columns() -> list[Column]:
    return [
        Column("held-out answer EM", lambda r: r.heldout.get("em", math.nan), percent=True),
        Column("held-out answer F1", lambda r: r.heldout.get("f1", math.nan), percent=True),
        Column("well-formed", lambda r: r.heldout.get("well_formed", math.nan), percent=True),
        Column("mean reward (last 10 steps)", lambda r: r.mean_of("reward", 10)),
        Column("KL (last 10)", lambda r: r.mean_of("kl", 10)),
        Column("grad norm (mean)", lambda r: r.mean_of("grad_norm")),
    ]


def table_rows(runs: Sequence[RunResult], columns: Sequence[Column]) -> tuple[list[str], list[list[str]]]:
    headers = ["policy", *[c.header for c in columns]]
    rows = [[run.label, *[_fmt(c.value(run), c.percent) for c in columns]] for run in runs]
    return headers, rows


def markdown_table(runs: Sequence[RunResult], columns: Sequence[Column]) -> str:
    headers, rows = table_rows(runs, columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(runs: Sequence[RunResult], columns: Sequence[Column]) -> str:
    """A fixed-width table for the terminal."""
    headers, rows = table_rows(runs, columns)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


# --- plots ----------------------------------------------------------------------------------------------------------


def plot_step_metric(runs: Sequence[RunResult], key: str, title: str, path: pathlib.Path, *,
                     band: float | None = None, ylabel: str | None = None) -> pathlib.Path | None:
    """One line per trained run of ``key`` over training steps; None when no run logged it.
    ``band``: shade the warning band above it (a share: the axis then runs 0-1)."""
    series = []
    for run in runs:
        points = [(r["step"], float(r[key])) for r in run.steps if _is_number(r.get(key))]
        if points:
            series.append((run.label, points))
    if not series:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if band is not None:
        axes.axhspan(band, 1.0, color="tab:red", alpha=0.12, label=f"warning band (> {band:g})")
        axes.set_ylim(0.0, 1.0)
    for label, points in series:
        xs, ys = zip(*points)
        axes.plot(xs, ys, label=label, linewidth=1.4)
    axes.set_xlabel("training step")
    if ylabel:
        axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9 if band is not None else 10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot_heldout(runs: Sequence[RunResult], metric_label: str, path: pathlib.Path) -> pathlib.Path | None:
    """Held-out metric over training steps for each trained run, untrained runs as flat lines."""
    trained = [r for r in runs if r.heldout_curve]
    if not trained:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    last_step = max(step for r in trained for step, _ in r.heldout_curve)
    flat_styles = iter([("--", "dimgrey"), (":", "black"), ("-.", "darkgrey")] * 4)
    for run in runs:
        if run.heldout_curve:
            xs, ys = zip(*run.heldout_curve)
            axes.plot(xs, [100 * y for y in ys], marker="o", markersize=3, label=run.label, linewidth=1.4)
        elif _is_number(run.heldout.get(_primary(run))):
            value = 100 * run.heldout[_primary(run)]
            style, color = next(flat_styles)
            axes.plot([0, last_step], [value, value], linestyle=style, color=color, label=run.label)
    axes.set_xlabel("training step")
    axes.set_ylabel(f"{metric_label} (%)")
    axes.set_title(f"Held-out {metric_label} over training", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _primary(run: RunResult) -> str:
    return "hit" if run.kind == "rewrite" else "f1"


def _pyplot() -> "ModuleType":
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- verdicts -------------------------------------------------------------------------------------------------------


def rewrite_verdict(base: RunResult, runs: Sequence[RunResult], k: int,
                    analysis: JsonRecord | None = None) -> list[str]:
    """Sentences stating what the rewrite comparison measured, computed from the numbers:
    each trained arm's held-out hit@k beside the base's, then (with ``analysis``, from
    :func:`calibrl.demo.rewrite_analysis.rewrite_results`) every paired comparison, worded
    by its interval."""
    from calibrl.demo.rewrite_analysis import rewrite_comparison_lines

    lines = []
    base_hit = base.heldout.get("hit", math.nan)
    for run in runs:
        hit = run.heldout.get("hit", math.nan)
        lines.append(
            f"{run.label}: held-out hit@{k} {_fmt(base_hit, True)} (base) -> {_fmt(hit, True)}; "
            f"{_fmt(run.mean_of('frac_reward_zero_std'), True)} of its training groups had rewards all equal "
            "(no learning signal)."
        )
    if analysis:
        labels = {"raw": "the raw query", "base": "the base rewriter", **{r.name: r.label for r in runs}}
        lines += rewrite_comparison_lines(dict(analysis), labels, k)
    return lines


def search_verdict(base: RunResult, runs: Sequence[RunResult]) -> list[str]:
    """Each trained agent's held-out figures beside the base's, and what CalibAdv changed;
    the paired comparisons (with the base, the best constant answer and each other) follow
    in the error analysis section, worded by their intervals."""
    lines = []
    base_f1 = base.heldout.get("f1", math.nan)
    for run in runs:
        f1 = run.heldout.get("f1", math.nan)
        lines.append(
            f"{run.label}: held-out answer F1 {_fmt(base_f1, True)} (base) -> {_fmt(f1, True)}, exact match "
            f"{_fmt(base.heldout.get('em', math.nan), True)} -> {_fmt(run.heldout.get('em', math.nan), True)}, "
            f"well-formed trajectories {_fmt(run.heldout.get('well_formed', math.nan), True)}."
        )
    lines += [line for run in runs if (line := calibadv_interventions(run))]
    return lines


INTERVENTIONS = ("calibadv/neg_search_steps", "calibadv/frac_neg_search_steps_softened",
                 "calibadv/frac_neg_search_steps_found_gold", "calibadv/frac_softened_found_gold",
                 "calibadv/adv_change_search", "calibadv/adv_change_answer", "calibadv/frac_tokens_softened",
                 "calibadv/frac_groups_answer_zeroed")


def calibadv_interventions(run: RunResult) -> str:
    """What a CalibAdv run changed against plain group advantages, as means over its steps;
    "" for a run that logged no CalibAdv interventions."""
    if not _is_number(run.mean_of("calibadv/neg_search_steps")):
        return ""
    return (f"{run.label} changed GRPO's advantages this way (means over its training steps): of the search steps "
            f"of trajectories with a negative advantage ({run.mean_of('calibadv/neg_search_steps'):.1f} per step, "
            f"each penalised in full by GRPO) it softened "
            f"{_fmt(run.mean_of('calibadv/frac_neg_search_steps_softened'), True)}; "
            f"{_fmt(run.mean_of('calibadv/frac_neg_search_steps_found_gold'), True)} of those steps, and "
            f"{_fmt(run.mean_of('calibadv/frac_softened_found_gold'), True)} of the softened ones, had retrieved a "
            f"gold document; mean advantage change {run.mean_of('calibadv/adv_change_search'):+.3f} on search tokens "
            f"and {run.mean_of('calibadv/adv_change_answer'):+.3f} on answer tokens; the rebalance zeroed the answers "
            f"of {_fmt(run.mean_of('calibadv/frac_groups_answer_zeroed'), True)} of the groups with a learning "
            "signal.")


# --- the report -----------------------------------------------------------------------------------------------------


@dataclass
class DemoReport:
    """Everything the report shows."""

    title: str
    command: str
    machine: str
    settings: Mapping[str, object]
    rewrite_runs: list[RunResult]
    search_runs: list[RunResult]
    top_k: int
    stages: list[tuple[str, float]]  # (stage, seconds)
    notes: list[str] = field(default_factory=list)
    judge_sections: list[str] = field(default_factory=list)  # Markdown lines after the rewriter's section
    judge_results: JsonObject = field(default_factory=dict)  # results.json "judge"
    search_analysis: JsonObject = field(default_factory=dict)  # calibrl.demo.error_analysis.analysis_results
    rewrite_analysis: JsonObject = field(default_factory=dict)  # calibrl.demo.rewrite_analysis.rewrite_results
    concurrency: "Concurrency | None" = None  # the training stage's processes: spans, judge figures while paired


def write_report(report: DemoReport, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Write ``report.md``, ``results.json`` and the PNG plots under ``out_dir``; returns report.md."""
    out = pathlib.Path(out_dir)
    plots_dir = out / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    k = report.top_k
    sections = [f"# {report.title}", ""]
    sections += [
        "Measured by `" + report.command + "` on " + report.machine + ".",
        "Every number below comes from this run; nothing is filled in by hand.",
        "",
    ]

    plots: list[tuple[str, pathlib.Path]] = []
    by_name = {r.name: r for r in report.rewrite_runs}
    if report.rewrite_runs:
        sections += ["## Query rewriter: binary vs blended dense reward", ""]
        sections += [markdown_table(report.rewrite_runs, rewrite_columns(k)), ""]
        base = by_name.get("base")
        if base is not None:
            trained_runs = [r for r in report.rewrite_runs if r.trained]
            sections += [f"- {line}" for line in rewrite_verdict(base, trained_runs, k, report.rewrite_analysis)]
            sections.append("")
        trained = [r for r in report.rewrite_runs if r.trained]
        for key, title, stem in STEP_PLOTS:
            path = plot_step_metric(trained, key, f"Rewriter: {title}", plots_dir / f"rewrite_{stem}.png")
            if path:
                plots.append((f"Rewriter: {title}", path))
        path = plot_heldout(report.rewrite_runs, f"hit@{k}", plots_dir / "rewrite_heldout_hit.png")
        if path:
            plots.append((f"Rewriter: held-out hit@{k} over training", path))
    sections += report.judge_sections
    search_by_name = {r.name: r for r in report.search_runs}
    if report.search_runs:
        sections += ["## Two-search agent: GRPO vs CalibAdv", ""]
        sections += [markdown_table(report.search_runs, search_columns()), ""]
        base = search_by_name.get("base_agent")
        if base is not None:
            sections += [f"- {line}" for line in search_verdict(base, [r for r in report.search_runs if r.trained])]
            sections.append("")
        trained = [r for r in report.search_runs if r.trained]
        for key, title, stem in STEP_PLOTS:
            path = plot_step_metric(trained, key, f"Search agent: {title}", plots_dir / f"search_{stem}.png")
            if path:
                plots.append((f"Search agent: {title}", path))
        path = plot_heldout(report.search_runs, "answer F1", plots_dir / "search_heldout_f1.png")
        if path:
            plots.append(("Search agent: held-out answer F1 over training", path))
    if report.search_analysis:
        from calibrl.demo.error_analysis import analysis_markdown

        sections += analysis_markdown(report.search_analysis)

    if plots:
        sections += ["## Plots", ""]
        for caption, path in plots:
            sections += [f"![{caption}](plots/{path.name})", ""]
    sections += ["## Settings", "", "| setting | value |", "| --- | --- |"]
    sections += [f"| {key} | {value} |" for key, value in report.settings.items()]
    sections.append("")
    if report.stages:
        total = sum(s for _, s in report.stages)
        sections += ["## Time per stage", "", "| stage | seconds |", "| --- | --- |"]
        sections += [f"| {stage} | {seconds:.1f} |" for stage, seconds in report.stages]
        sections += [f"| total | {total:.1f} |", ""]
    if report.notes:
        sections += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]

    path = out / "report.md"
    path.write_text("\n".join(sections), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(_results_json(report), indent=2) + "\n", encoding="utf-8")
    return path


def _results_json(report: DemoReport) -> JsonObject:
    def run_json(run: RunResult) -> JsonObject:
        return {
            "name": run.name,
            "label": run.label,
            "kind": run.kind,
            "heldout": run.heldout,
            "heldout_curve": [list(p) for p in run.heldout_curve],
            "steps": len(run.steps),
            # the per-step curves the report plots (STEP_PLOTS), so the docs can draw them from this record
            "step_series": {key: [[r["step"], float(r[key])] for r in run.steps if _is_number(r.get(key))]
                            for key, _, _ in STEP_PLOTS if any(_is_number(r.get(key)) for r in run.steps)},
            "mean_frac_reward_zero_std": _json_safe(run.mean_of("frac_reward_zero_std")),
            "final_reward": _json_safe(run.mean_of("reward", 10)),
            "wall_s": round(run.wall_s, 2),
            # what CalibAdv changed against GRPO's advantages, means over the training steps (none for GRPO)
            **({"interventions": {key: _json_safe(run.mean_of(key)) for key in INTERVENTIONS}}
               if _is_number(run.mean_of("calibadv/neg_search_steps")) else {}),
        }

    return {
        "command": report.command,
        "machine": report.machine,
        "top_k": report.top_k,
        "settings": {k: str(v) for k, v in report.settings.items()},
        "rewrite": [run_json(r) for r in report.rewrite_runs],
        "search": [run_json(r) for r in report.search_runs],
        "search_analysis": report.search_analysis,
        "rewrite_analysis": report.rewrite_analysis,
        "stages": [[stage, round(s, 2)] for stage, s in report.stages],
        **({"judge": report.judge_results} if report.judge_results else {}),
    }


def _json_safe(value: float) -> float | None:
    return value if _is_number(value) else None


def print_tables(report: DemoReport, stream: TextIO | None = None) -> None:
    """The result tables, fixed width, for the terminal."""
    import sys

    stream = stream or sys.stdout
    if report.rewrite_runs:
        print("\nQuery rewriter (held-out tasks)", file=stream)
        print(text_table(report.rewrite_runs, rewrite_columns(report.top_k)), file=stream)
    if report.search_runs:
        print("\nTwo-search agent (held-out questions)", file=stream)
        print(text_table(report.search_runs, search_columns()), file=stream)


__all__ = [
    "DemoReport", "RunResult", "STEP_PLOTS", "markdown_table", "plot_heldout", "plot_step_metric", "print_tables",
    "rewrite_verdict", "search_verdict", "text_table", "write_report",
]
