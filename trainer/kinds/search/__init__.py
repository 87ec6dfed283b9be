"""The ``search`` task kind: a multi-step Search-R1 agent.

Everything the kind is lives in this package: its records (:mod:`.records`), its rollout
(:mod:`.rollout`; prompt and grammar in :mod:`calibrl.trainer.search_format`), its reward
(:mod:`.reward`, with the per-step dense rewards of :mod:`.step_rewards`), its held-out metrics,
SME items and step metrics (:mod:`.metrics`), and its task records: ``{"id", "question",
"answers", ["gold_doc_ids"], ["context"]}``, or the IRCoT-formatted HotpotQA dev set
(``question_id``, ``question_text``, ``answers_objects[0].spans``, ``contexts`` whose supporting
paragraphs' titles are the gold document ids); a task needs a gold answer. :data:`SEARCH`
registers it. Its rollouts are multi-step records (``TaskKind.multi_step``), what CalibAdv and
``advantage.step_credit`` need.

A record of this format can be trained as another kind (``tasks.kind``): a search record
becomes a rewrite task whose retrieval targets are its gold passages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from calibrl.errors import InvalidArgument
from calibrl.trainer.kinds.search.metrics import METRIC_NAMES, evaluate_search, search_items, search_step_metrics
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.kinds.search.reward import score_search
from calibrl.trainer.kinds.search.rollout import rollout_search
from calibrl.trainer.rollout import RolloutBatch
from calibrl.trainer.search_format import SEARCH_TEMPLATE
from calibrl.trainer.task_kinds import JsonRecord, RecordFormat, RolloutSettings, RunAsync, TaskKind, register_task_kind
from calibrl.trainer.tasks import Task, record_context, record_strings, record_text, with_context

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import RolloutConfig
    from calibrl.trainer.engines import GenerationEngine


def _rollout(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence[Task],
                    settings: RolloutSettings, retrieval: "RetrievalClient", run_async: RunAsync) -> RolloutBatch:
    return rollout_search(
        engine, tokenizer, tasks, group_size=settings.group_size, retrieval=retrieval, run_async=run_async,
        max_turns=settings.max_turns, top_k=settings.search_top_k, max_new_tokens_per_turn=settings.max_new_tokens,
        max_obs_tokens=settings.max_obs_tokens, temperature=settings.temperature, top_p=settings.top_p,
        seed=settings.seed, prompt_template=settings.prompt_template, chat_template=settings.chat_template,
    )


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
    return with_context(record, task)


SEARCH = register_task_kind(TaskKind(
    name="search", builtin_template=SEARCH_TEMPLATE, rollout=_rollout, score=score_search,
    evaluate=evaluate_search,
    metric_names=METRIC_NAMES,
    max_completion_tokens=_all_turns,
    formats=(RecordFormat("search", "question", _parse_search_record),
             RecordFormat("hotpotqa", "question_text", _parse_hotpotqa_record)),
    required={"answers": "a search task needs at least one gold answer"},
    write_record=_search_record,
    multi_step=True,
    sample_items=search_items,
    step_metrics=search_step_metrics,
    reward_weights=lambda reward: reward.search_weights(),
))

__all__ = ["SEARCH", "SearchRollout", "SearchStepRecord", "rollout_search", "score_search"]
