"""The ``rewrite`` task kind: a one-step query rewriter.

Everything the kind is lives here: its record (:class:`RewriteRollout`), its prompt
(``REWRITE_TEMPLATE`` of :mod:`calibrl.trainer.search_format`), its rollout
(:func:`rollout_rewrites`), its reward (:func:`score_rewrites`, the formula in
:mod:`calibrl.trainer.rewards`), its held-out metrics (:func:`evaluate_rewrites`,
:func:`raw_query_metrics`), its ``calibrl sme sample`` items (:func:`rewrite_items`) and its
task records ``{"id", "query", "gold_doc_ids", ["answers"], ["context"]}``; a task needs a gold
document id (its retrieval target). :data:`REWRITE` registers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api.retrieval import RetrievalScore, ScoreItem, SearchMode
from calibrl.trainer.aio import gather_all
from calibrl.trainer.rewards import RewardBreakdown, RewardModel, judge_item, weighted_total
from calibrl.trainer.rollout import (
    RolloutBatch,
    assemble_rows,
    check_rollout_args,
    checked_completions,
    decode_completion,
    encode_prompt,
    group_index,
)
from calibrl.trainer.policy import pad_token_id
from calibrl.trainer.search_format import REWRITE_STOP_STRINGS, REWRITE_TEMPLATE, fill_template
from calibrl.trainer.task_kinds import JsonRecord, RolloutSettings, RunAsync, TaskKind, RecordFormat, register_task_kind
from calibrl.trainer.tasks import Task, record_context, record_strings, record_text, with_context

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.sme.items import SampleItem

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import RolloutConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.eval import EvalSettings


@dataclass(frozen=True)
class RewriteRollout:
    """One sampled rewrite of ``task``'s query."""

    task: Task
    rewrite: str


# --------------------------------------------------------------------------- rollout


def parse_rewrite(text: str) -> str:
    """The rewrite in a completion: its first line, stripped."""
    return text.split("\n", 1)[0].strip()


