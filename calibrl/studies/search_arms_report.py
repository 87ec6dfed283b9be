"""The study's results: ``results.json``, ``report.md`` and ``plots/``.

Input: one record per seed (``calibrl.studies.search_arms.run_seed``): the held-out questions,
the base agent's and every trained arm's per-question scores, and each run's per-step
collapse signals. Intervals and paired differences come from ``calibrl.stats`` over
questions: when every seed has its own questions (the demo generates a domain per
seed) each unit is a (seed, question) pair, resampled within its seed; when the
seeds share their questions each question's F1 is first averaged over seeds. Phrasings
of one question (task ids ``<question>-<n>``, ``calibrl.demo.error_analysis.question_of``)
are resampled together, and so are the questions through one bridge document (the same
account or fund asked about different facts). Beside each paired interval, a
hierarchical one (``calibrl.stats.hierarchical_difference``: seeds drawn, then each
seed's bridge clusters) adds the variance of training seeds. The best constant answer
per aspect (fitted on each seed's training questions; ``calibrl.demo.error_analysis``)
is compared with every arm like the base.
The verdict lines are computed from these numbers, never written in advance.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import re
from typing import Mapping, Sequence, Union

from calibrl.json_types import JsonObject, JsonRecord, JsonValue
from calibrl.stats import Interval, average_over_seeds, hierarchical_difference, mean_interval, paired_difference

BASE = "base"
CONSTANT = "best_constant"  # the best constant answer per aspect, scored like an arm
# Collapse signals drawn per step: (metric key in the run's step records, title, file stem).
SIGNALS = (
    ("search/first_gold_found", "Bridge document found (training rollouts)", "bridge_found"),
    ("search/all_gold_found", "Bridge and answer document found (training rollouts)", "all_found"),
    ("search/well_formed", "Well-formed trajectories (training rollouts)", "well_formed"),
    ("search/searches_per_trajectory", "Searches per trajectory", "searches_per_trajectory"),
    ("search/repeated_share", "Share of repeated searches", "repeated_share"),
    ("entropy", "Token entropy of generated tokens", "entropy"),
    ("policy/ref_ppl", "Perplexity of generated tokens under the frozen reference", "ref_ppl"),
    ("reward", "Mean reward", "reward"),
)
SIGNAL_COLUMNS = {"search/first_gold_found": "bridge found", "search/all_gold_found": "both found",
                  "search/well_formed": "well-formed", "search/searches_per_trajectory": "searches/traj",
                  "search/repeated_share": "repeated", "entropy": "entropy", "policy/ref_ppl": "reference PPL",
                  "reward": "reward"}
# What CalibAdv changed, per step (the verdict's "why" when it does not beat GRPO).
CALIBADV_SIGNALS = ("calibadv/frac_tokens_softened", "calibadv/frac_groups_answer_zeroed", "frac_reward_zero_std",
                    "calibadv/frac_neg_search_steps_softened", "calibadv/frac_neg_search_steps_found_gold",
                    "calibadv/frac_softened_found_gold", "calibadv/adv_change_search", "calibadv/adv_change_answer")
LAST_STEPS = 5  # the collapse table averages each signal over the last this many steps
COLLAPSED_WELL_FORMED = 0.9  # a sign of collapse: held-out well-formed rate below this share of the base's
PPL_GROWTH = 2.0  # a sign of collapse: reference PPL over the last steps above this multiple of the first step's


# --------------------------------------------------------------------------- numbers


def shared_questions(records: Sequence[JsonRecord]) -> bool:
    """Whether every seed evaluated the same questions in the same order."""
    return all(r["questions"] == records[0]["questions"] for r in records)


def scores_of(record: JsonRecord, setting: str, arm: str, metric: str = "f1") -> list[float]:
    """Per-question ``metric`` of ``arm`` (or the base) under ``setting`` in one seed's record."""
    source = (record["base"] if arm == BASE else record["constant"] if arm == CONSTANT
              else record["runs"][setting][arm]["scores"])
    return [float(v) for v in source[metric]]


def has_constant(records: Sequence[JsonRecord]) -> bool:
    """Whether every seed scored the best-constant baseline."""
    return all("constant" in r for r in records)


# a resampling cluster: a bridge document id or a question id, with its seed when seeds differ
ClusterLabel = Union[JsonValue, tuple[JsonValue, JsonValue]]


def _cluster_label(question: JsonRecord) -> JsonValue:
    """A question's resampling cluster: its bridge document where recorded, else the question
    behind its phrasing."""
    from calibrl.demo.error_analysis import question_of

    return question.get("bridge") or question_of(question["task_id"])


