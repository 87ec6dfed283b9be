"""Where a two-search agent fails: one category per greedy trajectory, and paired comparisons.

A two-search question (:class:`calibrl.demo.domain.MultiStepTask`) has two gold
documents, in order: the *bridge* document (it names the entity the question only
describes, e.g. the default fund of an account) and the *answer* document (the fact
of that entity). Each greedy trajectory falls in exactly one category, checked in
this order:

1. ``malformed``: no well-formed Search-R1 trajectory ending in an answer;
2. ``correct``: the answer matches a gold answer exactly (after normalisation);
3. ``wrong_answer``: some search found the answer document, yet the answer is wrong
   (the right documents were read, the extraction failed);
4. ``missed_bridge``: the first search did not find the bridge document;
5. ``missed_answer_doc``: the first search found the bridge, but no later search
   found the answer document (a wrong second query, or no second search).

:func:`greedy_search_records` decodes each question greedily, exactly as
:func:`calibrl.trainer.eval.evaluate_search` does, and keeps one
:class:`SearchRecord` per question, so that two models can be compared question by
question (:func:`paired_gain`, through :mod:`calibrl.stats`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from calibrl.stats import Interval, paired_difference

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.eval import EvalSettings

MALFORMED = "malformed"
MISSED_BRIDGE = "missed_bridge"
MISSED_ANSWER_DOC = "missed_answer_doc"
WRONG_ANSWER = "wrong_answer"
CORRECT = "correct"
CATEGORIES = (MALFORMED, MISSED_BRIDGE, MISSED_ANSWER_DOC, WRONG_ANSWER, CORRECT)
CATEGORY_LABELS = {
    MALFORMED: "malformed (no well-formed trajectory with an answer)",
    MISSED_BRIDGE: "first search missed the bridge document",
    MISSED_ANSWER_DOC: "second search missed the answer document (or no second search)",
    WRONG_ANSWER: "right documents, wrong answer",
    CORRECT: "correct (exact match)",
}


@dataclass(frozen=True)
class SearchRecord:
    """One greedy trajectory of one two-search question, and what it got right."""

    task_id: str
    question: str
    answers: tuple[str, ...]
    gold_doc_ids: tuple[str, ...]  # (bridge document, answer document)
    queries: tuple[str, ...]  # the agent's searches, in order
    found: tuple[tuple[str, ...], ...]  # documents each search returned
    answer: str | None
    well_formed: bool
    em: float
    f1: float

    @property
    def category(self) -> str:
        return classify(self)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "category": self.category}


def classify(record: SearchRecord) -> str:
    """The record's category (see the module docstring for the order of the checks)."""
    if not record.well_formed or record.answer is None:
        return MALFORMED
    if record.em >= 1.0:
        return CORRECT
    if len(record.gold_doc_ids) < 2:
        raise ValueError(f"{record.task_id}: a two-search question needs a bridge and an answer document, "
                         f"got gold_doc_ids={list(record.gold_doc_ids)}")
    bridge, answer_doc = record.gold_doc_ids[0], record.gold_doc_ids[-1]
    if any(answer_doc in docs for docs in record.found):
        return WRONG_ANSWER
    if not record.found or bridge not in record.found[0]:
        return MISSED_BRIDGE
    return MISSED_ANSWER_DOC


@dataclass(frozen=True)
class ErrorAnalysis:
    """Counts and shares of each category over a set of records."""

    total: int
    counts: dict[str, int]
    mean_f1: float

    def share(self, category: str) -> float:
        return self.counts[category] / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "mean_f1": self.mean_f1, "counts": dict(self.counts),
                "shares": {c: self.share(c) for c in CATEGORIES}}


def analyse(records: Sequence[SearchRecord]) -> ErrorAnalysis:
    """Count the categories of ``records``."""
    counts = dict.fromkeys(CATEGORIES, 0)
    for record in records:
        counts[record.category] += 1
    mean_f1 = sum(r.f1 for r in records) / len(records) if records else 0.0
    return ErrorAnalysis(len(records), counts, mean_f1)


