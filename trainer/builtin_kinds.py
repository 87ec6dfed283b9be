"""The two built-in task kinds, registered on import of :mod:`calibrl.trainer.task_kinds`.

- ``rewrite`` (:data:`REWRITE`): a one-step query rewriter. Records
  ``{"id", "query", "gold_doc_ids", ["answers"], ["context"]}``; a task needs a gold
  document id (its retrieval target).
- ``search`` (:data:`SEARCH`): a multi-step Search-R1 agent. Records
  ``{"id", "question", "answers", ["gold_doc_ids"], ["context"]}``, or the IRCoT-formatted
  HotpotQA dev set (``question_id``, ``question_text``, ``answers_objects[0].spans``,
  ``contexts`` whose supporting paragraphs' titles are the gold document ids); a task
  needs a gold answer.

A record of one kind's format can be trained as the other kind (``tasks.kind``): a
search record becomes a rewrite task whose retrieval targets are its gold passages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Coroutine, Sequence

from calibrl.errors import InvalidArgument
from calibrl.trainer.search_format import REWRITE_TEMPLATE, SEARCH_TEMPLATE
from calibrl.trainer.task_kinds import (
    RecordFormat,
    RolloutSettings,
    RunAsync,
    TaskKind,
    JsonRecord,
    lazy,
    register_task_kind,
)
from calibrl.trainer.tasks import Task, record_context, record_strings, record_text

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import RolloutConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.rewards import RewardBreakdown, RewardModel, RewriteRollout, SearchRollout
    from calibrl.trainer.rollout import RolloutBatch


def _with_context(record: dict[str, object], task: Task) -> dict[str, object]:
    if task.context:
        record["context"] = task.context_dict()
    return record


# --------------------------------------------------------------------------- rewrite: a one-step query rewriter


def _rollout_rewrites(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence[Task],
                      settings: RolloutSettings, retrieval: "RetrievalClient", run_async: RunAsync) -> "RolloutBatch":
    from calibrl.trainer.rollout import rollout_rewrites

    return rollout_rewrites(
        engine, tokenizer, tasks, group_size=settings.group_size, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
        prompt_template=settings.prompt_template, chat_template=settings.chat_template,
    )


def _score_rewrites(rewards: "RewardModel",
                    rollouts: "Sequence[RewriteRollout]") -> "Coroutine[Any, Any, list[RewardBreakdown]]":
    return rewards.score_rewrites(rollouts)


def _one_turn(rollout: "RolloutConfig") -> int:
    return rollout.max_new_tokens


def _parse_rewrite_record(record: JsonRecord, where: str) -> Task:
    return Task(
        task_id=record_text(record, "id", where), kind="rewrite", query=record_text(record, "query", where),
        gold_doc_ids=record_strings(record, "gold_doc_ids", where, required=True),
        answers=record_strings(record, "answers", where, required=False), context=record_context(record, where),
    )


def _rewrite_record(task: Task) -> dict[str, object]:
    record: dict[str, object] = {"id": task.task_id, "query": task.query, "gold_doc_ids": list(task.gold_doc_ids)}
    if task.answers:
        record["answers"] = list(task.answers)
    return _with_context(record, task)


REWRITE = register_task_kind(TaskKind(
    name="rewrite", builtin_template=REWRITE_TEMPLATE, rollout=_rollout_rewrites, score=_score_rewrites,
    evaluate=lazy("calibrl.trainer.eval", "evaluate_rewrites"),
    metric_names=("hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k", "empty_rewrite_rate"),
    max_completion_tokens=_one_turn,
    formats=(RecordFormat("rewrite", "query", _parse_rewrite_record),),
    required={"gold_doc_ids": "a rewrite task needs at least one gold document id (its retrieval target)"},
    write_record=_rewrite_record,
    query_baseline=lazy("calibrl.trainer.eval", "raw_query_metrics"),
    sample_items=lazy("calibrl.sme.eval_items", "rewrite_items"),
))


# --------------------------------------------------------------------------- search: a multi-step Search-R1 agent


def _rollout_search(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence[Task],
                    settings: RolloutSettings, retrieval: "RetrievalClient", run_async: RunAsync) -> "RolloutBatch":
    from calibrl.trainer.rollout import rollout_search

    return rollout_search(
        engine, tokenizer, tasks, group_size=settings.group_size, retrieval=retrieval, run_async=run_async,
        max_turns=settings.max_turns, top_k=settings.search_top_k, max_new_tokens_per_turn=settings.max_new_tokens,
        max_obs_tokens=settings.max_obs_tokens, temperature=settings.temperature, top_p=settings.top_p,
        seed=settings.seed, prompt_template=settings.prompt_template, chat_template=settings.chat_template,
    )


def _score_search(rewards: "RewardModel",
                  rollouts: "Sequence[SearchRollout]") -> "Coroutine[Any, Any, list[RewardBreakdown]]":
    return rewards.score_search(rollouts)


def _all_turns(rollout: "RolloutConfig") -> int:
    return rollout.max_new_tokens * rollout.max_turns


def _parse_search_record(record: JsonRecord, where: str) -> Task:
    return Task(
        task_id=record_text(record, "id", where), kind="search", query=record_text(record, "question", where),
        gold_doc_ids=record_strings(record, "gold_doc_ids", where, required=False),
        answers=record_strings(record, "answers", where, required=True), context=record_context(record, where),
    )


def _parse_hotpotqa_record(record: JsonRecord, where: str) -> Task:
    task_id = record_text(record, "question_id", where)
    question = record_text(record, "question_text", where)
    answer_objects = record.get("answers_objects")
    if not isinstance(answer_objects, list) or not answer_objects or not isinstance(answer_objects[0], dict):
        raise InvalidArgument(f"{where}: answers_objects", f"must be a non-empty list of objects, got {answer_objects!r}")
    answers = record_strings(answer_objects[0], "spans", f"{where}: answers_objects[0]", required=True)
    contexts = record.get("contexts")
    if not isinstance(contexts, list):
        raise InvalidArgument(f"{where}: contexts", f"must be a list of paragraphs, got {contexts!r}")
    gold: list[str] = []
    for i, paragraph in enumerate(contexts):
        if not isinstance(paragraph, dict) or not isinstance(paragraph.get("title"), str):
            raise InvalidArgument(f"{where}: contexts[{i}]", "must be an object with a string 'title'")
        if paragraph.get("is_supporting") is True:
            gold.append(paragraph["title"])
    return Task(task_id=task_id, kind="search", query=question, gold_doc_ids=tuple(dict.fromkeys(gold)),
                answers=answers)


def _search_record(task: Task) -> dict[str, object]:
    record: dict[str, object] = {"id": task.task_id, "question": task.query, "answers": list(task.answers),
                                 "gold_doc_ids": list(task.gold_doc_ids)}
    return _with_context(record, task)


SEARCH = register_task_kind(TaskKind(
    name="search", builtin_template=SEARCH_TEMPLATE, rollout=_rollout_search, score=_score_search,
    evaluate=lazy("calibrl.trainer.eval", "evaluate_search"),
    metric_names=("em", "f1", "answered", "well_formed", "searches", "gold_doc_recall"),
    max_completion_tokens=_all_turns,
    formats=(RecordFormat("search", "question", _parse_search_record),
             RecordFormat("hotpotqa", "question_text", _parse_hotpotqa_record)),
    required={"answers": "a search task needs at least one gold answer"},
    write_record=_search_record,
    multi_step=True,
    sample_items=lazy("calibrl.sme.eval_items", "search_items"),
))

__all__ = ["REWRITE", "SEARCH"]
