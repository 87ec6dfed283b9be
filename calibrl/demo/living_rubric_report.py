"""The living-rubric demo's figures and report (:mod:`calibrl.demo.living_rubric`), drawn from its
records only: ``results.json`` and each run's ``metrics.jsonl``, ``review/drift.jsonl`` and
``rubric_versions.jsonl`` under ``runs/<name>/``. Nothing here runs or scores anything, so a kept
record (``results/living-rubric``) regenerates its report word for word."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Sequence


def _records(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_records(out: pathlib.Path, name: str) -> dict[str, list[dict[str, Any]]]:
    run_dir = out / "runs" / name
    return {"metrics": _records(run_dir / "metrics.jsonl"), "drift": _records(run_dir / "review" / "drift.jsonl"),
            "events": _records(run_dir / "rubric_versions.jsonl")}


def write_figures(out: pathlib.Path) -> list[str]:
    """Two PNGs drawn from the records: the runs' mean rollout length with the onset rule, their
    reward components and drift kappa by step, and the held-out hit@1 of each policy. Returns their
    file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    fig, (lengths, top, bottom) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for name, colour in (("uncorrected", "tab:red"), ("corrected", "tab:blue")):
        records = run_records(out, name)
        steps = [m["step"] for m in records["metrics"]]
        onset = results["runs"][name]["onset"]
        lengths.plot(steps, [m["completions/mean_length"] for m in records["metrics"]], color=colour, label=name)
        lengths.axhline(onset["threshold"], color=colour, linestyle="--", alpha=0.5)
        if onset["step"] is not None:
            lengths.axvline(onset["step"], color=colour, linestyle="--", alpha=0.5)
        top.plot(steps, [m["rewards/rubric/mean"] for m in records["metrics"]], color=colour, label=f"{name}: rubric total")
        top.plot(steps, [m["rewards/retrieval/mean"] for m in records["metrics"]], color=colour, linestyle="--",
                 label=f"{name}: retrieval MRR@10")
        kappa = [(d["step"], d["kappa"]) for d in records["drift"] if d.get("kappa") is not None]
        if kappa:
            bottom.plot(*zip(*kappa), marker="o", color=colour, label=f"{name}: drift kappa")
        for event in records["events"]:
            if event["event"] in ("rubric_changed", "rubric_downweighted"):
                for axis in (top, bottom):
                    axis.axvline(event["step"], color=colour, alpha=0.4,
                                 linestyle=":" if event["event"] == "rubric_downweighted" else "-")
    bottom.axhline(results["settings"]["min_kappa"], color="grey", linestyle="--", label="drift gate")
    lengths.set_ylabel("mean length (tokens)")
    lengths.set_title("dashed: onset threshold and onset step", fontsize=8)
    lengths.legend(fontsize=7)
    top.set_ylabel("mean over the step")
    bottom.set_ylabel("Cohen's kappa")
    bottom.set_xlabel("step (dotted: alarm, solid: new rubric version)")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=110)
    plt.close(fig)

    splits = [(label, results[key]) for key, label in (("validation", "validation"), ("heldout", "held-out"))
              if results.get(key)]
    fig, axes = plt.subplots(1, len(splits), figsize=(4 * len(splits) + 1, 3), sharey=True, squeeze=False)
    for axis, (label, evaluation) in zip(axes[0], splits):
        names = list(evaluation["hits"])
        axis.bar(names, [sum(h) / len(h) for h in evaluation["hits"].values()],
                 color=["grey", "tab:red", "tab:blue"][:len(names)])
        axis.set_title(f"{label} ({len(evaluation['tasks'])} tasks)", fontsize=9)
        axis.set_ylabel(f"hit@{evaluation['top_k']}")
    fig.tight_layout()
    fig.savefig(out / "heldout.png", dpi=110)
    plt.close(fig)
    return ["training.png", "heldout.png"]


_GATE_WORDS = {"upper_bound": " (an alarm when the kappa's whole 95% interval is below it)",
               "lower_bound": " (an alarm unless the kappa's whole 95% interval is at or above it)"}


