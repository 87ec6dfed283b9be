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
