"""What the search agent reports: its held-out metrics (``calibrl eval``), its
``calibrl sme sample`` items and the metrics of each training step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from calibrl.entities import repeats_earlier
from calibrl.text import exact_match, token_f1
from calibrl.trainer.kinds.search.records import SearchRollout
from calibrl.trainer.kinds.search.rollout import rollout_search
from calibrl.trainer.kinds.search.step_rewards import step_reward_metrics
from calibrl.trainer.rewards import RewardBreakdown
from calibrl.trainer.task_kinds import RunAsync
from calibrl.trainer.tasks import Task

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.sme.items import SampleItem

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.eval import EvalSettings

METRIC_NAMES = ("em", "f1", "answered", "well_formed", "searches", "gold_doc_recall")  # the eval table's columns


def evaluate_search(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                    retrieval: "RetrievalClient", settings: "EvalSettings", run_async: RunAsync, template: str,
                    chat_template: bool | None) -> dict[str, float]:
    totals = dict.fromkeys(METRIC_NAMES, 0.0)
    with_gold = 0
    for start in range(0, len(tasks), settings.batch_size):
        batch = rollout_search(
            engine, tokenizer, tasks[start : start + settings.batch_size], group_size=1, retrieval=retrieval,
            run_async=run_async, max_turns=settings.max_turns, top_k=settings.search_top_k,
            max_new_tokens_per_turn=settings.max_new_tokens, max_obs_tokens=settings.max_obs_tokens,
            temperature=0.0, prompt_template=template, chat_template=chat_template,
        )
        for rollout in batch.rollouts:
            answer = (rollout.answer or "").strip()
            golds = rollout.task.answers
            totals["em"] += exact_match(answer, golds) if answer else 0.0
            totals["f1"] += token_f1(answer, golds) if answer else 0.0
            totals["answered"] += float(rollout.answer is not None)
            totals["well_formed"] += float(rollout.well_formed)
            totals["searches"] += len(rollout.steps)
            gold = set(rollout.task.gold_doc_ids)
            if gold:
                found = {d for step in rollout.steps for d in step.result.doc_ids}
                totals["gold_doc_recall"] += len(gold & found) / len(gold)
                with_gold += 1
    metrics = {name: value / len(tasks) for name, value in totals.items() if name != "gold_doc_recall"}
    metrics["gold_doc_recall"] = totals["gold_doc_recall"] / with_gold if with_gold else float("nan")
    return metrics


def search_items(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence[Task],
                 retrieval: "RetrievalClient", settings: "EvalSettings", run_async: RunAsync, template: str,
                 chat: bool | None, name: str) -> "tuple[list[SampleItem], int]":
    """The ``search`` kind's items (its ``TaskKind.sample_items``); none is left out."""
    # calibrl.sme.items reads the judge's feedback format: imported only when SME items are written,
    # so the trainer's kinds import no judge code.
    from calibrl.sme.items import SampleItem

    items = []
    for start in range(0, len(tasks), settings.batch_size):
        batch = rollout_search(
            engine, tokenizer, tasks[start : start + settings.batch_size], group_size=1, retrieval=retrieval,
            run_async=run_async, max_turns=settings.max_turns, top_k=settings.search_top_k,
            max_new_tokens_per_turn=settings.max_new_tokens, max_obs_tokens=settings.max_obs_tokens,
            temperature=0.0, prompt_template=template, chat_template=chat,
        )
        for rollout in batch.rollouts:
            task = rollout.task
            answer = (rollout.answer or "").strip()
            parts = [f"search: {step.query}" for step in rollout.steps]
            parts.append(f"answer: {answer}" if rollout.answer is not None else "(no answer)")
            documents: dict[str, str] = {}
            for step in rollout.steps:
                for hit in step.result.hits:
                    documents.setdefault(hit.doc_id, hit.text)
            signals = [("em", exact_match(answer, task.answers) if answer else 0.0),
                       ("f1", token_f1(answer, task.answers) if answer else 0.0),
                       ("well_formed", float(rollout.well_formed))]
            if task.gold_doc_ids:
                signals.append(("hit", float(bool(set(task.gold_doc_ids) & set(documents)))))
            items.append(SampleItem(
                id=f"{name}:{task.task_id}", query=task.query, output=" | ".join(parts),
                retrieved_doc_ids=tuple(documents),
                retrieved_texts=tuple(documents.values()) if all(documents.values()) else (),
                gold_doc_ids=tuple(task.gold_doc_ids), signals=tuple(sorted(signals)), model=name,
                context=tuple(task.context),
            ))
    return items, 0


def collapse_metrics(rollouts: Sequence[SearchRollout]) -> dict[str, float]:
    """The search agent's collapse signals, logged every step of every search run
    (whether or not step rewards are scored):

    * ``search/well_formed``: share of trajectories that follow the format grammar
      (``calibrl.trainer.search_format``, the rule the reward and CalibAdv use);
    * ``search/answered``: share that ended with an ``<answer>``;
    * ``search/searches_per_trajectory``: mean number of ``<search>`` steps;
    * ``search/repeated_share``: share of search steps whose query repeats an earlier
      query of its trajectory (the search-step rubric's word similarity, the test
      behind ``steps/repeated_share``), 0 when nobody searched."""
    searches = list(rollouts)
    if not searches:
        return {}
    queries = [[step.query for step in r.steps] for r in searches]
    steps = sum(len(q) for q in queries)
    repeated = sum(repeats_earlier(q[k], q[:k]) for q in queries for k in range(len(q)))
    return {
        "search/well_formed": sum(bool(r.well_formed) for r in searches) / len(searches),
        "search/answered": sum(r.answer is not None for r in searches) / len(searches),
        "search/searches_per_trajectory": steps / len(searches),
        "search/repeated_share": repeated / steps if steps else 0.0,
    }


def search_step_metrics(rollouts: Sequence[SearchRollout], breakdowns: Sequence[RewardBreakdown]) -> dict[str, float]:
    """A training step's search metrics: the collapse signals and, when step rewards were
    computed, the ``steps/*`` metrics (:func:`~calibrl.trainer.kinds.search.step_rewards.step_reward_metrics`)."""
    return {**step_reward_metrics(breakdowns), **collapse_metrics(rollouts)}


__all__ = ["METRIC_NAMES", "collapse_metrics", "evaluate_search", "search_items", "search_step_metrics"]
