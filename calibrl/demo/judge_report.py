"""The demo report's judge part: two judges validated side by side, the shared server's
per-rubric figures (also while two agents' training runs called it at once), the
judge/retrieval disagreement plot and the dynamic-sampling verdict.

Inputs are plain: validation records (:class:`calibrl.judge_server.authoring.validation.ValidationRecord`),
the judge server's Prometheus text (``telemetry.prometheus_port``: calls, batch sizes and
cache lookups by rubric) and the runs' per-step logs. Every sentence is computed from them.
"""

from __future__ import annotations

import math
import pathlib
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from calibrl.json_types import JsonObject, JsonRecord

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.experts import PairKappa
    from calibrl.demo.report import RunResult
    from calibrl.demo.services import RunSpan
    from calibrl.judge_server.validation_records import ValidationRecord


def _fmt(value: object, digits: int = 3) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}"


# --- validation, side by side ---------------------------------------------------------------------------------------


def validation_rows(records: Mapping[str, "ValidationRecord"]) -> list[JsonObject]:
    """One row per (judge label, criterion or overall): the figures of each validation record."""
    rows = []
    for label, record in records.items():
        grades = record.metrics.get("grades", {})
        rows.append({"judge": label, "rubric": record.rubric_id, "model_id": record.model_id,
                     "passed": record.passed, "kappa": record.kappa,
                     "kappa_low": getattr(record, "kappa_low", None), "kappa_high": getattr(record, "kappa_high", None),
                     "gate": getattr(record, "gate", "estimate"), "min_kappa": record.min_kappa,
                     "reason": record.reason,
                     "quadratic_weighted_kappa": grades.get("quadratic_weighted_kappa"),
                     "n_items": record.n_items, "pass_threshold": record.pass_threshold,
                     "pass_threshold_source": record.pass_threshold_source,
                     "criteria": {name: {k: c.get(k) for k in ("tags", "precision", "recall", "support")}
                                  for name, c in record.metrics.get("criteria", {}).items()}})
    return rows


def _with_interval(row: JsonRecord) -> str:
    if row["kappa_low"] is None or row["kappa_high"] is None:
        return _fmt(row["kappa"])
    return f"{_fmt(row['kappa'])} [{row['kappa_low']:.2f}, {row['kappa_high']:.2f}]"


def _gate_text(row: JsonRecord) -> str:
    verdict = "passed" if row["passed"] else "FAILED"
    on = "interval's low end" if row["gate"] == "lower_bound" else "estimate"
    return f"{verdict} ({on} vs {row['min_kappa']:g})"