def units(records: Sequence[JsonRecord], setting: str, arm: str,
          metric: str = "f1") -> tuple[list[float], list[int] | None]:
    """The resampling units of an arm: (values, strata). Shared questions: one value per
    question, averaged over seeds, no strata; else one per (seed, question), stratum = seed."""
    per_seed = [scores_of(r, setting, arm, metric) for r in records]
    if shared_questions(records):
        return average_over_seeds(per_seed), None
    values = [v for scores in per_seed for v in scores]
    strata = [r["seed"] for r, scores in zip(records, per_seed) for _ in scores]
    return values, strata


def question_clusters(records: Sequence[JsonRecord]) -> list[ClusterLabel] | None:
    """The question behind each unit of :func:`units` (its phrasings are not independent),
    or None when every unit is a question of its own (one phrasing each)."""
    if shared_questions(records):
        labels: list[ClusterLabel] = [_cluster_label(q) for q in records[0]["questions"]]
    else:
        labels = [(r["seed"], _cluster_label(q)) for r in records for q in r["questions"]]
    return labels if len(set(labels)) < len(labels) else None


def arm_summary(records: Sequence[JsonRecord], setting: str, arm: str, seed: int = 0) -> JsonObject:
    """An arm's mean held-out F1 with its interval, every seed's mean, and its EM and
    well-formed rates (means over the same units)."""
    values, strata = units(records, setting, arm)
    interval = mean_interval(values, strata=strata, clusters=question_clusters(records), seed=seed)
    per_seed = {str(r["seed"]): _mean(scores_of(r, setting, arm)) for r in records}
    summary = {
        "f1": interval.as_dict(), "per_seed_f1": per_seed,
        "em": _mean(units(records, setting, arm, "em")[0]),
    }
    if arm == CONSTANT:
        return summary
    summary.update({
        "well_formed": _mean(units(records, setting, arm, "well_formed")[0]),
        "searches": _mean(units(records, setting, arm, "searches")[0]),
        "categories": category_shares(records, setting, arm),
    })
    summary.update(readout_summary(records, setting, arm))
    if all("recall" in (r["base"] if arm == BASE else r["runs"][setting][arm]["scores"]) for r in records):
        summary["recall"] = _mean(units(records, setting, arm, "recall")[0])
        summary["bridge_found"] = _mean(units(records, setting, arm, "bridge_found")[0])
    return summary


def has_recall(records: Sequence[JsonRecord], setting: str, arms: Sequence[str]) -> bool:
    """Whether every seed's base and arms carry per-question search recall."""
    return all("recall" in r["base"] and all("recall" in r["runs"][setting][a]["scores"] for a in arms)
               for r in records)


def long_curves(records: Sequence[JsonRecord], setting: str, arm: str) -> JsonObject | None:
    """The held-out figures along a run evaluated at several checkpoints (the long setting):
    per checkpoint step the mean over seeds of each curve metric, and the hierarchical
    interval (seeds, then bridge clusters) of last - best checkpoint in search recall and in
    the well-formed rate, the best chosen on the mean curve. None without curves."""
    curves = [r["runs"][setting][arm].get("curve") for r in records]
    if not all(curves):
        return None
    steps = [point["step"] for point in curves[0]]
    if any([p["step"] for p in c] != steps for c in curves):
        return None
    out: JsonObject = {"steps": steps}
    for metric in ("f1", "recall", "well_formed", "bridge_found"):
        out[metric] = [_mean([_mean(c[n][metric]) for c in curves]) for n in range(len(steps))]
    clusters = [[_cluster_label(q) for q in r["questions"]] for r in records]
    for metric in ("recall", "well_formed"):
        best = max(range(len(steps)), key=lambda n: out[metric][n])
        out[f"last_minus_best_{metric}"] = {
            "best_step": steps[best], **hierarchical_difference(
                [c[-1][metric] for c in curves], [c[best][metric] for c in curves],
                clusters_per_seed=clusters).as_dict()}
    return out


def readout_summary(records: Sequence[JsonRecord], setting: str, arm: str) -> JsonObject:
    """Over every (seed, question): of the trajectories that found the answer document, the
    share answering it exactly (``readout_rate``); of the exact answers, the share grounded in
    a retrieved passage (``grounded_share``). Empty for records without these fields."""
    sources = [r["base"] if arm == BASE else r["runs"][setting][arm]["scores"] for r in records]
    if not all("found_answer_doc" in src for src in sources):
        return {}
    found = [(f, e) for src in sources for f, e in zip(src["found_answer_doc"], src["em"])]
    hits = sum(f for f, _ in found)
    out: JsonObject = {"found_answer_doc": hits / len(found),
                           "readout_rate": sum(f * e for f, e in found) / hits if hits else None}
    if all("grounded" in src for src in sources):
        pairs = [(g, e) for src in sources for g, e in zip(src["grounded"], src["em"])]
        correct = sum(e for _, e in pairs)
        out["grounded_share"] = sum(g * e for g, e in pairs) / correct if correct else None
    return out