def rollout_rewrites(
    engine: "GenerationEngine",
    tokenizer: "PreTrainedTokenizerBase",
    tasks: Sequence["Task"],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    prompt_template: str = REWRITE_TEMPLATE,
    seed: int | None = None,
    stop_strings: Sequence[str] = REWRITE_STOP_STRINGS,
    chat_template: bool | None = None,
) -> RolloutBatch:
    """``group_size`` one-step rewrites per task. The rewrite is the first line of
    the completion (it may be empty: the reward scores that, it is not an error)."""
    check_rollout_args(tasks, "rewrite", group_size, temperature, top_p, caller="rollout_rewrites")
    prompts = [
        encode_prompt(tokenizer, fill_template(prompt_template, task.query, task.context), chat_template=chat_template)
        for task in tasks
    ]
    requests = [prompt for prompt in prompts for _ in range(group_size)]
    completions = checked_completions(
        engine.generate(
            requests,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_strings=tuple(stop_strings),
            seed=seed,
        ),
        len(requests),
    )
    rows, texts, rollouts = [], [], []
    for row, (prompt, completion) in enumerate(zip(requests, completions)):
        task = tasks[row // group_size]
        text = decode_completion(tokenizer, completion)
        rows.append([(prompt, False), (completion, True)])
        texts.append(text)
        rollouts.append(RewriteRollout(task=task, rewrite=parse_rewrite(text)))
    tensors = assemble_rows(rows, pad_token_id(tokenizer))
    return RolloutBatch(
        **tensors,
        group_index=group_index(len(tasks), group_size),
        completion_texts=texts,
        rollouts=rollouts,
        prompt_lengths=[len(p) for p in requests],
    )


# --------------------------------------------------------------------------- reward


async def score_rewrites(rewards: RewardModel, rollouts: Sequence[RewriteRollout]) -> list[RewardBreakdown]:
    """Rewards of a batch of rewrites: one retrieval call and one judge call for the whole batch."""
    if not rollouts:
        return []
    return await rewards.with_retries(lambda: _score_rewrites_once(rewards, rollouts), f"{len(rollouts)} rewrites")


async def _score_rewrites_once(rewards: RewardModel, rollouts: Sequence[RewriteRollout]) -> list[RewardBreakdown]:
    cfg = rewards.config
    queries = [rewards.output_text(r.rewrite) for r in rollouts]
    scorable = [i for i, q in enumerate(queries) if q]
    items = [ScoreItem(query=queries[i], gold_doc_ids=rollouts[i].task.gold_doc_ids,
                       gold_answers=rollouts[i].task.answers) for i in scorable]
    use_rubric = cfg.uses_rubric_for_rewrites and bool(scorable)
    include_text = use_rubric and cfg.rubric_sees_retrieval

    retrieval_scores: list[RetrievalScore] = []
    rubric_scores: list[ItemScore] = []
    if items and use_rubric and cfg.rubric_sees_retrieval:
        retrieval_scores = await rewards.retrieve(items, include_text)
        judge_items = [_rewrite_judge_item(rollouts[i], queries[i], retrieval_scores[n])
                       for n, i in enumerate(scorable)]
        rubric_scores = await rewards.judge_items(judge_items)
    elif items and use_rubric:
        judge_items = [_rewrite_judge_item(rollouts[i], queries[i], None) for i in scorable]
        retrieval_scores, rubric_scores = await gather_all(
            rewards.retrieve(items, include_text), rewards.judge_items(judge_items)
        )
    elif items:
        retrieval_scores = await rewards.retrieve(items, include_text)

    weights = cfg.rewrite_weights()
    by_index = {i: n for n, i in enumerate(scorable)}
    results = []
    for i in range(len(rollouts)):
        n = by_index.get(i)
        retrieval = retrieval_scores[n] if n is not None else None
        rubric = rubric_scores[n] if (n is not None and rubric_scores) else None
        components = {"retrieval": rewards.signal(retrieval, cfg.binary_only) if retrieval is not None else 0.0}
        if "rubric" in weights:
            components["rubric"] = rubric.total if rubric else 0.0
        results.append(RewardBreakdown(weighted_total(components, weights), components, retrieval, rubric))
    return results


def _rewrite_judge_item(rollout: RewriteRollout, output: str, retrieved: RetrievalScore | None) -> JudgeItem:
    passages = {h.doc_id: h.text for h in retrieved.hits} if retrieved is not None else {}
    return judge_item(rollout.task, output, passages)


# --------------------------------------------------------------------------- held-out metrics and SME items


def evaluate_rewrites(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                      retrieval: "RetrievalClient", settings: "EvalSettings", run_async: RunAsync, template: str,
                      chat_template: bool | None) -> dict[str, float]:
    rewrites: list[str] = []
    for start in range(0, len(tasks), settings.batch_size):
        batch = rollout_rewrites(engine, tokenizer, tasks[start : start + settings.batch_size], group_size=1,
                                 max_new_tokens=settings.max_new_tokens, temperature=0.0,
                                 prompt_template=template, chat_template=chat_template)
        rewrites.extend(r.rewrite for r in batch.rollouts)
    return _retrieval_metrics(rewrites, tasks, retrieval, settings, run_async)


def raw_query_metrics(tasks: Sequence["Task"], retrieval: "RetrievalClient", settings: "EvalSettings",
                      run_async: RunAsync) -> dict[str, float]:
    """The rewrite metrics of each task's query sent unchanged (no model): the raw-query baseline."""
    return _retrieval_metrics([t.query for t in tasks], tasks, retrieval, settings, run_async)


def query_scores(queries: Sequence[str], tasks: Sequence["Task"], retrieval: "RetrievalClient",
                 settings: "EvalSettings", run_async: RunAsync) -> list:
    """The retrieval service's score of each task's query (a ``ScoreResult``), None where the
    query is empty once trimmed to ``settings.max_query_chars`` (it is not sent: an empty
    query retrieves nothing)."""
    cleaned = [q.strip()[: settings.max_query_chars].strip() for q in queries]
    sent = [i for i, q in enumerate(cleaned) if q]
    items = [ScoreItem(query=cleaned[i], gold_doc_ids=tuple(tasks[i].gold_doc_ids),
                       gold_answers=tuple(tasks[i].answers)) for i in sent]
    mode = SearchMode(settings.mode) if settings.mode else None
    scores = run_async(retrieval.score(items, settings.top_k, mode)) if items else []
    out: list = [None] * len(queries)
    for i, score in zip(sent, scores):
        out[i] = score
    return out


def _retrieval_metrics(queries: Sequence[str], tasks: Sequence["Task"], retrieval: "RetrievalClient",
                       settings: "EvalSettings", run_async: RunAsync) -> dict[str, float]:
    """Mean retrieval metrics of one query per task; an empty query retrieves nothing
    (it scores 0 everywhere rather than being sent)."""
    per_task = query_scores(queries, tasks, retrieval, settings, run_async)
    scores = [score for score in per_task if score is not None]
    totals = dict.fromkeys(("hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k"), 0.0)
    for score in scores:
        totals["hit@k"] += float(score.hit)
        totals["all_gold@k"] += float(score.all_gold)
        totals["recall@k"] += score.recall
        totals["mrr"] += score.mrr
        totals["ndcg@k"] += score.ndcg
    count = len(queries)
    metrics = {name: value / count for name, value in totals.items()}
    metrics["empty_rewrite_rate"] = (count - len(scores)) / count
    return metrics


def rewrite_items(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence[Task],
                  retrieval: "RetrievalClient", settings: "EvalSettings", run_async: RunAsync, template: str,
                  chat: bool | None, name: str) -> "tuple[list[SampleItem], int]":
    """The ``rewrite`` kind's items (its ``TaskKind.sample_items``) and the empty rewrites left out."""
    # calibrl.sme.items reads the judge's feedback format: imported only when SME items are written,
    # so the trainer's kinds import no judge code.
    from calibrl.sme.items import SampleItem

    rewrites: list[str] = []
    for start in range(0, len(tasks), settings.batch_size):
        batch = rollout_rewrites(engine, tokenizer, tasks[start : start + settings.batch_size], group_size=1,
                                 max_new_tokens=settings.max_new_tokens, temperature=0.0,
                                 prompt_template=template, chat_template=chat)
        rewrites.extend(r.rewrite for r in batch.rollouts)
    cleaned = [r.strip()[: settings.max_query_chars].strip() for r in rewrites]
    kept = [i for i, text in enumerate(cleaned) if text]
    mode = SearchMode(settings.mode) if settings.mode else None
    score_items = [ScoreItem(query=cleaned[i], gold_doc_ids=tuple(tasks[i].gold_doc_ids),
                             gold_answers=tuple(tasks[i].answers)) for i in kept]
    scores = run_async(retrieval.score(score_items, settings.top_k, mode, include_text=True)) if score_items else []
    items = []
    for i, score in zip(kept, scores):
        task = tasks[i]
        items.append(SampleItem(
            id=f"{name}:{task.task_id}", query=task.query, output=cleaned[i],
            retrieved_doc_ids=tuple(h.doc_id for h in score.hits),
            retrieved_texts=tuple(h.text for h in score.hits) if all(h.text for h in score.hits) else (),
            gold_doc_ids=tuple(task.gold_doc_ids),
            signals=(("hit", float(score.hit)), ("mrr", score.mrr), ("ndcg", score.ndcg), ("recall", score.recall)),
            model=name, context=tuple(task.context),
        ))
    return items, len(tasks) - len(kept)


# --------------------------------------------------------------------------- task records


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
    return with_context(record, task)


def _rollout(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence[Task],
             settings: RolloutSettings, retrieval: "RetrievalClient", run_async: RunAsync) -> RolloutBatch:
    return rollout_rewrites(
        engine, tokenizer, tasks, group_size=settings.group_size, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
        prompt_template=settings.prompt_template, chat_template=settings.chat_template,
    )


def _one_turn(rollout: "RolloutConfig") -> int:
    return rollout.max_new_tokens


REWRITE = register_task_kind(TaskKind(
    name="rewrite", builtin_template=REWRITE_TEMPLATE, rollout=_rollout, score=score_rewrites,
    evaluate=evaluate_rewrites,
    metric_names=("hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k", "empty_rewrite_rate"),
    max_completion_tokens=_one_turn,
    formats=(RecordFormat("rewrite", "query", _parse_rewrite_record),),
    required={"gold_doc_ids": "a rewrite task needs at least one gold document id (its retrieval target)"},
    write_record=_rewrite_record,
    query_baseline=raw_query_metrics,
    sample_items=rewrite_items,
    reward_weights=lambda reward: reward.rewrite_weights(),
))

__all__ = ["REWRITE", "RewriteRollout", "evaluate_rewrites", "parse_rewrite", "query_scores", "raw_query_metrics",
           "rewrite_items", "rollout_rewrites", "score_rewrites"]
