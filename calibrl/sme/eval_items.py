"""``calibrl eval --sme-items FILE``: each model's greedy outputs on the eval tasks, in the
sample-input format (:mod:`calibrl.sme.items`), ready for ``calibrl sme sample``.

One item per (model, task), id ``<model name>:<task id>``:

- rewrite tasks: the query, the greedy rewrite, the top-k documents it retrieves (ids
  and texts), the gold ids, and the signals ``hit``, ``recall``, ``mrr``, ``ndcg`` at
  the eval's cut-off k;
- search tasks: the question, the trajectory as text (``search: ... | answer: ...``),
  every document its searches retrieved (first occurrence, in order), the gold ids,
  and the signals ``hit`` (a gold document was retrieved; tasks with gold ids),
  ``em``, ``f1`` and ``well_formed``.

The outputs are generated again here with the same prompts and greedy decoding as
:func:`calibrl.trainer.eval.evaluate_policy` (so running it doubles the generation time of
``calibrl eval``); an empty rewrite has nothing to grade and is left out, counted in
the returned summary.
"""

from __future__ import annotations

import gc
import pathlib
from typing import Any, Sequence

from calibrl.sme.items import SampleItem, write_items


def eval_items(models: Sequence[str], tasks: Sequence[Any], retrieval: Any, settings: Any, *, run_async: Any,
               names: Sequence[str] | None = None, prompt_template: str | None = None,
               chat_template: str | None = None) -> tuple[list[SampleItem], int]:
    """(items, empty outputs left out) for every model on ``tasks``."""
    from calibrl.errors import ConfigError
    from calibrl.trainer.engines import make_engine
    from calibrl.trainer.eval import choose_prompt, resolve_model_path
    from calibrl.trainer.policy import load_policy
    from calibrl.trainer.task_kinds import task_kind

    kind = tasks[0].kind
    sample_items = task_kind(kind).sample_items
    if sample_items is None:
        raise ConfigError(f"--sme-items: task kind {kind!r} does not write SME sample items")
    items: list[SampleItem] = []
    empty = 0
    for i, model in enumerate(models):
        name = names[i] if names else pathlib.Path(str(model)).name
        prompt = choose_prompt(model, kind, prompt_template=prompt_template, chat_template=chat_template)
        rollout_config = prompt.rollout_config()
        template, chat = rollout_config.template_for(kind), rollout_config.chat_template_flag()
        policy = load_policy(str(resolve_model_path(model)), device=settings.device, dtype="auto")
        policy.model.eval()
        try:
            engine = make_engine("transformers", policy)
            new, skipped = sample_items(engine, policy.tokenizer, tasks, retrieval, settings, run_async, template,
                                        chat, name)
            items += new
            empty += skipped
        finally:
            del policy
            gc.collect()
    return items, empty


def write_eval_items(path: str | pathlib.Path, *args: Any, **kwargs: Any) -> str:
    """Write :func:`eval_items` to ``path``; returns a one-line summary for the console."""
    items, empty = eval_items(*args, **kwargs)
    write_items(path, items)
    return f"wrote {len(items)} items for calibrl sme sample to {path}" + (
        f" ({empty} empty outputs left out)" if empty else "")


def rewrite_items(engine: Any, tokenizer: Any, tasks: Sequence[Any], retrieval: Any, settings: Any, run_async: Any,
                  template: str, chat: bool | None, name: str) -> tuple[list[SampleItem], int]:
    """The ``rewrite`` kind's items (its ``TaskKind.sample_items``) and the empty rewrites left out."""
    from calibrl.api.retrieval import ScoreItem, SearchMode
    from calibrl.trainer.rollout import rollout_rewrites

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


def search_items(engine: Any, tokenizer: Any, tasks: Sequence[Any], retrieval: Any, settings: Any, run_async: Any,
                 template: str, chat: bool | None, name: str) -> tuple[list[SampleItem], int]:
    """The ``search`` kind's items (its ``TaskKind.sample_items``); none is left out."""
    from calibrl.text import exact_match, token_f1
    from calibrl.trainer.rollout import rollout_search

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