def category_shares(records: Sequence[JsonRecord], setting: str, arm: str) -> dict[str, float]:
    """Share of each error-analysis category (``calibrl.demo.error_analysis``) over every
    (seed, question); empty when the scores carry no categories."""
    labels = [c for r in records
              for c in (r["base"] if arm == BASE else r["runs"][setting][arm]["scores"]).get("category", [])]
    return {c: labels.count(c) / len(labels) for c in sorted(set(labels))} if labels else {}


def paired(records: Sequence[JsonRecord], setting: str, a: str, b: str, seed: int = 0,
           metric: str = "f1") -> Interval:
    """Paired bootstrap of ``a - b`` in ``metric`` (answer F1, or ``em``) over the same questions (and seeds)."""
    left, strata = units(records, setting, a, metric)
    right, _ = units(records, setting, b, metric)
    return paired_difference(left, right, strata=strata, clusters=question_clusters(records), seed=seed)


def between_seeds(records: Sequence[JsonRecord], setting: str, a: str, b: str, seed: int = 0,
                  metric: str = "f1") -> Interval:
    """The hierarchical bootstrap of ``a - b``: seeds drawn with replacement, then each drawn
    seed's bridge clusters; the training seeds' variance is in its width."""
    return hierarchical_difference(
        [scores_of(r, setting, a, metric) for r in records], [scores_of(r, setting, b, metric) for r in records],
        clusters_per_seed=[[_cluster_label(q) for q in r["questions"]] for r in records], seed=seed)


def pairs_of(arms: Sequence[str], constant: bool = False) -> list[tuple[str, str]]:
    """Every pair of arms, then every arm against the base (and the best constant)."""
    return (list(itertools.combinations(arms, 2)) + [(arm, BASE) for arm in arms]
            + ([(arm, CONSTANT) for arm in arms] if constant else []))


def _pair(records: Sequence[JsonRecord], setting: str, a: str, b: str, metric: str = "f1") -> JsonObject:
    return {"a": a, "b": b, **paired(records, setting, a, b, metric=metric).as_dict(),
            "between_seeds": between_seeds(records, setting, a, b, metric=metric).as_dict()}


def signal_curves(records: Sequence[JsonRecord], setting: str, arm: str, key: str) -> list[float]:
    """Per training step, ``key`` averaged over the seeds that logged it (NaN where none did)."""
    runs = [r["runs"][setting][arm]["steps"] for r in records]
    length = max((len(steps) for steps in runs), default=0)
    curve = []
    for n in range(length):
        values = [steps[n][key] for steps in runs if n < len(steps) and _finite(steps[n].get(key))]
        curve.append(_mean(values) if values else math.nan)
    return curve


def finished_arms(plan: JsonRecord, records: Sequence[JsonRecord]) -> dict[str, list[str]]:
    """Per setting, the arms every seed finished (a study stopped part way reports
    those); settings no arm finished in every seed are left out."""
    finished = {}
    for setting in plan["settings"]:
        arms = [a for a in plan["arms"] if all(a in r.get("runs", {}).get(setting, {}) for r in records)]
        if arms:
            finished[setting] = arms
    return finished


def missing_runs(plan: JsonRecord, records: Sequence[JsonRecord]) -> list[str]:
    """``setting/arm (seeds ...)`` of every planned run some seed did not finish."""
    missing = []
    for setting in plan["settings"]:
        for arm in plan["arms"]:
            seeds = [str(r["seed"]) for r in records if arm not in r.get("runs", {}).get(setting, {})]
            seeds += [str(s) for s in plan["seeds"] if s not in {r["seed"] for r in records}]
            if seeds:
                missing.append(f"{setting}/{arm} (seed {', '.join(sorted(seeds, key=int))})")
    return missing