def report_markdown(out: pathlib.Path, figures: Sequence[str]) -> str:
    """The report, every number read from ``results.json`` and the run records."""
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    settings = results["settings"]
    lines = ["# The living rubric", "",
             f"Seed {results['seed']}; {settings['steps']} steps per run, review every {settings['review_every']} "
             f"steps ({settings['review_n']} rollouts), drift gate kappa >= {settings['min_kappa']}"
             f"{_GATE_WORDS.get(settings.get('drift_gate', 'estimate'), '')}, rubric weight "
             f"{settings['w_rubric']} (x {settings['downweight_factor']} after an alarm). A step's drift kappa is the "
             "trainer's check over every grade so far, scored by the version serving then.", ""]
    agreement = results.get("base_agreement")
    if agreement:
        lines += [f"Version 1 before use: the experts graded the base policy's greedy rewrites of the "
                  f"{agreement['items']} training tasks ({agreement['expert_pass']} passed); version 1's kappa on "
                  f"those grades is {_num(agreement['kappa'])} (gate {settings['min_kappa']}).", ""]
    lines += ["## The runs", ""]
    for name, run in results["runs"].items():
        lines += _run_lines(out, name, run, results)
    lines += _check_lines(results["check"])
    lines += _evaluation_lines(results)
    lines += [f"![{name}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def _run_lines(out: pathlib.Path, name: str, run: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """One run's drift verdicts, exploit onset, alarms and the versions published after them."""
    settings = results["settings"]
    records = run_records(out, name)
    alarms = [d["step"] for d in records["drift"] if d.get("alarm")]
    kappas = ", ".join(f"step {d['step']}: {d['kappa']:.2f}" for d in records["drift"] if d.get("kappa") is not None)
    lines = [f"- **{name}** (`{run['rubric_id']}`): drift kappa {kappas or 'no verdict (too few grades)'}; "
             f"alarm at step(s) {', '.join(map(str, alarms)) or 'none'}."]
    onset = run["onset"]
    if onset["step"] is None:
        lines.append(f"  No exploit onset: the rollouts' mean length never stayed above {onset['threshold']:.1f} "
                     f"tokens ({onset['rise']} x the first review window's {onset['baseline_length']:.1f}) for "
                     f"{onset['sustain']} steps.")
    else:
        lead = f"the first alarm came {alarms[0] - onset['step']:+d} steps after it" if alarms else "no alarm followed"
        lines.append(f"  Exploit onset (the rollouts' mean length above {onset['threshold']:.1f} tokens, "
                     f"{onset['rise']} x the first review window's {onset['baseline_length']:.1f}, for "
                     f"{onset['sustain']} steps from then): step {onset['step']}; {lead} (review every "
                     f"{settings['review_every']} steps; a review's grades are checked on the next review step).")
    refused = [f for f in run["published"] if not f["published"]]
    if refused:
        tries = "; ".join(f"step {f['step']}: {' + '.join(f.get('best_criteria', [])) or 'none'} "
                          f"{_num(f.get('best_kappa'))} (version 1 {_num(f['kappa_before'])})" for f in refused)
        lines.append(f"  No version was published after the alarm(s) of step(s) "
                     f"{', '.join(str(f['step']) for f in refused)}: no candidate built from the judge's "
                     f"programmatic scorers ({len(refused[0]['candidates'])} of them) reached the gate "
                     f"{settings['min_kappa']} on the fresh grades of the last {results['selection_reviews']} "
                     f"reviews. Best candidate, its kappa there: {tries}.")
    for fix in (f for f in run["published"] if f["published"]):
        named = ", ".join(fix["disagreeing"]) or "no criterion"
        lines.append(f"  The alarm of step {fix['step']} named {named}. Of {len(fix['candidates'])} candidate "
                     f"versions built from the judge's programmatic scorers, {' + '.join(fix['criteria'])} "
                     f"agrees best with the {fix['chosen_on']['items']} fresh grades of the last "
                     f"{results['selection_reviews']} reviews (rollouts of steps "
                     f"{fix['chosen_on']['first_rollout_step']}-{fix['chosen_on']['last_rollout_step']}): kappa "
                     f"{_num(fix['kappa_before'])} (version 1) -> {_num(fix['kappa_after'])}, chosen on those "
                     f"grades. Version {fix['version']} ({fix['hash'][:12]}) was published and loaded without a "
                     "restart.")
    changes = [e["step"] for e in records["events"] if e["event"] == "rubric_changed"]
    if changes:
        scales = {m["step"]: m.get("rubric/weight_scale") for m in records["metrics"]}
        lines.append(f"  First step scored by a new version: {', '.join(map(str, changes))} (rubric weight "
                     f"scale there: {', '.join(str(scales.get(s)) for s in changes)}); "
                     f"{settings['steps'] - changes[0] + 1} of {settings['steps']} steps trained on versions "
                     "after the first.")
    return lines


def _check_lines(checks: Sequence[dict[str, Any]]) -> list[str]:
    """Each next version (or best refused candidate) on later grades that chose nothing."""
    if not checks:
        return []
    lines = ["", "## The next version on grades that chose nothing", "",
             "Grades of the rollouts after the last one a version's choice read, scored by version 1 and by "
             "that version with the same drift check:", ""]
    for check in checks:
        what = (f"version {check['version']} ({' + '.join(check['criteria'])}, published at step "
                f"{check['alarm_step']})" if check["published"] else
                f"the best candidate of the alarm of step {check['alarm_step']} ({' + '.join(check['criteria'])}; "
                "not published)")
        lines.append(f"- {what}, {check['run']} run, rollouts after step {check['after_step']}: {check['items']} "
                     f"grades ({check['expert_pass']} passed by the experts): kappa version 1 "
                     f"{_num(check['kappa_v1'])}, {'version ' + check['version'] if check['published'] else 'the candidate'} "
                     f"{_num(check['kappa_candidate'])}.")
    return lines


def _evaluation_lines(results: dict[str, Any]) -> list[str]:
    """Validation and held-out hit@k of every policy, with the paired, clustered difference."""
    from calibrl.stats import describe_difference

    sizes = results.get("split_sizes", {})
    lines: list[str] = []
    for key, title in (("validation", "Validation retrieval"), ("heldout", "Held-out retrieval")):
        if key not in results:  # a record made before validation tasks were set aside
            continue
        evaluation = results[key]
        lines += ["", f"## {title}", ""]
        if not evaluation:
            lines += ["Not read in this run (`--validation-only`): the held-out tasks are the test split.", ""]
            continue
        what = ("validation tasks (training (product, topic) pairs set aside, never trained on; "
                f"the runs trained on the other {sizes['train']})" if key == "validation" and "train" in sizes
                else f"{title.split()[0].lower()} tasks")
        lines += [f"{len(evaluation['tasks'])} {what}, greedy rewrites searched with BM25, hit@{evaluation['top_k']}:",
                  ""]
        for name, hits in evaluation["hits"].items():
            lines.append(f"- {name}: {sum(hits) / len(hits):.3f}")
        diff = evaluation["difference"]
        unit = f"points of hit@{evaluation['top_k']}"
        clusters = [tuple(c) for c in evaluation["clusters"]]
        lines += ["", describe_difference(diff["a"], diff["b"], diff, unit) +
                  f" (paired bootstrap over {len(set(clusters))} (product, topic) clusters).", ""]
        lines += _against_base_lines(evaluation, clusters, unit, results.get("settings", {}).get("resamples"))
    return lines


def _against_base_lines(evaluation: dict[str, Any], clusters: list[tuple], unit: str,
                        resamples: int | None) -> list[str]:
    """Each run against the base policy on the same tasks (the exploit's and the fix's
    own effects), with the same paired, clustered bootstrap as the runs' difference."""
    from calibrl.stats import DEFAULT_RESAMPLES, describe_difference, paired_difference

    hits = evaluation["hits"]
    if "base" not in hits:
        return []
    lines = ["Each run against the base policy on the same tasks (same bootstrap):", ""]
    for name in (n for n in hits if n != "base"):
        interval = paired_difference(hits[name], hits["base"], clusters=clusters,
                                     resamples=resamples or DEFAULT_RESAMPLES, seed=0)
        lines.append(f"- {describe_difference(name, 'base', interval, unit)}")
    return lines + [""]


def _num(value: Any) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


__all__ = ["report_markdown", "run_records", "write_figures"]