def summary_metrics(records: Sequence[SearchRecord]) -> dict[str, float]:
    """The held-out metrics of :func:`calibrl.trainer.eval.evaluate_search`, from the records."""
    count = len(records)
    if not count:
        raise ValueError("no records to summarise")
    recall = [len(set(r.gold_doc_ids) & {d for docs in r.found for d in docs}) / len(set(r.gold_doc_ids))
              for r in records if r.gold_doc_ids]
    return {
        "em": sum(r.em for r in records) / count,
        "f1": sum(r.f1 for r in records) / count,
        "answered": sum(r.answer is not None for r in records) / count,
        "well_formed": sum(r.well_formed for r in records) / count,
        "searches": sum(len(r.queries) for r in records) / count,
        "gold_doc_recall": sum(recall) / len(recall) if recall else float("nan"),
    }


def greedy_search_records(model: str, tasks: Sequence[Any], retrieval: Any, settings: "EvalSettings",
                          run_async: Callable[[Any], Any]) -> list[SearchRecord]:
    """Greedy trajectories of the model folder (or training checkpoint) ``model`` on search ``tasks``, one record each
    (built-in search template, no chat template: how the demo's agent is trained)."""
    import gc

    from calibrl.text import exact_match, token_f1
    from calibrl.trainer.engines import make_engine
    from calibrl.trainer.eval import resolve_model_path
    from calibrl.trainer.policy import load_policy
    from calibrl.trainer.rollout import rollout_search

    policy = load_policy(str(resolve_model_path(model)), device=settings.device, dtype="auto")
    policy.model.eval()
    records: list[SearchRecord] = []
    try:
        engine = make_engine("transformers", policy)
        for start in range(0, len(tasks), settings.batch_size):
            batch = rollout_search(
                engine, policy.tokenizer, tasks[start : start + settings.batch_size], group_size=1,
                retrieval=retrieval, run_async=run_async, max_turns=settings.max_turns,
                top_k=settings.search_top_k, max_new_tokens_per_turn=settings.max_new_tokens,
                max_obs_tokens=settings.max_obs_tokens, temperature=0.0,
            )
            for rollout in batch.rollouts:
                answer = rollout.answer.strip() if rollout.answer is not None else None
                golds = tuple(rollout.task.answers)
                records.append(SearchRecord(
                    task_id=rollout.task.task_id, question=rollout.task.query, answers=golds,
                    gold_doc_ids=tuple(rollout.task.gold_doc_ids),
                    queries=tuple(step.query for step in rollout.steps),
                    found=tuple(tuple(step.result.doc_ids) for step in rollout.steps),
                    answer=answer, well_formed=bool(rollout.well_formed),
                    em=exact_match(answer, golds) if answer else 0.0,
                    f1=token_f1(answer, golds) if answer else 0.0,
                ))
    finally:
        del policy
        gc.collect()
    return records


def question_of(task_id: str) -> str:
    """The question behind a phrasing's task id (``ms-roth-expense-ratio-3`` -> ``ms-roth-expense-ratio``);
    an id that does not end in a phrasing number is a question of its own."""
    question, _, phrasing = task_id.rpartition("-")
    return question if question and phrasing.isdigit() else task_id


def paired_gain(base: Sequence[SearchRecord], other: Sequence[SearchRecord], *, by_question: bool = False,
                metric: str = "f1", **options: Any) -> Interval:
    """Paired bootstrap (:func:`calibrl.stats.paired_difference`) of the answer-F1 gain of
    ``other`` over ``base`` on the same questions (``metric="em"``: of the exact-match
    gain); ``by_question`` resamples questions with all their phrasings together (the
    phrasings of one question are not independent)."""
    if metric not in ("f1", "em"):
        raise ValueError(f"metric={metric!r}: must be 'f1' or 'em'")
    if [r.task_id for r in base] != [r.task_id for r in other]:
        raise ValueError("the two record lists are not over the same questions in the same order")
    clusters = [question_of(r.task_id) for r in base] if by_question else None
    return paired_difference([float(getattr(r, metric)) for r in other], [float(getattr(r, metric)) for r in base],
                             clusters=clusters, **options)