def summarize(plan: JsonRecord, records: Sequence[JsonRecord]) -> JsonObject:
    """Everything ``results.json`` holds beyond the raw per-question scores, over the
    arms every seed finished (:func:`finished_arms`)."""
    out: JsonObject = {"shared_questions": shared_questions(records),
                           "clustered": question_clusters(records) is not None,
                           "questions_per_seed": {str(r["seed"]): len(r["questions"]) for r in records},
                           "base": arm_summary(records, plan["settings"][0], BASE), "settings": {},
                           "missing_runs": missing_runs(plan, records)}
    constant = has_constant(records)
    if constant:
        out["constant"] = {**arm_summary(records, plan["settings"][0], CONSTANT),
                           "answers": {str(r["seed"]): r["constant"]["answers"] for r in records}}
    for setting, arms in finished_arms(plan, records).items():
        out["settings"][setting] = {
            "arms": {arm: arm_summary(records, setting, arm) for arm in arms},
            "paired": [_pair(records, setting, a, b) for a, b in pairs_of(arms, constant)],
            # F1 gives a verbose answer that holds the value partial credit: exact match apart
            "paired_em_vs_base": [_pair(records, setting, arm, b, metric="em")
                                  for arm in arms for b in ((BASE, CONSTANT) if constant else (BASE,))],
            "signals": {arm: {key: signal_curves(records, setting, arm, key) for key, _, _ in SIGNALS}
                        for arm in arms},
        }
        if has_recall(records, setting, arms):  # search recall: bridge and answer document found
            out["settings"][setting]["paired_recall"] = [_pair(records, setting, a, b, metric="recall")
                                                         for a, b in pairs_of(arms)]
        curves = {arm: long_curves(records, setting, arm) for arm in arms}
        if any(curves.values()):
            out["settings"][setting]["curves"] = {arm: c for arm, c in curves.items() if c}
        if "calibadv" in arms and "grpo" in arms:
            out["settings"][setting]["calibadv_signals"] = {
                key: signal_curves(records, setting, "calibadv", key) for key in CALIBADV_SIGNALS}
    return out


# --------------------------------------------------------------------------- report


def write_study(plan: JsonRecord, records: Sequence[JsonRecord], out: pathlib.Path, *, command: str,
                wall_s: float, arm_labels: Mapping[str, str], machine: str = "",
                parts: Sequence[JsonRecord] = ()) -> pathlib.Path:
    """Write results.json, plots/ and report.md under ``out``; returns report.md's path.
    ``parts``: for a report over the seeds of several studies run apart (``calibrl study
    --merge``), each one's command, seeds, wall time and machine; ``command``, ``wall_s`` and
    ``machine`` then summarise them."""
    summary = summarize(plan, records)
    labels = {BASE: "base search agent (untrained)", CONSTANT: "best constant answer per aspect (no search)",
              **arm_labels}
    results = {"command": command, "wall_s": wall_s, "machine": machine, "plan": dict(plan), "summary": summary,
               "seeds": [_seed_json(r) for r in records], **({"parts": [dict(p) for p in parts]} if parts else {})}
    (out / "results.json").write_text(json.dumps(_json_safe(results), indent=1), encoding="utf-8")
    plots = write_plots(plan, summary, labels, out / "plots")
    lines = [f"# calibrl study: the search agent's arms over seeds {', '.join(map(str, plan['seeds']))}", "",
             provenance_line(results), "",
             *timing_lines(records), *settings_lines(plan, summary), "",
             "## What the data shows", "", *(f"- {line}" for line in verdict(plan, summary, labels)), ""]
    if summary["missing_runs"]:
        lines += ["**Stopped part way**: the tables cover the runs every seed finished; not run: "
                  + "; ".join(summary["missing_runs"]) + ".", ""]
    for setting in summary["settings"]:
        lines += [f"## Held-out answer F1, {setting} setting", "", arm_table(plan, summary, setting, labels), "",
                  f"Paired bootstrap over questions ({setting}): difference of held-out answer F1, a - b", "",
                  paired_table(summary, setting, labels), ""]
        if summary["settings"][setting].get("paired_em_vs_base"):
            lines += [f"Exact-match gain over the base ({setting}), paired the same way:", "",
                      paired_table(summary, setting, labels, key="paired_em_vs_base"), ""]
        if summary["settings"][setting].get("paired_recall"):
            lines += [f"Search recall ({setting}; per question, the share of its bridge and answer documents some "
                      "search returned), paired the same way:", "",
                      paired_table(summary, setting, labels, key="paired_recall"), ""]
        if summary["settings"][setting].get("curves"):
            lines += [f"Held-out figures along the {setting} run (means over seeds), and last - best checkpoint "
                      "(95% CI over seeds, then questions):", "", curve_table(summary, setting, labels), ""]
        categories = category_table(summary, setting, labels)
        if categories:
            lines += [f"Where the trajectories fail ({setting}; error analysis of every held-out question):", "",
                      categories, ""]
    lines += ["## Collapse signals per step", "",
              f"Training rollouts, mean over seeds: first step -> mean of the last {LAST_STEPS} steps.", "",
              collapse_table(plan, summary, labels), ""]
    lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def commands_text(results: JsonRecord, hide_out: bool = False) -> str:
    """The command that made a study's records, or, for a report over several studies run
    apart (``calibrl study --merge``), each one's with the seeds it gave. ``hide_out`` writes
    ``--out <dir>`` for the folder: where a study ran is no part of its result."""
    def shown(command: str) -> str:
        return "`" + (re.sub(r"--out \S+", "--out <dir>", command) if hide_out else command) + "`"

    parts = results.get("parts")
    if not parts:
        return shown(results["command"])
    return "; ".join(f"{shown(part['command'])} for seeds {', '.join(map(str, part['seeds']))}" for part in parts)


