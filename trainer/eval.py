"""Held-out evaluation of a policy, a checkpoint or an untrained base, greedy decoding.

- Query rewriter: one greedy rewrite per task, scored through the retrieval
  client at cut-off k: ``hit@k`` (any gold passage retrieved), ``all_gold@k``,
  ``recall@k``, ``mrr``, ``ndcg@k``; plus ``empty_rewrite_rate``. The optional
  raw-query baseline sends each task's query unchanged (no model).
- Search agent: one greedy Search-R1 trajectory per task: answer ``em`` and
  ``f1`` (normalised, as in the reward), ``answered`` (an ``<answer>`` was given),
  ``well_formed``, ``searches`` per trajectory and ``gold_doc_recall`` (share of
  a task's gold passages retrieved by any of its searches; tasks with gold ids).

Several models are evaluated on the same tasks so the rows compare side by side
(:func:`format_table`, and JSON through ``calibrl eval --out``).
"""

from __future__ import annotations

import gc
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from calibrl.errors import ConfigError, InvalidArgument

REWRITE_METRICS = ("hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k", "empty_rewrite_rate")
SEARCH_METRICS = ("em", "f1", "answered", "well_formed", "searches", "gold_doc_recall")


@dataclass
class EvalSettings:
    """How a model is decoded and scored (the same for every model of a comparison)."""

    top_k: int = 5  # cut-off k of the retrieval metrics
    mode: str | None = None  # retrieval mode (None = the server's default)
    max_new_tokens: int = 48  # per rewrite, or per search turn
    max_turns: int = 4  # search agent
    search_top_k: int = 3  # documents per <search>
    max_obs_tokens: int = 256  # retrieved tokens per observation
    batch_size: int = 32  # tasks generated together
    device: str = "auto"
    max_query_chars: int = 512  # rewrites are cut to this before they are sent

    def __post_init__(self) -> None:
        for name in ("top_k", "max_new_tokens", "max_turns", "search_top_k", "max_obs_tokens", "batch_size",
                     "max_query_chars"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    """One row of the comparison."""

    name: str
    model: str  # the folder the weights came from ("" for the raw-query baseline)
    kind: str  # rewrite | search
    num_tasks: int
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- inputs


def resolve_model_path(path: str | pathlib.Path) -> pathlib.Path:
    """A loadable model folder for ``path``: a checkpoint's ``model/``, a run dir's
    latest checkpoint's ``model/``, or ``path`` itself (a model or adapter folder)."""
    from trainer.checkpoint import MODEL_DIR, STATE_FILE, find_checkpoint

    path = pathlib.Path(path)
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return path
    if (path / STATE_FILE).exists() or (path / "checkpoints").is_dir():
        return find_checkpoint(path) / MODEL_DIR
    raise ConfigError(
        f"--model {path}: not a model folder (config.json / adapter_config.json), a checkpoint or a run dir"
    )


def load_eval_tasks(path: str, *, fmt: str = "auto", kind: str = "auto", heldout_fraction: float = 0.0,
                    seed: int = 0, limit: int = 0) -> list[Any]:
    """Tasks to evaluate: the file's tasks, or the held-out part of the split
    training made with the same ``heldout_fraction`` and ``seed``."""
    from trainer.tasks import load_tasks, split_tasks

    tasks = load_tasks(path, kind=None if kind == "auto" else kind, fmt=fmt)
    if heldout_fraction > 0:
        _, tasks = split_tasks(tasks, heldout_fraction, seed)
    if limit:
        tasks = tasks[:limit]
    kinds = {t.kind for t in tasks}
    if len(kinds) != 1:
        raise ConfigError(f"{path}: mixes task kinds {sorted(kinds)}; evaluate one agent at a time")
    return tasks


# --------------------------------------------------------------------------- evaluation


RunAsync = Callable[[Any], Any]


def evaluate_models(
    models: Sequence[str],
    tasks: Sequence[Any],
    retrieval: Any,
    settings: EvalSettings,
    *,
    run_async: RunAsync,
    names: Sequence[str] | None = None,
    raw_query_baseline: bool = False,
) -> list[EvalResult]:
    """One :class:`EvalResult` per model (loaded one at a time), same tasks and settings."""
    from trainer.policy import load_policy

    kind = tasks[0].kind
    rows: list[EvalResult] = []
    if raw_query_baseline:
        if kind != "rewrite":
            raise ConfigError("the raw-query baseline applies to rewrite tasks only")
        queries = [t.query for t in tasks]
        metrics = _retrieval_metrics(queries, tasks, retrieval, settings, run_async)
        rows.append(EvalResult("raw query", "", kind, len(tasks), metrics))
    for i, model in enumerate(models):
        folder = resolve_model_path(model)
        policy = load_policy(str(folder), device=settings.device, dtype="auto")
        policy.model.eval()
        try:
            metrics = evaluate_policy(policy, tasks, retrieval, settings, run_async=run_async)
        finally:
            del policy
            gc.collect()
        rows.append(EvalResult(names[i] if names else str(model), str(folder), kind, len(tasks), metrics))
    return rows


def evaluate_policy(policy: Any, tasks: Sequence[Any], retrieval: Any, settings: EvalSettings, *,
                    run_async: RunAsync) -> dict[str, float]:
    """Greedy metrics of one loaded :class:`~trainer.policy.Policy` on ``tasks``."""
    from trainer.engines import make_engine

    engine = make_engine("transformers", policy)
    if tasks[0].kind == "search":
        return _evaluate_search(engine, policy.tokenizer, tasks, retrieval, settings, run_async)
    return _evaluate_rewrites(engine, policy.tokenizer, tasks, retrieval, settings, run_async)


def _evaluate_rewrites(engine: Any, tokenizer: Any, tasks: Sequence[Any], retrieval: Any, settings: EvalSettings,
                       run_async: RunAsync) -> dict[str, float]:
    from trainer.rollout import rollout_rewrites

    rewrites: list[str] = []
    for start in range(0, len(tasks), settings.batch_size):
        batch = rollout_rewrites(engine, tokenizer, tasks[start : start + settings.batch_size], group_size=1,
                                 max_new_tokens=settings.max_new_tokens, temperature=0.0)
        rewrites.extend(r.rewrite for r in batch.rollouts)
    return _retrieval_metrics(rewrites, tasks, retrieval, settings, run_async)


def _retrieval_metrics(queries: Sequence[str], tasks: Sequence[Any], retrieval: Any, settings: EvalSettings,
                       run_async: RunAsync) -> dict[str, float]:
    """Mean retrieval metrics of one query per task; an empty query retrieves nothing
    (it scores 0 everywhere rather than being sent)."""
    from retrieval_server.types import ScoreItem, SearchMode

    cleaned = [q.strip()[: settings.max_query_chars].strip() for q in queries]
    sent = [i for i, q in enumerate(cleaned) if q]
    items = [ScoreItem(query=cleaned[i], gold_doc_ids=tuple(tasks[i].gold_doc_ids),
                       gold_answers=tuple(tasks[i].answers)) for i in sent]
    mode = SearchMode(settings.mode) if settings.mode else None
    scores = run_async(retrieval.score(items, settings.top_k, mode)) if items else []
    totals = dict.fromkeys(("hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k"), 0.0)
    for score in scores:
        totals["hit@k"] += float(score.hit)
        totals["all_gold@k"] += float(score.all_gold)
        totals["recall@k"] += score.recall
        totals["mrr"] += score.mrr
        totals["ndcg@k"] += score.ndcg
    count = len(queries)
    metrics = {name: value / count for name, value in totals.items()}
    metrics["empty_rewrite_rate"] = (count - len(sent)) / count
    return metrics


def _evaluate_search(engine: Any, tokenizer: Any, tasks: Sequence[Any], retrieval: Any, settings: EvalSettings,
                     run_async: RunAsync) -> dict[str, float]:
    from calibrl.text import exact_match, token_f1
    from trainer.rollout import rollout_search

    totals = dict.fromkeys(SEARCH_METRICS, 0.0)
    with_gold = 0
    for start in range(0, len(tasks), settings.batch_size):
        batch = rollout_search(
            engine, tokenizer, tasks[start : start + settings.batch_size], group_size=1, retrieval=retrieval,
            run_async=run_async, max_turns=settings.max_turns, top_k=settings.search_top_k,
            max_new_tokens_per_turn=settings.max_new_tokens, max_obs_tokens=settings.max_obs_tokens,
            temperature=0.0,
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


# --------------------------------------------------------------------------- output


def format_table(rows: Sequence[EvalResult]) -> str:
    """The results as an aligned text table, one row per model."""
    if not rows:
        return "(no results)"
    names = REWRITE_METRICS if rows[0].kind == "rewrite" else SEARCH_METRICS
    header = ["model", "tasks", *names]
    body = [[row.name, str(row.num_tasks), *(f"{row.metrics.get(n, float('nan')):.3f}" for n in names)]
            for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def render(line: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))

    return "\n".join([render(header), "  ".join("-" * w for w in widths), *(render(line) for line in body)])
