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
:func:`calibrl.trainer.kinds.search.metrics.evaluate_search` does, and keeps one
:class:`SearchRecord` per question, so that two models can be compared question by
question (:func:`paired_gain`, through :mod:`calibrl.stats`).

Two shortcuts an agent can take without reading are measured beside every arm:

* the **best constant answer** (:func:`best_constant_answers`): per aspect of the
  question (expense ratio, risk rating, ...), the answer most frequent among the
  *training* questions, given to every held-out question of that aspect with no
  search at all (:func:`constant_records`). A trained arm's gain counts only where it
  beats both the base and this baseline;
* **answering a constant per aspect**: the share of an arm's answers to an aspect's
  questions that are its single most frequent answer to that aspect
  (:func:`modal_answer_shares`).

And whether an agent reads what it retrieved (:func:`readout`): of the trajectories
whose searches returned the answer document, the share that answered exactly its
value (the *read-out rate*), and of the exactly correct answers, the share whose
value appears in a passage the trajectory retrieved (the *grounded* share).

Held-out questions are not independent of each other when they share a bridge
document (the same account or fund asked about different facts): every paired
comparison resamples whole bridge clusters (:func:`bridge_of`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from calibrl.json_types import JsonObject
from calibrl.stats import Interval, paired_difference

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.domain import MultiStepTask
    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.task_kinds import RunAsync
    from calibrl.trainer.tasks import Task

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

    @property
    def bridge_found(self) -> float:
        """1.0 when the first search returned the bridge document."""
        return float(bool(self.found) and bool(self.gold_doc_ids) and self.gold_doc_ids[0] in self.found[0])

    @property
    def recall(self) -> float:
        """Search recall: the share of the gold documents (bridge and answer document) that
        some search of the trajectory returned."""
        gold = set(self.gold_doc_ids)
        return len(gold & {d for docs in self.found for d in docs}) / len(gold) if gold else 0.0

    def as_dict(self) -> JsonObject:
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

    def as_dict(self) -> JsonObject:
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
    """The held-out metrics of :func:`calibrl.trainer.kinds.search.metrics.evaluate_search`, from the records."""
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


def greedy_search_records(model: str, tasks: Sequence["Task"], retrieval: "RetrievalClient", settings: "EvalSettings",
                          run_async: "RunAsync") -> list[SearchRecord]:
    """Greedy trajectories of the model folder (or training checkpoint) ``model`` on search ``tasks``, one record each
    (built-in search template, no chat template: how the demo's agent is trained)."""
    import gc

    from calibrl.text import exact_match, token_f1
    from calibrl.trainer.engines import make_engine
    from calibrl.trainer.eval import resolve_model_path
    from calibrl.trainer.policy import load_policy
    from calibrl.trainer.kinds.search.rollout import rollout_search

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


def aspect_of(doc_id: str, aspects: Sequence[str]) -> str:
    """The aspect whose key (``_`` written ``-``) ends the answer document id ``doc_id``
    (``summit-expense-ratio`` -> ``expense_ratio``); the longest key wins."""
    for key in sorted(aspects, key=len, reverse=True):
        if doc_id.endswith("-" + key.replace("_", "-")):
            return key
    raise ValueError(f"answer document {doc_id!r} ends in none of the aspects {sorted(aspects)}")


def best_constant_answers(train_tasks: Sequence["MultiStepTask"], aspects: Sequence[str]) -> dict[str, str]:
    """Per aspect, the gold answer most frequent among the training tasks (``answers[0]``;
    ties go to the answer first in sorted order): the best a policy can do that answers
    every question of an aspect alike, knowing only the training set."""
    counts: dict[str, dict[str, int]] = {}
    for task in train_tasks:
        aspect = aspect_of(task.gold_doc_ids[-1], aspects)
        answer = task.answers[0]
        counts.setdefault(aspect, {}).setdefault(answer, 0)
        counts[aspect][answer] += 1
    return {aspect: min(by_answer, key=lambda a: (-by_answer[a], a)) for aspect, by_answer in sorted(counts.items())}


def constant_records(records: Sequence[SearchRecord], constants: dict[str, str],
                     aspects: Sequence[str]) -> list[SearchRecord]:
    """The best-constant baseline on the questions of ``records``: no search, the aspect's
    constant as the answer (an aspect never seen in training answers nothing)."""
    from calibrl.text import exact_match, token_f1

    out = []
    for record in records:
        answer = constants.get(aspect_of(record.gold_doc_ids[-1], aspects))
        out.append(SearchRecord(
            task_id=record.task_id, question=record.question, answers=record.answers,
            gold_doc_ids=record.gold_doc_ids, queries=(), found=(), answer=answer, well_formed=answer is not None,
            em=exact_match(answer, record.answers) if answer else 0.0,
            f1=token_f1(answer, record.answers) if answer else 0.0,
        ))
    return out


def modal_answer_shares(records: Sequence[SearchRecord], aspects: Sequence[str]) -> dict[str, JsonObject]:
    """Per aspect: how many questions, the arm's most frequent (normalised) answer, and
    the share of the aspect's questions it gave that answer to (1.0: a constant)."""
    from calibrl.text import normalize_answer

    by_aspect: dict[str, list[str]] = {}
    for record in records:
        by_aspect.setdefault(aspect_of(record.gold_doc_ids[-1], aspects), []).append(
            normalize_answer(record.answer) if record.answer is not None else "")
    out = {}
    for aspect, answers in sorted(by_aspect.items()):
        modal = min(set(answers), key=lambda a: (-answers.count(a), a))
        out[aspect] = {"questions": len(answers), "modal_answer": modal, "share": answers.count(modal) / len(answers)}
    return out


def readout(records: Sequence[SearchRecord], passages: dict[str, str]) -> JsonObject:
    """Whether answers come from what was read: ``found_answer_doc`` trajectories whose
    searches returned the answer document, ``readout_rate`` the share of those answering
    exactly; ``correct`` exactly correct answers, ``grounded_share`` the share of those whose
    gold value appears (normalised, as a word sequence) in a passage the trajectory
    retrieved. Rates are None where nothing was counted."""
    found = [r for r in records if found_answer_doc(r)]
    correct = [r for r in records if r.em >= 1.0]
    return {
        "questions": len(records),
        "found_answer_doc": len(found),
        "readout_rate": sum(r.em >= 1.0 for r in found) / len(found) if found else None,
        "correct": len(correct),
        "grounded_share": sum(grounded(r, passages) for r in correct) / len(correct) if correct else None,
    }


def grounded(record: SearchRecord, passages: dict[str, str]) -> bool:
    """Whether a gold value of the record appears (normalised, as a word sequence) in a
    passage its searches retrieved."""
    from calibrl.text import normalize_answer

    texts = [f" {normalize_answer(passages.get(d, ''))} " for docs in record.found for d in docs]
    values = [f" {normalize_answer(a)} " for a in record.answers]
    return any(value.strip() and value in text for value in values for text in texts)


def found_answer_doc(record: SearchRecord) -> bool:
    """Whether some search of the trajectory returned the answer document."""
    return bool(record.gold_doc_ids) and any(record.gold_doc_ids[-1] in docs for docs in record.found)


def bridge_of(record: SearchRecord) -> str:
    """The cluster of a question for resampling: its bridge document (questions through the
    same account or fund share what the first search must find)."""
    return record.gold_doc_ids[0] if record.gold_doc_ids else record.task_id


def question_of(task_id: str) -> str:
    """The question behind a phrasing's task id (``ms-roth-expense-ratio-3`` -> ``ms-roth-expense-ratio``);
    an id that does not end in a phrasing number is a question of its own."""
    question, _, phrasing = task_id.rpartition("-")
    return question if question and phrasing.isdigit() else task_id


def paired_gain(base: Sequence[SearchRecord], other: Sequence[SearchRecord], *, by_question: bool = False,
                by_bridge: bool = False, metric: str = "f1", **options: int | float) -> Interval:
    """Paired bootstrap (:func:`calibrl.stats.paired_difference`) of the answer-F1 gain of
    ``other`` over ``base`` on the same questions (``metric="em"``: of the exact-match
    gain); ``by_question`` resamples questions with all their phrasings together (the
    phrasings of one question are not independent); ``by_bridge`` resamples every
    question through one bridge document together (:func:`bridge_of`)."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: must be one of {list(METRICS)}")
    if [r.task_id for r in base] != [r.task_id for r in other]:
        raise ValueError("the two record lists are not over the same questions in the same order")
    clusters = ([bridge_of(r) for r in base] if by_bridge
                else [question_of(r.task_id) for r in base] if by_question else None)
    return paired_difference([float(getattr(r, metric)) for r in other], [float(getattr(r, metric)) for r in base],
                             clusters=clusters, **options)


METRICS = ("f1", "em", "recall")  # what a paired comparison may compare (SearchRecord attributes)
METRIC_UNITS = {"f1": "points of answer F1", "em": "points of exact match",
                "recall": "points of search recall (bridge and answer document found)"}
BEST_CONSTANT = "best_constant"  # the name of the best-constant baseline among the compared models


def analysis_results(records: dict[str, Sequence[SearchRecord]], labels: dict[str, str], base: str = "base_agent",
                     *, constants: dict[str, str] | None = None, aspects: Sequence[str] = (),
                     passages: dict[str, str] | None = None, resamples: int = 10_000,
                     seed: int = 0) -> JsonObject:
    """The report's data. Per model (``records`` by name, the base first): the category
    counts, the read-out figures (with ``passages``, doc id -> text) and, with ``aspects``,
    how often it answers one constant per aspect. With ``constants`` (aspect -> the best
    constant answer, :func:`best_constant_answers`), the best-constant baseline joins the
    comparisons. Comparisons, paired by question and resampling whole bridge clusters,
    in answer F1 and exact match: every trained model vs the base and vs the best constant,
    and every pair of trained models."""
    if base not in records:
        raise ValueError(f"no records of the base model {base!r}")
    trained = [name for name in records if name != base]
    compared = dict(records)
    results: JsonObject = {
        "questions": len(records[base]),
        "independent_questions": len({question_of(r.task_id) for r in records[base]}),
        "bridge_clusters": len({bridge_of(r) for r in records[base]}),
        "resamples": resamples,
        "labels": {name: labels.get(name, name) for name in records},
        "categories": {name: analyse(recs).as_dict() for name, recs in records.items()},
    }
    results["search"] = {name: search_figures(recs) for name, recs in records.items()}
    if passages is not None:
        results["readout"] = {name: readout(recs, passages) for name, recs in records.items()}
    if aspects:
        results["modal_answers"] = {name: modal_answer_shares(recs, aspects) for name, recs in records.items()}
    if constants is not None:
        baseline = constant_records(records[base], constants, aspects)
        compared[BEST_CONSTANT] = baseline
        results["labels"][BEST_CONSTANT] = labels.get(BEST_CONSTANT, "best constant answer per aspect (no search)")
        results["constant"] = _constant_summary(baseline, constants, aspects)
    pairs = [(name, base) for name in trained]
    if constants is not None:
        pairs += [(name, BEST_CONSTANT) for name in trained]
    pairs += [(a, b) for i, b in enumerate(trained) for a in trained[i + 1:]]
    results["comparisons"] = [
        {"a": a, "b": b, "metric": metric,
         **paired_gain(compared[b], compared[a], by_bridge=True, metric=metric, resamples=resamples,
                       seed=seed).as_dict()}
        for a, b in pairs for metric in METRICS
        if not (metric == "recall" and BEST_CONSTANT in (a, b))]  # the constant searches nothing
    return results


def search_figures(records: Sequence[SearchRecord]) -> dict[str, float]:
    """The shares of trajectories whose first search returned the bridge document and whose
    searches returned the answer document, and the mean search recall."""
    n = len(records) or 1
    return {"bridge_found": sum(r.bridge_found for r in records) / n,
            "answer_doc_found": sum(found_answer_doc(r) for r in records) / n,
            "recall": sum(r.recall for r in records) / n}


def _constant_summary(baseline: Sequence[SearchRecord], constants: dict[str, str],
                      aspects: Sequence[str]) -> JsonObject:
    per_aspect: dict[str, JsonObject] = {}
    for record in baseline:
        aspect = aspect_of(record.gold_doc_ids[-1], aspects)
        row = per_aspect.setdefault(aspect, {"answer": constants.get(aspect), "questions": 0, "em": 0.0, "f1": 0.0})
        row["questions"] += 1
        row["em"] += record.em
        row["f1"] += record.f1
    for row in per_aspect.values():
        row["em"] /= row["questions"]
        row["f1"] /= row["questions"]
    return {"em": sum(r.em for r in baseline) / len(baseline), "f1": sum(r.f1 for r in baseline) / len(baseline),
            "per_aspect": dict(sorted(per_aspect.items()))}


def comparison(results: JsonObject, a: str, b: str, metric: str = "f1") -> JsonObject | None:
    """The paired comparison ``a - b`` in ``metric`` of :func:`analysis_results`, if made."""
    return next((c for c in results.get("comparisons", ())
                 if c["a"] == a and c["b"] == b and c["metric"] == metric), None)


def analysis_markdown(results: JsonObject) -> list[str]:
    """The report section of :func:`analysis_results`."""
    from calibrl.stats import describe_difference

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
    lines += _shortcut_lines(results, names)
    if results.get("comparisons"):
        clusters = results.get("bridge_clusters", results["questions"])
        lines += [f"Paired comparisons (same questions; percentile bootstrap over {clusters} bridge clusters, "
                  f"{results['resamples']} resamples). A difference is a win only when its interval excludes zero.",
                  ""]
        for item in results["comparisons"]:
            unit = METRIC_UNITS[item["metric"]]
            lines.append("- " + describe_difference(labels[item["a"]], labels[item["b"]], item, unit))
        lines.append("")
    return lines


def _shortcut_lines(results: JsonObject, names: Sequence[str]) -> list[str]:
    """The read-out, constant-answer and best-constant tables, where computed."""
    labels, lines = results["labels"], []
    if "search" in results:
        lines += ["Search recall: the share of trajectories whose first search returned the bridge document, whose "
                  "searches returned the answer document, and the mean share of the two found.", "",
                  "| agent | bridge found | answer document found | search recall |", "| --- | ---: | ---: | ---: |"]
        for name in names:
            r = results["search"][name]
            lines.append(f"| {labels[name]} | {_rate(r['bridge_found'])} | {_rate(r['answer_doc_found'])} "
                         f"| {_rate(r['recall'])} |")
        lines.append("")
    if "readout" in results:
        lines += ["Does the agent read? Of the trajectories whose searches returned the answer document, the share "
                  "answering its value exactly (read-out rate); of the exact answers, the share whose value is in a "
                  "passage the trajectory retrieved (grounded).", "",
                  "| agent | found the answer document | read-out rate | exact answers | grounded |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name in names:
            r = results["readout"][name]
            lines.append(f"| {labels[name]} | {r['found_answer_doc']} / {r['questions']} | {_rate(r['readout_rate'])} "
                         f"| {r['correct']} | {_rate(r['grounded_share'])} |")
        lines.append("")
    if "modal_answers" in results:
        aspects = sorted({a for n in names for a in results["modal_answers"][n]})
        lines += ["Does the agent answer a constant? Per aspect, the share of its answers that are its most "
                  "frequent answer to that aspect (100%: the same answer to every question).", "",
                  "| aspect | questions | " + " | ".join(labels[n] for n in names) + " |",
                  "| --- | ---: |" + " --- |" * len(names)]
        for aspect in aspects:
            cells = []
            for name in names:
                row = results["modal_answers"][name].get(aspect)
                cells.append(f"{100 * row['share']:.0f}% \"{row['modal_answer']}\"" if row else "-")
            count = next(results["modal_answers"][n][aspect]["questions"] for n in names
                         if aspect in results["modal_answers"][n])
            lines.append(f"| {aspect} | {count} | " + " | ".join(cells) + " |")
        lines.append("")
    if "constant" in results:
        constant = results["constant"]
        lines += [f"Best constant answer per aspect (the most frequent training answer, no search): exact match "
                  f"{100 * constant['em']:.1f}%, answer F1 {100 * constant['f1']:.1f}% on the held-out questions.", "",
                  "| aspect | constant | questions | exact match | answer F1 |", "| --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {aspect} | {row['answer']} | {row['questions']} | {100 * row['em']:.1f}% | {100 * row['f1']:.1f}% |"
                  for aspect, row in constant["per_aspect"].items()]
        lines.append("")
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _phrasings(results: JsonObject) -> str:
    independent = results.get("independent_questions", results["questions"])
    if independent == results["questions"]:
        return " (one phrasing each: resampling tasks and whole questions is the same)"
    return f" ({independent} questions in several phrasings each)"


__all__ = [
    "BEST_CONSTANT", "CATEGORIES", "METRICS", "METRIC_UNITS", "search_figures", "CATEGORY_LABELS", "CORRECT", "ErrorAnalysis", "MALFORMED", "MISSED_ANSWER_DOC",
    "MISSED_BRIDGE", "SearchRecord", "WRONG_ANSWER", "analyse", "analysis_markdown", "analysis_results", "aspect_of",
    "best_constant_answers", "bridge_of", "classify", "comparison", "constant_records", "found_answer_doc",
    "greedy_search_records", "grounded",
    "modal_answer_shares", "paired_gain", "question_of", "readout", "summary_metrics",
]