def provenance_line(results: JsonRecord, hide_out: bool = False) -> str:
    """The report's line on how its records were made: command(s), wall time(s), machine(s)
    (``hide_out`` as in :func:`commands_text`)."""
    parts = results.get("parts")
    if not parts:
        machine = results.get("machine", "")
        return (f"Command: {commands_text(results, hide_out)}; wall time {results['wall_s']:.0f} s"
                + (f"; {machine}." if machine else "."))
    described = [f"{commands_text({'command': part['command']}, hide_out)} "
                 f"for seeds {', '.join(map(str, part['seeds']))} "
                 f"(wall time {part['wall_s']:.0f} s" + (f"; {part['machine']}" if part.get("machine") else "") + ")"
                 for part in parts]
    return f"Records from {len(parts)} studies of the same plan, run apart: " + "; ".join(described) + "."


def timing_lines(records: Sequence[JsonRecord]) -> list[str]:
    """Where each seed's time went (seconds)."""
    parts = []
    for record in records:
        timings = record.get("timings", {})
        runs = [run for runs in record.get("runs", {}).values() for run in runs.values()]
        train = [run["wall_s"] for run in runs if not run.get("from_long")]  # a normal run read off the long one
        evaluation = _mean([run.get("eval_s", math.nan) for run in runs])
        derived = sum(1 for run in runs if run.get("from_long"))
        parts.append(f"seed {record['seed']}: domain + index {_num(timings.get('domain_and_index_s', math.nan))}, "
                     f"base agent {_num(timings.get('base_agent_s', math.nan))}, {len(train)} runs trained in "
                     f"{_num(_mean(train))} each on average"
                     + (f" ({derived} normal runs read off the long runs)" if derived else "")
                     + f", held-out evaluation {_num(evaluation)} each")
    return ["Seconds per seed: " + "; ".join(parts) + ".", ""] if parts else []


def settings_lines(plan: JsonRecord, summary: JsonRecord) -> list[str]:
    questions = ", ".join(f"seed {s}: {n}" for s, n in summary["questions_per_seed"].items())
    if len(summary["questions_per_seed"]) == 1:
        unit = "one seed: its questions resampled"
    elif summary["shared_questions"]:
        unit = "questions shared by every seed; each question's F1 averaged over seeds, then questions resampled"
    else:
        unit = (
            "each seed has its own questions (its own domain); units are (seed, question) pairs, resampled within "
            "their seed")
    return [
        f"Mode {plan['mode']}; per arm and seed: {plan['search_steps']} steps x {plan['questions_per_step']} "
        f"questions x G={plan['group_size']}, up to {plan['max_turns']} turns, {plan['search_top_k']} documents per "
        f"search, KL beta {plan['kl_beta']:g}, from the demo's base agent ({plan['warm_agent_steps']} warm-start "
        f"steps). Learning rate: normal {plan['lr']:g}, stress {plan['stress_lr']:g} (the same for every arm). "
        f"Step-rewarded arms: reward = F1 x format + {plan['w_steps']:g} x mean step reward (0.7 retrieval + "
        "0.3 search-step rubric).",
        f"Held-out questions (never trained on), greedy decoding: {questions}. Intervals: 95% bootstrap "
        f"percentile, 10,000 resamples, seeded; {unit}"
        f"{'; the phrasings of a question resampled together' if summary.get('clustered') else ''}.",
    ]


def _pct(value: float) -> str:
    return "-" if not _finite(value) else f"{round(100 * value, 1) + 0.0:.1f}"  # + 0.0: never "-0.0"


def _points(value: float) -> str:
    return f"{round(100 * value, 2) + 0.0:+.2f}"  # two decimals: a bound near 0 shows its side


def _ci(interval: Mapping[str, float]) -> str:
    return f"{_pct(interval['estimate'])} [{_pct(interval['low'])}, {_pct(interval['high'])}]"


def _ci_points(interval: Mapping[str, float]) -> str:
    return f"{_points(interval['estimate'])} [{_points(interval['low'])}, {_points(interval['high'])}]"