def validation_section(records: Mapping[str, "ValidationRecord"], min_kappa: float,
                       panel: Sequence["PairKappa"] = ()) -> list[str]:
    """Markdown: the overall agreement of each judge (kappa with its 95% bootstrap interval, the
    pass threshold and where it was picked, the gate's decision), its per-criterion precision
    and recall, and the experts' own agreement (``panel``: :class:`calibrl.demo.experts.PairKappa`)."""
    rows = validation_rows(records)
    lower = any(row["gate"] == "lower_bound" for row in rows)
    gate = (f"the whole 95% bootstrap interval of Cohen's kappa on pass/fail >= {min_kappa:g}" if lower
            else f"Cohen's kappa on pass/fail >= {min_kappa:g}")
    lines = ["## Two judges on the SME golden set", "",
             f"Both judges were validated on the same golden hold-out (never trained on, nor read by a warm start); "
             f"each judge's pass threshold was picked on the non-golden reviews; the gate is {gate}. Intervals "
             "resample golden items in clusters of one query (10,000 resamples, seed 0).", "",
             "| judge | rubric | model id | golden items | pass threshold | Cohen's kappa [95% interval] | "
             "quadratic-weighted kappa | gate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        source = " (auto)" if row["pass_threshold_source"] == "auto" else ""
        lines.append(f"| {row['judge']} | {row['rubric']} | `{row['model_id']}` | {row['n_items']} | "
                     f"{row['pass_threshold']:.3f}{source} | {_with_interval(row)} | "
                     f"{_fmt(row['quadratic_weighted_kappa'])} | {_gate_text(row)} |")
    lines += [""] + [f"- {row['judge']}: gate {'passed' if row['passed'] else 'FAILED'}: {row['reason']}"
                     for row in rows]
    if panel:
        from calibrl.demo.experts import agreement_line

        lines += ["", "What a judge can be expected to reach: the simulated experts' " + agreement_line(panel)[
            len("experts' "):] + ". Each golden item carries one expert's grade."]
    lines += ["", "Per criterion (a criterion flags an item when its score is below 0.5; the truth is the SME's "
              "error tag):", "", "| judge | criterion | SME tag | tagged items | precision | recall |",
              "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for name, c in row["criteria"].items():
            lines.append(f"| {row['judge']} | {name} | {', '.join(c['tags'] or []) or '-'} | {c['support']} | "
                         f"{_fmt(c['precision'])} | {_fmt(c['recall'])} |")
    return lines + [""]


# --- the shared server's figures, from its Prometheus /metrics ------------------------------------------------------


@dataclass
class RubricServerStats:
    """What the judge server did for one rubric."""

    calls: int = 0  # Score RPCs
    batches: int = 0  # computed batches (callers joined)
    batch_items: int = 0  # items computed in those batches
    cache_hits: int = 0
    cache_misses: int = 0
    shared_batches: int = 0  # batches that joined several Score calls
    beside_batches: int = 0  # batches computed while a call of another rubric waited

    @property
    def mean_batch_size(self) -> float:
        return self.batch_items / self.batches if self.batches else math.nan

    def to_json(self) -> JsonObject:
        return {"calls": self.calls, "batches": self.batches, "batch_items": self.batch_items,
                "mean_batch_size": None if not self.batches else round(self.mean_batch_size, 3),
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "shared_batches": self.shared_batches, "beside_batches": self.beside_batches}

    def minus(self, earlier: "RubricServerStats") -> "RubricServerStats":
        """What the server did between two scrapes (``earlier`` first)."""
        return RubricServerStats(**{k: getattr(self, k) - getattr(earlier, k) for k in self.__dataclass_fields__})


def parse_judge_stats(text: str) -> dict[str, RubricServerStats]:
    """Per rubric figures of the judge server's Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    stats: dict[str, RubricServerStats] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rubric = sample.labels.get("rubric")
            if rubric is None:
                continue
            entry = stats.setdefault(rubric, RubricServerStats())
            value = int(round(sample.value))
            if sample.name == "calibrl_judge_calls_total":
                entry.calls += value
            elif sample.name == "calibrl_judge_batch_size_count":
                entry.batches += value
            elif sample.name == "calibrl_judge_batch_size_sum":
                entry.batch_items += value
            elif sample.name == "calibrl_judge_batch_mix_total":
                entry.shared_batches += value if sample.labels.get("calls") == "several" else 0
                entry.beside_batches += value if sample.labels.get("other_rubric") == "waiting" else 0
            elif sample.name == "calibrl_cache_lookups_total":
                if sample.labels.get("result") == "hit":
                    entry.cache_hits += value
                else:
                    entry.cache_misses += value
    return stats


def scrape_judge_stats(port: int, host: str = "127.0.0.1", timeout_s: float = 10.0) -> dict[str, RubricServerStats]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:
        return parse_judge_stats(response.read().decode("utf-8"))


_SERVER_COLUMNS = ("| Score calls | batches | mean batch size | batches joining several calls | batches while "
                   "another rubric's call waited | cache hits | cache misses |")


def _server_cells(entry: RubricServerStats) -> str:
    return (f"{entry.calls} | {entry.batches} | {_fmt(entry.mean_batch_size, 1)} | {entry.shared_batches} | "
            f"{entry.beside_batches} | {entry.cache_hits} | {entry.cache_misses} |")


def server_section(stats: Mapping[str, RubricServerStats], served: Mapping[str, str],
                   callers: Mapping[str, Sequence[str]]) -> list[str]:
    """Markdown: per served rubric, its scorer and what the one judge server did for it."""
    lines = ["## One judge server, every rubric", "",
             "One `calibrl serve judge` process served every rubric below (figures from its Prometheus "
             "`/metrics`; a batch joins concurrent callers of one rubric, so the mean batch size is across callers; "
             "batches never mix rubrics, the server takes the rubrics' queues in turns).", "",
             "| rubric | scored by | runs that called it " + _SERVER_COLUMNS,
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rubric_id, scorer in served.items():
        who = ", ".join(callers.get(rubric_id, ())) or "none in this run"
        lines.append(f"| {rubric_id} | {scorer} | {who} | " + _server_cells(stats.get(rubric_id, RubricServerStats())))
    return lines + [""]


# --- two agents at once ---------------------------------------------------------------------------------------------


def concurrency_section(spans: Mapping[str, "RunSpan"], pair: tuple[str, str], labels: Mapping[str, str],
                        during: Mapping[str, RubricServerStats] | None) -> list[str]:
    """Markdown: when and where each training run ran (``spans``: name -> :class:`calibrl.demo.services.RunSpan`),
    how long the two agents of ``pair`` overlapped, and what the judge server did for each
    rubric while both ran (``during``: the /metrics difference over that window)."""
    from calibrl.demo.services import overlap_seconds

    more = [n for n, span in spans.items() if n not in pair and span.where != "demo process"]
    names = ", ".join(f"`{n}`" for n in more)
    later = f"{names} then started as processes, each when a running one ended (two at once)" if more else ""
    rest = any(span.where == "demo process" for span in spans.values())
    afterwards = ("; " + (f"{later}, and " if later else "") + "the demo trained the rest itself afterwards"
                  if rest else (f"; {later}" if later else ""))
    lines = ["## Two agents on one judge server at once", "",
             f"The `{pair[0]}` and `{pair[1]}` runs were two `calibrl train` processes started together, each "
             f"reaching the retrieval and judge servers over gRPC{afterwards}. "
             "Times are seconds since the training stage started; a process's wall time includes its start-up "
             "(torch, transformers, the policy).", "",
             "| run | where | start (s) | end (s) | wall (s) |", "| --- | --- | --- | --- | --- |"]
    for name, span in spans.items():
        lines.append(f"| {labels.get(name, name)} | {span.where} | {span.start_s:.1f} | {span.end_s:.1f} | "
                     f"{span.seconds:.1f} |")
    first, second = (spans.get(name) for name in pair)
    if first is None or second is None:
        return lines + [""]
    both = overlap_seconds(first, second)
    lines += ["", f"The rewriter's `{pair[0]}` run and the search agent's `{pair[1]}` run ran at the same time for "
              f"{both:.1f} s ({100 * both / max(first.seconds, 1e-9):.0f}% of `{pair[0]}`'s wall time, "
              f"{100 * both / max(second.seconds, 1e-9):.0f}% of `{pair[1]}`'s)."]
    if during:
        lines += ["While both ran (until the first of them ended), the judge server did this per rubric:", "",
                  "| rubric " + _SERVER_COLUMNS, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {rubric_id} | " + _server_cells(entry) for rubric_id, entry in during.items() if entry.calls]
    return lines + [""]


# --- judge vs retrieval ---------------------------------------------------------------------------------------------

DISAGREEMENT_KEY = "rewards/judge_retrieval_disagreement"


def plot_disagreement(runs: Sequence["RunResult"], band: float, path: pathlib.Path) -> pathlib.Path | None:
    """``rewards/judge_retrieval_disagreement`` per step of each run that logged it, with
    the warning band (above ``band`` the trainer warns)."""
    from calibrl.demo.report import plot_step_metric

    return plot_step_metric(runs, DISAGREEMENT_KEY, "Judge vs retrieval disagreement (rubric high & gold missed, "
                            "or the reverse)", path, band=band, ylabel="share of rewrites")


def disagreement_lines(runs: Sequence["RunResult"], band: float) -> list[str]:
    lines = []
    for run in runs:
        values = [float(r[DISAGREEMENT_KEY]) for r in run.steps if isinstance(r.get(DISAGREEMENT_KEY), (int, float))]
        if values:
            above = sum(v > band for v in values)
            lines.append(f"{run.label}: judge and retrieval disagreed on {100 * sum(values) / len(values):.1f}% of "
                         f"rewrites on average (last step {100 * values[-1]:.1f}%); {above} of {len(values)} steps "
                         f"were in the warning band (> {100 * band:.0f}%).")
    return lines


# --- dynamic sampling -----------------------------------------------------------------------------------------------


def dynamic_sampling_lines(binary: "RunResult | None", dynamic: "RunResult | None", dense: "RunResult | None",
                           k: int, analysis: JsonRecord | None = None) -> list[str]:
    """Does dynamic sampling rescue the binary reward, or does the reward's density matter?
    The comparisons come from the task-by-task analysis
    (:func:`calibrl.demo.rewrite_analysis.rewrite_results`), each worded by its interval."""
    from calibrl.demo.rewrite_analysis import rewrite_comparison_lines

    if binary is None or dynamic is None:
        return []
    kept = dynamic.mean_of("sampling/kept_groups")
    extra = dynamic.mean_of("sampling/extra_rollouts")
    lines = [f"Binary reward + dynamic sampling kept {_fmt(kept, 1)} groups with unequal rewards per step on average "
             f"and drew {_fmt(extra, 1)} extra rollouts per step to find them (same number of policy updates)."]
    if analysis:
        wanted = {(dynamic.name, binary.name)} | ({(dense.name, dynamic.name)} if dense is not None else set())
        picked = {**analysis, "comparisons": [c for c in analysis["comparisons"] if (c["a"], c["b"]) in wanted]}
        labels = {run.name: run.label for run in (binary, dynamic, dense) if run is not None}
        lines += rewrite_comparison_lines(picked, labels, k)
    return lines


__all__ = [
    "DISAGREEMENT_KEY", "RubricServerStats", "concurrency_section", "disagreement_lines", "dynamic_sampling_lines",
    "parse_judge_stats",
    "plot_disagreement", "scrape_judge_stats", "server_section", "validation_rows", "validation_section",
]