def analysis_results(records: dict[str, Sequence[SearchRecord]], labels: dict[str, str], base: str = "base_agent",
                     resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """The report's data: per model (``records`` by name, the base first) the category
    counts, and for every other model its paired F1 gain over ``base`` with a 95% interval."""
    if base not in records:
        raise ValueError(f"no records of the base model {base!r}")
    return {
        "questions": len(records[base]),
        "independent_questions": len({question_of(r.task_id) for r in records[base]}),
        "resamples": resamples,
        "labels": {name: labels.get(name, name) for name in records},
        "categories": {name: analyse(recs).as_dict() for name, recs in records.items()},
        "paired_f1_vs_base": {name: paired_gain(records[base], recs, resamples=resamples, seed=seed).as_dict()
                              for name, recs in records.items() if name != base},
        # the phrasings of one question are not independent: the same, resampling whole questions
        "paired_f1_vs_base_by_question": {
            name: paired_gain(records[base], recs, by_question=True, resamples=resamples, seed=seed).as_dict()
            for name, recs in records.items() if name != base},
        # exact match apart: F1 gives a verbose answer holding the value partial credit, so an
        # agent that learns to answer with the value alone gains more EM than F1
        "paired_em_vs_base_by_question": {
            name: paired_gain(records[base], recs, by_question=True, metric="em", resamples=resamples,
                            seed=seed).as_dict()
            for name, recs in records.items() if name != base},
    }


def analysis_markdown(results: dict[str, Any]) -> list[str]:
    """The report section of :func:`analysis_results`."""
    names = list(results["categories"])
    labels = results["labels"]
    lines = ["## Two-search agent: where the trajectories fail", "",
             f"Greedy trajectories on {results['questions']} held-out questions{_phrasings(results)}, each in the "
             "category of its first failure (calibrl/demo/error_analysis.py).", "",
             "| category | " + " | ".join(labels[n] for n in names) + " |",
             "| --- |" + " ---: |" * len(names)]
    for category in CATEGORIES:
        cells = [f"{results['categories'][n]['counts'][category]} "
                 f"({100 * results['categories'][n]['shares'][category]:.0f}%)" for n in names]
        lines.append(f"| {CATEGORY_LABELS[category]} | " + " | ".join(cells) + " |")
    lines.append("")
    paired = results["paired_f1_vs_base"]
    if paired:
        lines += ["Answer F1 gain over the base agent, paired by question (percentile bootstrap, "
                  f"{results['resamples']} resamples):", ""]
        by_question = results.get("paired_f1_vs_base_by_question", {})
        for name, diff in paired.items():
            lines.append(f"- {labels[name]}: {100 * diff['estimate']:+.1f} points, 95% interval {_interval(diff)}"
                         + (f"; resampling whole questions (all phrasings together): {_interval(by_question[name])}"
                            if name in by_question else "") + ".")
        lines.append("")
    paired_em = results.get("paired_em_vs_base_by_question", {})
    if paired_em:
        lines += ["Exact-match gain over the base agent, paired by question (the same bootstrap, whole questions "
                  "resampled):", ""]
        lines += [f"- {labels[name]}: {100 * diff['estimate']:+.1f} points, 95% interval {_interval(diff)}."
                  for name, diff in paired_em.items()]
        lines.append("")
    return lines


def _phrasings(results: dict[str, Any]) -> str:
    independent = results.get("independent_questions", results["questions"])
    if independent == results["questions"]:
        return " (one phrasing each: resampling tasks and whole questions is the same)"
    return f" ({independent} questions in several phrasings each)"


def _interval(diff: dict[str, Any]) -> str:
    where = "above zero" if diff["low"] > 0 else ("below zero" if diff["high"] < 0 else "includes zero")
    return f"[{100 * diff['low']:+.1f}, {100 * diff['high']:+.1f}] ({where})"


__all__ = [
    "CATEGORIES", "CATEGORY_LABELS", "CORRECT", "ErrorAnalysis", "MALFORMED", "MISSED_ANSWER_DOC", "MISSED_BRIDGE",
    "SearchRecord", "WRONG_ANSWER", "analyse", "analysis_markdown", "analysis_results", "classify",
    "greedy_search_records", "paired_gain", "question_of", "summary_metrics",
]