def arm_table(plan: JsonRecord, summary: JsonRecord, setting: str, labels: Mapping[str, str]) -> str:
    seeds = [str(s) for s in plan["seeds"] if str(s) in summary["questions_per_seed"]]  # seeds with records
    header = ["policy", "answer F1 % [95% CI]", *(f"seed {s}" for s in seeds), "EM %", "well-formed %", "searches",
              "read-out %"]
    rows = []
    arms = [(BASE, summary["base"]), *([(CONSTANT, summary["constant"])] if "constant" in summary else []),
            *summary["settings"][setting]["arms"].items()]
    for name, arm in arms:
        searches = arm.get("searches")
        rows.append([labels[name], _ci(arm["f1"]), *(_pct(arm["per_seed_f1"][s]) for s in seeds), _pct(arm["em"]),
                     _pct(arm.get("well_formed", math.nan)), "-" if searches is None else f"{searches:.2f}",
                     _pct(_nan_if_none(arm.get("readout_rate")))])
    return _markdown(header, rows)


def curve_table(summary: JsonRecord, setting: str, labels: Mapping[str, str]) -> str:
    rows, drops = [], []
    for arm, curve in summary["settings"][setting]["curves"].items():
        for n, step in enumerate(curve["steps"]):
            rows.append([labels[arm], str(step), _pct(curve["recall"][n]), _pct(curve["bridge_found"][n]),
                         _pct(curve["f1"][n]), _pct(curve["well_formed"][n])])
        for metric in ("recall", "well_formed"):
            d = curve[f"last_minus_best_{metric}"]
            drops.append([labels[arm], metric, str(d["best_step"]), _ci_points(d), "yes" if d["high"] < 0 else "no"])
    return (_markdown(["arm", "step", "search recall %", "bridge found %", "answer F1 %", "well-formed %"], rows)
            + "\n\n" + _markdown(["arm", "metric", "best step", "last - best, points [95% CI]", "degraded"], drops))


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else float(value)


def category_table(summary: JsonRecord, setting: str, labels: Mapping[str, str]) -> str:
    """Where the final policies' trajectories fail (shares of every seed's questions); "" without categories."""
    arms = [(BASE, summary["base"]), *summary["settings"][setting]["arms"].items()]
    names = sorted({c for _, arm in arms for c in arm.get("categories", {})})
    if not names:
        return ""
    rows = [[labels[name], *(_pct(arm["categories"].get(c, 0.0)) for c in names)] for name, arm in arms]
    return _markdown(["policy", *(f"{c} %" for c in names)], rows)


def paired_table(summary: JsonRecord, setting: str, labels: Mapping[str, str], key: str = "paired") -> str:
    rows = [[labels[p["a"]], labels[p["b"]], _ci_points(p), "yes" if p["low"] > 0 or p["high"] < 0 else "no",
             _ci_points(p["between_seeds"]) if "between_seeds" in p else "-"]
            for p in summary["settings"][setting][key]]
    return _markdown(["a", "b", "a - b, points [95% CI over questions]", "interval excludes 0",
                      "[95% CI over seeds, then questions]"], rows)


def collapse_table(plan: JsonRecord, summary: JsonRecord, labels: Mapping[str, str]) -> str:
    header = ["setting", "arm", *(SIGNAL_COLUMNS[key] for key, _, _ in SIGNALS)]
    rows = []
    for setting in summary["settings"]:
        for arm, signals in summary["settings"][setting]["signals"].items():
            cells = []
            for key, _, _ in SIGNALS:
                curve = signals[key]
                cells.append(f"{_num(curve[0] if curve else math.nan)} -> {_num(_tail_mean(curve))}")
            rows.append([setting, labels[arm], *cells])
    return _markdown(header, rows)


def verdict(plan: JsonRecord, summary: JsonRecord, labels: Mapping[str, str]) -> list[str]:
    """Plain sentences computed from the numbers."""
    lines = []
    if not summary["settings"]:
        return ["No arm finished in every seed: nothing to compare yet."]
    first = next(iter(summary["settings"]))
    normal = summary["settings"][first]
    by_pair = {(p["a"], p["b"]): p for p in normal["paired"]}
    by_recall = {(p["a"], p["b"]): p for p in normal.get("paired_recall", [])}
    for calibadv in ("calibadv", "calibadv_silver"):  # H1 (search recall) and H2 (answer F1), experiments/LOG.md D11
        if ("grpo", calibadv) in by_recall:
            lines.append(_compare(by_recall[("grpo", calibadv)], labels, f"{first} setting", reverse=True,
                                  unit="points of search recall"))
        if ("grpo", calibadv) in by_pair:
            lines.append(_compare(by_pair[("grpo", calibadv)], labels, f"{first} setting", reverse=True))
    if ("grpo", "calibadv") in by_pair:
        if not by_pair[("grpo", "calibadv")]["high"] < 0:  # CalibAdv did not beat GRPO: show what it changed
            lines.append(calibadv_line(normal, labels))
    best = max(normal["arms"], key=lambda a: normal["arms"][a]["f1"]["estimate"])
    lines.append(_compare(by_pair[(best, BASE)], labels, f"{first} setting, best arm vs the untrained base"))
    if (best, CONSTANT) in by_pair:
        lines.append(_compare(by_pair[(best, CONSTANT)], labels,
                              f"{first} setting, best arm vs answering each aspect's most frequent training answer"))
    for plain, stepped in (("grpo", "grpo_steps"), ("calibadv", "calibadv_steps")):
        if (plain, stepped) in by_pair:
            lines.append(_compare(by_pair[(plain, stepped)], labels, f"{first} setting", reverse=True))
    if "stress" in summary["settings"]:
        lines.append(stress_line(summary, labels))
    lines += long_lines(summary, labels)
    return lines


