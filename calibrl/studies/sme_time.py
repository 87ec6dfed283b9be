"""Does representative sampling save expert time? The judge's validation kappa against the
number of reviewed items, representative sampling vs random sampling, one golden set.

The experiment (run by ``calibrl demo``, and by ``benchmarks/bench_sme_sampling.py``):

1. a **pool** of items an expert could review, each with its simulated expert answer
   (in the demo: the SME feedback outside the golden set; the simulated SMEs answer
   whatever they are shown, so an answer is known for every item);
2. for each **budget** n: choose n items by :func:`calibrl.sme.sample.choose_sample`
   (representative, seed ``seed``) or uniformly at random (``random_repeats`` draws,
   seeds ``seed``, ``seed + 1``, ...); take their answers as the reviewed feedback;
3. distil a rubric from those n reviews alone (``golden_fraction=0``), pick the judge's pass
   threshold on the same n reviews (``pass_threshold=None``: the best-kappa threshold, as
   ``calibrl rubric validate --pass-threshold auto --feedback <those reviews>`` picks it;
   the golden set never decides its own threshold), score the **same golden set** with the
   programmatic judge, and compute Cohen's kappa with its 95% bootstrap interval (golden
   items resampled in query clusters) and the gate exactly as ``calibrl rubric validate``
   does (``gate="lower_bound"``, the demo's: the whole interval must clear ``min_kappa``);
4. **reviews needed** = the smallest budget whose rubric passes the gate (for random
   sampling: at which at least half of the draws pass). A budget whose reviews distil into
   no rubric (too few tagged errors), or whose reviews are all one expert verdict (no
   threshold can be picked), counts as a failed gate, with the reason kept.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from calibrl.errors import CalibrlError
from calibrl.sme.items import SampleItem, write_items
from calibrl.sme.sample import Embed, SampleOptions, choose_sample, item_text
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.json_types import JsonObject

if TYPE_CHECKING:  # pragma: no cover
    import pathlib

    import numpy as np

    from calibrl.api.judge_config import JudgeConfig
    from calibrl.demo.domain import Domain

# outputs -> the doc ids each retrieves, best first (the demo's retrieval service, BM25 hit@1)
SearchFn = Callable[[list[str]], list[list[str]]]
ProgressFn = Callable[[str], None]  # one line of progress


@dataclass
class StudyOptions:
    """Budgets and settings of :func:`run_study`."""

    budgets: tuple[int, ...] = (10, 15, 20, 30, 45, 60, 90, 120, 160)  # reviews per point of the curve
    random_repeats: int = 5  # random draws per budget
    seed: int = 0  # representative sampling's seed; random draw r uses seed + r
    min_kappa: float = 0.6  # the validation gate
    # judge pass = total >= this; None: picked on each budget's own reviews (--pass-threshold auto)
    pass_threshold: float | None = None
    gate: str = "lower_bound"  # "lower_bound" (the demo's: the kappa's whole interval >= min_kappa) or "estimate"
    criteria_mode: str = "programmatic"  # distillation's criteria kinds
    glossary: tuple[str, ...] = ()  # domain terms for the entity criteria
    rubric_id: str = "sme-study"


@dataclass
class StudyPoint:
    method: str  # "representative" | "random"
    budget: int
    draw: int  # 0 for representative
    kappa: float | None
    passed: bool
    note: str = ""  # why no rubric or no threshold, when the gate could not be applied
    kappa_low: float | None = None  # the kappa's 95% bootstrap interval (golden items in query clusters)
    kappa_high: float | None = None
    pass_threshold: float | None = None  # the threshold the judge passed items at (picked or given)


@dataclass
class StudyResult:
    options: StudyOptions
    pool_size: int
    golden_size: int
    points: list[StudyPoint] = field(default_factory=list)

    def kappas(self, method: str, budget: int) -> list[float | None]:
        return [p.kappa for p in self.points if p.method == method and p.budget == budget]

    def budgets(self) -> list[int]:
        return sorted({p.budget for p in self.points})

    def summary_kappa(self, method: str, budget: int) -> float | None:
        """Representative: its kappa; random: the median over draws (a failed distillation counts as -1)."""
        values = [(-1.0 if k is None else k) for k in self.kappas(method, budget)]
        return statistics.median(values) if values else None

    def passing(self, method: str, budget: int) -> tuple[int, int]:
        """(draws that passed the gate, draws) at one budget."""
        points = [p for p in self.points if p.method == method and p.budget == budget]
        return sum(p.passed for p in points), len(points)

    def reviews_needed(self, method: str) -> int | None:
        """Smallest budget at which the rubric passes the gate (random: at least half the draws
        do); None when none does."""
        for budget in self.budgets():
            passed, draws = self.passing(method, budget)
            if draws and 2 * passed >= draws:
                return budget
        return None

    def table(self) -> str:
        """Markdown table: one row per budget."""
        lines = ["| reviews | representative kappa [95% CI] | threshold | random kappa, median (min-max) "
                 "| random draws passing |",
                 "| ---: | ---: | ---: | ---: | ---: |"]
        for budget in self.budgets():
            rep = [p for p in self.points if p.method == "representative" and p.budget == budget]
            rnd = [(-1.0 if k is None else k) for k in self.kappas("random", budget)]
            rep_text = (_with_interval(rep[0]) + (" (pass)" if rep[0].passed else "")) if rep else "-"
            threshold = f"{rep[0].pass_threshold:.3f}" if rep and rep[0].pass_threshold is not None else "-"
            rnd_text = (f"{_fmt(statistics.median(rnd))} ({_fmt(min(rnd))}-{_fmt(max(rnd))})" if rnd else "-")
            passed, draws = self.passing("random", budget)
            lines.append(f"| {budget} | {rep_text} | {threshold} | {rnd_text} | {passed}/{draws} |")
        return "\n".join(lines)

    def gate_text(self) -> str:
        if self.options.gate == "lower_bound":
            return f"the whole 95% interval of kappa >= {self.options.min_kappa}"
        return f"kappa >= {self.options.min_kappa}"

    def verdict(self) -> str:
        rep, rnd = self.reviews_needed("representative"), self.reviews_needed("random")

        def say(n: int | None) -> str:
            return f"{n} reviews" if n is not None else f"more than {self.budgets()[-1]} reviews (never passed)"

        threshold = ("the pass threshold picked on each budget's own reviews" if self.options.pass_threshold is None
                     else f"pass threshold {self.options.pass_threshold:g}")
        return (f"Reviews needed to pass the gate ({self.gate_text()}; {threshold}) on the same "
                f"{self.golden_size} golden items: representative sampling {say(rep)}, random sampling {say(rnd)} "
                f"(at least half of {self.options.random_repeats} draws passing), from a pool of {self.pool_size}.")

    def to_json(self) -> JsonObject:
        return {
            "pool_size": self.pool_size, "golden_size": self.golden_size, "min_kappa": self.options.min_kappa,
            "gate": self.options.gate, "pass_threshold": self.options.pass_threshold,
            "reviews_needed": {m: self.reviews_needed(m) for m in ("representative", "random")},
            "points": [vars(p) for p in self.points],
        }


def _fmt(value: float | None) -> str:
    return "no rubric" if value is None or value == -1.0 else f"{value:.3f}"


def _with_interval(point: StudyPoint) -> str:
    if point.kappa is None:
        return "no rubric" if "threshold" not in point.note else "no threshold"
    if point.kappa_low is None or point.kappa_high is None:
        return f"{point.kappa:.3f} [undefined]"
    return f"{point.kappa:.3f} [{point.kappa_low:.2f}, {point.kappa_high:.2f}]"


class _MemoEmbedder:
    """The judge's sentence embedder with every text's vector kept: each budget's judge scores
    the same golden items, so their vectors are computed once for the whole study."""

    def __init__(self, config: "JudgeConfig") -> None:
        from calibrl.embedding import load_embedder

        self.inner = load_embedder(config.embedder, config.embedder_device)
        self.vectors: dict[str, "np.ndarray"] = {}

    def encode(self, texts: list[str]) -> "np.ndarray":
        import numpy as np

        todo = list(dict.fromkeys(t for t in texts if t not in self.vectors))
        if todo:
            for text, vector in zip(todo, self.inner.encode(todo)):
                self.vectors[text] = vector
        return np.stack([self.vectors[t] for t in texts]) if texts else self.inner.encode([])


@dataclass(frozen=True)
class BudgetValidation:
    """The gate's outcome for one budget's reviews (:func:`validation_kappa`)."""

    kappa: float | None
    passed: bool
    note: str = ""  # why there is no kappa (no rubric distilled, no threshold could be picked)
    kappa_low: float | None = None
    kappa_high: float | None = None
    pass_threshold: float | None = None


def validation_kappa(reviews: Sequence[FeedbackRecord], golden: Sequence[FeedbackRecord], options: StudyOptions,
                     judge_config: "JudgeConfig | None" = None,
                     embedder: "_MemoEmbedder | None" = None) -> BudgetValidation:
    """The validation of a rubric distilled from ``reviews`` alone, on ``golden``, as
    ``calibrl rubric validate`` computes it (with ``--pass-threshold auto --feedback
    <reviews>`` when ``options.pass_threshold`` is None)."""
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.authoring.distill import DistillOptions, distill
    from calibrl.judge_server.judge import Judge
    from calibrl.judge_server.authoring.validation import ValidationOptions, agreement, pick_pass_threshold

    try:
        result = distill(list(reviews), DistillOptions(
            rubric_id=options.rubric_id, golden_fraction=0.0, criteria_mode=options.criteria_mode,  # type: ignore[arg-type]
            glossary=options.glossary))
        config = judge_config or JudgeConfig(allow_unvalidated=True, cache_size=0)
        judge = Judge([result.rubric], config)
        if embedder is not None:
            judge._embedder = embedder  # the study's shared memo (see _MemoEmbedder); same vectors, computed once
        choice = None
        if options.pass_threshold is None:
            choice = pick_pass_threshold(list(reviews), judge.compute(result.rubric, [r.to_item() for r in reviews]))
        scores = judge.compute(result.rubric, [r.to_item() for r in golden])
    except CalibrlError as exc:
        return BudgetValidation(None, False, str(exc))
    record = agreement(result.rubric, judge.model_id, golden, scores, ValidationOptions(
        min_kappa=options.min_kappa, pass_threshold=options.pass_threshold or 0.0, gate=options.gate),
        threshold_choice=choice)
    return BudgetValidation(record.kappa, record.passed, "" if record.kappa is not None else record.reason,
                            record.kappa_low, record.kappa_high, record.pass_threshold)


def run_study(pool: Sequence[SampleItem], answers: Mapping[str, FeedbackRecord], golden: Sequence[FeedbackRecord],
              options: StudyOptions | None = None, *, embed: Embed | None = None,
              vectors: "np.ndarray | None" = None, judge_config: "JudgeConfig | None" = None,
              progress: ProgressFn | None = None) -> StudyResult:
    """Run the experiment of the module doc. ``answers`` maps each pool item's id to its
    expert answer; ``vectors`` (one row per pool item) or ``embed`` place the items."""
    options = options or StudyOptions()
    missing = [item.id for item in pool if item.id not in answers]
    if missing:
        raise ValueError(f"{len(missing)} pool items have no answer, e.g. {missing[:3]}")
    if vectors is None:
        from calibrl.sme.sample import minilm_embed

        vectors = (embed or minilm_embed())([item_text(i) for i in pool])
    from calibrl.judge_server.config import JudgeConfig

    judge_config = judge_config or JudgeConfig(allow_unvalidated=True, cache_size=0)
    memo = _MemoEmbedder(judge_config)
    result = StudyResult(options, len(pool), len(golden))
    budgets = [b for b in options.budgets if b <= len(pool)] or [len(pool)]
    for budget in budgets:
        chosen = choose_sample(pool, SampleOptions(n=budget, seed=options.seed), vectors=vectors).items
        draws = [("representative", 0, chosen)] + [
            ("random", draw, random.Random(options.seed + draw).sample(list(pool), budget))
            for draw in range(options.random_repeats)]
        for method, draw, items in draws:
            outcome = validation_kappa([answers[i.id] for i in items], golden, options, judge_config, memo)
            result.points.append(StudyPoint(method, budget, draw, outcome.kappa, outcome.passed, outcome.note,
                                            outcome.kappa_low, outcome.kappa_high, outcome.pass_threshold))
        if progress is not None:
            progress(f"{budget} reviews: representative kappa {_fmt(result.kappas('representative', budget)[0])}, "
                     f"random median {_fmt(result.summary_kappa('random', budget))}")
    return result


NO_RUBRIC_Y = -0.1  # where the plot marks a budget whose reviews distilled into no rubric


def plot_study(result: StudyResult, path: "str | pathlib.Path") -> "str | pathlib.Path":
    """kappa vs reviews (log x): representative line, random median with its min-max band, the
    gate; a budget that distilled into no rubric is an "x" below zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result.budgets()

    def shown(values: list[float | None]) -> list[float]:
        return [NO_RUBRIC_Y if v is None or v == -1.0 else v for v in values]

    rep = shown([result.summary_kappa("representative", b) for b in budgets])
    rnd = [shown(result.kappas("random", b)) for b in budgets]
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    rep_points = {p.budget: p for p in result.points if p.method == "representative"}
    below = [max(0.0, v - rep_points[b].kappa_low) if b in rep_points and rep_points[b].kappa_low is not None else 0.0
             for b, v in zip(budgets, rep)]
    above = [max(0.0, rep_points[b].kappa_high - v) if b in rep_points and rep_points[b].kappa_high is not None
             else 0.0 for b, v in zip(budgets, rep)]
    axes.errorbar(budgets, rep, yerr=[below, above], marker="o", capsize=3,
                  label="representative (calibrl sme sample), 95% CI")
    axes.plot(budgets, [statistics.median(v) for v in rnd], marker="s", label="random (median of draws)")
    axes.fill_between(budgets, [min(v) for v in rnd], [max(v) for v in rnd], alpha=0.2, label="random (min-max)")
    failed = [(p.budget, NO_RUBRIC_Y) for p in result.points if p.kappa is None]
    if failed:
        axes.scatter(*zip(*failed), marker="x", color="black", zorder=3, label="no rubric distilled (fails the gate)")
    axes.axhline(result.options.min_kappa, color="grey", linestyle="--", label=f"gate: {result.gate_text()}")
    axes.set_xscale("log")
    axes.set_xticks(budgets)
    axes.set_xticklabels([str(b) for b in budgets], fontsize=8)
    axes.minorticks_off()
    axes.set_xlabel("expert reviews distilled into the rubric (log scale)")
    axes.set_ylabel("validation Cohen's kappa (same golden set)")
    axes.set_ylim(-0.2, 1.02)
    axes.legend(loc="lower right", fontsize=8)
    axes.set_title(f"Judge agreement vs expert reviews ({result.golden_size} golden items)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def report_section(result: StudyResult, plot_name: str) -> str:
    """The demo report's section: what was measured, the verdict, the table and the plot."""
    return "\n".join([
        "## SME time: representative vs random sampling", "",
        "The judge's validation kappa when its rubric is distilled from only n expert reviews, the n chosen by "
        "`calibrl sme sample` (representative) or at random; each rubric's pass threshold is picked on its own n "
        "reviews and the rubric is validated on the same golden set, with the kappa's 95% bootstrap interval. "
        "A budget whose reviews distil into no rubric (too few tagged errors), or hold one expert verdict only "
        "(no threshold), counts as failing the gate.", "",
        f"- {result.verdict()}", "",
        result.table(), "",
        f"![kappa vs expert reviews](plots/{plot_name})", "",
    ])


def demo_inputs(domain: "Domain", search: SearchFn, golden_fraction: float = 0.3
                ) -> tuple[list[SampleItem], dict[str, FeedbackRecord], list[FeedbackRecord]]:
    """(pool, answers, golden) of the built-in demo domain: its SME feedback split as
    ``calibrl rubric distill`` splits it; the pool is the non-golden part, each item with
    the documents ``search(outputs) -> doc ids per output`` retrieves for its rewrite
    (hence its outcome, hit or miss) and the gold passage of its query."""
    from calibrl.judge_server.authoring.distill import split_golden
    from calibrl.judge_server.authoring.feedback import parse_record

    records = [parse_record(feedback.record(), "<demo feedback>", n + 1) for n, feedback in enumerate(domain.sme_feedback)]
    train, golden = split_golden(records, golden_fraction)
    gold = {task.query: tuple(task.gold_doc_ids) for task in domain.rewrite_tasks}
    retrieved = search([r.output for r in train])
    # hit is given explicitly: an output that retrieves nothing is a miss, not an unknown outcome
    pool = [SampleItem(id=r.id, query=r.query, output=r.output, retrieved_doc_ids=tuple(ids),
                       gold_doc_ids=gold.get(r.query, ()), context=r.context,
                       signals=(("hit", float(bool(set(gold.get(r.query, ())) & set(ids)))),))
            for r, ids in zip(train, retrieved)]
    return pool, {r.id: r for r in train}, golden


DEMO_BUDGETS = (5, 8, 10, 15, 20, 30, 45, 60, 90, 120, 160)
QUICK_BUDGETS = (5, 10, 20, 40)


def run_demo_study(domain: "Domain", search: SearchFn, out_dir: "str | pathlib.Path", *, seed: int = 0,
                   quick: bool = False, progress: ProgressFn | None = None) -> str:
    """The demo's stage: run the study on the demo domain (``search``: BM25 doc ids per
    query, hit@1), write ``sme_study.json``, ``plots/sme_kappa_vs_reviews.png`` and the
    pool as ``sme_items.jsonl`` (input of ``calibrl sme sample``) under ``out_dir``;
    returns the report section (markdown)."""
    import json
    import pathlib

    out = pathlib.Path(out_dir)
    pool, answers, golden = demo_inputs(domain, search)
    options = StudyOptions(budgets=QUICK_BUDGETS if quick else DEMO_BUDGETS, random_repeats=2 if quick else 5,
                           seed=seed, glossary=tuple(domain.glossary_terms()))
    result = run_study(pool, answers, golden, options, progress=progress)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    plot_study(result, out / "plots" / "sme_kappa_vs_reviews.png")
    (out / "sme_study.json").write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    write_items(out / "sme_items.jsonl", pool)  # the pool, ready for `calibrl sme sample --rollouts`
    if progress is not None:
        progress(result.verdict())
    return report_section(result, "sme_kappa_vs_reviews.png")