def _degraded(curve: JsonRecord) -> list[str]:
    """The held-out metrics whose last checkpoint is below the run's best by an interval
    excluding zero (the H3 rule, experiments/LOG.md D11)."""
    return [metric for metric in ("recall", "well_formed") if curve[f"last_minus_best_{metric}"]["high"] < 0]


def long_lines(summary: JsonRecord, labels: Mapping[str, str]) -> list[str]:
    """The long setting: each arm's last-minus-best checkpoint drops, and H3 (GRPO degrades
    in search recall or well-formed rate while CalibAdv does not), per CalibAdv arm that ran."""
    curves = summary["settings"].get("long", {}).get("curves", {})
    if not curves:
        return []
    names = {"recall": "search recall", "well_formed": "well-formed rate"}
    lines = []
    for arm, curve in curves.items():
        drops = ", ".join(f"{names[m]} {_ci_points(curve[f'last_minus_best_{m}'])}" for m in names)
        degraded = _degraded(curve)
        lines.append(f"{labels[arm]} (long setting), last minus best held-out checkpoint, points [95% CI over seeds, "
                     f"then questions]: {drops}; "
                     + (f"degraded in {' and '.join(names[m] for m in degraded)}." if degraded
                        else "no drop the intervals show."))
    if "grpo" in curves:
        for calibadv in ("calibadv", "calibadv_silver"):
            if calibadv not in curves:
                continue
            grpo_down, calibadv_down = _degraded(curves["grpo"]), _degraded(curves[calibadv])
            held = bool(grpo_down) and not calibadv_down
            why = ("GRPO degraded and it did not" if held else "GRPO did not degrade" if not grpo_down
                   else "it degraded too")
            lines.append(f"H3 for {labels[calibadv]}: {'supported' if held else 'not supported'} ({why}).")
    return lines


def _compare(pair: JsonRecord, labels: Mapping[str, str], where: str, reverse: bool = False,
             unit: str = "points of answer F1") -> str:
    """One sentence on a paired difference (``reverse``: state it as b - a)."""
    a, b = (pair["b"], pair["a"]) if reverse else (pair["a"], pair["b"])
    sign = -1.0 if reverse else 1.0
    estimate, low, high = (sign * pair[k] for k in ("estimate", "low", "high"))
    low, high = min(low, high), max(low, high)
    span = f"{_points(estimate)} {unit} [95% CI {_points(low)}, {_points(high)}]"
    seeds = pair.get("between_seeds")
    if seeds and (low > 0 or high < 0):  # a difference over questions: does it hold with the seeds' variance?
        s_low, s_high = sorted(sign * seeds[k] for k in ("low", "high"))
        if s_low <= 0 <= s_high:
            return (f"{labels[a]} vs {labels[b]} ({where}): {span} over questions, but "
                    f"[{_points(s_low)}, {_points(s_high)}] over seeds, then questions: with the training seeds' "
                    "variance the interval includes 0, so the study cannot tell them apart.")
    if low > 0:
        return f"{labels[a]} beats {labels[b]} ({where}): {span}."
    if high < 0:
        return f"{labels[a]} does worse than {labels[b]} ({where}): {span}."
    return (f"{labels[a]} vs {labels[b]} ({where}): {span}; the interval includes 0, so the study cannot tell them "
            "apart.")


def calibadv_line(setting: JsonRecord, labels: Mapping[str, str]) -> str:
    """What CalibAdv changed over GRPO's advantages during training (means over steps and seeds)."""
    curves = setting["calibadv_signals"]

    def mean(key: str) -> float:
        return _mean_finite(curves.get(key, []))

    softened = mean("calibadv/frac_tokens_softened")
    zeroed = mean("calibadv/frac_groups_answer_zeroed")
    no_signal = mean("frac_reward_zero_std")
    line = (f"What CalibAdv changed: during {labels['calibadv']} training {_pct(softened)}% of the trained "
            f"tokens had their negative advantage softened by a step score, the rebalance zeroed the answer "
            f"advantages of {_pct(zeroed)}% of the groups that had a learning signal, and {_pct(no_signal)}% of "
            "the groups had all-equal rewards (no signal for either estimator)")
    steps = mean("calibadv/frac_neg_search_steps_softened")
    if math.isfinite(steps):
        line += (f"; of the search steps of failed trajectories (which GRPO penalises in full) it softened "
                 f"{_pct(steps)}%, {_pct(mean('calibadv/frac_neg_search_steps_found_gold'))}% of them had retrieved a "
                 f"gold document ({_pct(mean('calibadv/frac_softened_found_gold'))}% of the softened ones), and the "
                 f"mean advantage moved by {_num(mean('calibadv/adv_change_search'))} on search tokens and "
                 f"{_num(mean('calibadv/adv_change_answer'))} on answer tokens")
    return line + "; everywhere else CalibAdv's advantages are GRPO's."


def stress_line(summary: JsonRecord, labels: Mapping[str, str]) -> str:
    """The stress setting per arm: held-out F1 against the base, and the signs of collapse
    (each named with the rule that flags it)."""
    stress, base = summary["settings"]["stress"], summary["base"]
    by_pair = {(p["a"], p["b"]): p for p in stress["paired"]}
    parts, collapsed = [], []
    for arm, data in stress["arms"].items():
        vs_base = by_pair[(arm, BASE)]
        ppl = stress["signals"][arm]["policy/ref_ppl"]
        signs = []
        if vs_base["high"] < 0:
            signs.append("held-out F1 below the base's (paired interval below 0)")
        if data["well_formed"] < COLLAPSED_WELL_FORMED * base["well_formed"]:
            signs.append(f"held-out well-formed rate under {COLLAPSED_WELL_FORMED:.0%} of the base's")
        if ppl and _finite(ppl[0]) and _tail_mean(ppl) > PPL_GROWTH * ppl[0]:
            signs.append(f"reference PPL over {PPL_GROWTH:g}x its first step's")
        if signs:
            collapsed.append(f"{labels[arm]} ({'; '.join(signs)})")
        parts.append(f"{labels[arm]} F1 {_pct(data['f1']['estimate'])}% ({_points(vs_base['estimate'])} points vs the "
                     f"base [{_points(vs_base['low'])}, {_points(vs_base['high'])}]), held-out well-formed "
                     f"{_pct(data['well_formed'])}% (base {_pct(base['well_formed'])}%), training well-formed "
                     f"{_pct(_tail_mean(stress['signals'][arm]['search/well_formed']))}% and reference PPL "
                     f"{_num(ppl[0] if ppl else math.nan)} -> {_num(_tail_mean(ppl))} (first step -> last "
                     f"{LAST_STEPS})")
    verdict_text = ("Signs of collapse: " + "; ".join(collapsed)) if collapsed else (
        "No arm shows a sign of collapse (F1 below the base, well-formed rate under "
        f"{COLLAPSED_WELL_FORMED:.0%} of the base's, reference PPL over {PPL_GROWTH:g}x its first step's)")
    return "Stress setting: " + "; ".join(parts) + f". {verdict_text}."


# --------------------------------------------------------------------------- plots


def write_plots(plan: JsonRecord, summary: JsonRecord, labels: Mapping[str, str],
                folder: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per collapse signal: a panel per setting, a line per arm (mean over seeds)."""
    from calibrl.demo.report import _pyplot

    folder.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    paths = []
    settings = list(summary["settings"])
    if not settings:
        return []
    for key, title, stem in SIGNALS:
        figure, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.4), dpi=100, squeeze=False,
                                    sharey=True)
        for axis, setting in zip(axes[0], settings):
            for arm, signals in summary["settings"][setting]["signals"].items():
                curve = signals[key]
                axis.plot(range(1, len(curve) + 1), curve, label=labels[arm], linewidth=1.4)
            axis.set_title(f"{setting}", fontsize=9)
            axis.set_xlabel("training step")
            axis.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        figure.suptitle(f"{title} (mean over seeds)", fontsize=10)
        figure.tight_layout()
        path = folder / f"{stem}.png"
        figure.savefig(path)
        plt.close(figure)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- helpers


def _seed_json(record: JsonRecord) -> JsonObject:
    return {key: record[key] for key in ("seed", "questions", "base", "constant", "runs", "timings") if key in record}


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _mean_finite(curve: Sequence[float]) -> float:
    return _mean([v for v in curve if _finite(v)])


def _tail_mean(curve: Sequence[float]) -> float:
    tail = [v for v in curve[-LAST_STEPS:] if _finite(v)]
    return _mean(tail)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(value: float) -> str:
    return "-" if not _finite(value) else f"{value:.3g}"


def _json_safe(value: object) -> JsonValue:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


__all__ = ["arm_summary", "paired", "question_clusters", "shared_questions", "signal_curves", "summarize", "units",
           "write_study"]
