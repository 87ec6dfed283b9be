"""The query rewriters compared task by task, with paired, clustered intervals.

A rewriter's held-out score is the share of tasks whose greedy rewrite retrieves a
gold passage in the top k. Each arm's rewrite of each held-out task is scored
(:func:`greedy_rewrite_hits`, decoded exactly as :func:`calibrl.trainer.kinds.rewrite.evaluate_rewrites`
decodes), so that two arms can be compared on the same tasks.

Held-out rewrite tasks come in clusters: several tasks ask about one (product, topic)
pair (the same fund's expense ratio, phrased differently), and a rewriter that learned
the pair gets all of them. Every comparison resamples whole (product, topic) clusters
(:func:`calibrl.stats.paired_difference` with ``clusters``), and its wording follows its
interval (:func:`calibrl.stats.describe_difference`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

from calibrl.json_types import JsonObject
from calibrl.stats import describe_difference, paired_difference

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.task_kinds import RunAsync
    from calibrl.trainer.tasks import Task

# (a, b): every comparison the rewriter section makes, a - b, in held-out hit@k.
REWRITE_COMPARISONS = (
    ("base", "raw"),
    ("binary", "base"),
    ("binary_ds", "base"),
    ("dense", "base"),
    ("binary_ds", "binary"),
    ("dense", "binary"),
    ("dense", "binary_ds"),
)


def greedy_rewrite_hits(model: str | None, tasks: Sequence["Task"], retrieval: "RetrievalClient",
                        settings: "EvalSettings", run_async: "RunAsync") -> list[float]:
    """Per task, 1.0 when the greedy rewrite of the model folder (or checkpoint) ``model``
    retrieves a gold passage in the top ``settings.top_k``, else 0.0; ``model=None`` sends each
    task's query unchanged (the raw-query baseline). An empty rewrite retrieves nothing."""
    rewrites = [t.query for t in tasks] if model is None else _greedy_rewrites(model, tasks, settings)
    return _hits(rewrites, tasks, retrieval, settings, run_async)


def _greedy_rewrites(model: str, tasks: Sequence["Task"], settings: "EvalSettings") -> list[str]:
    import gc

    from calibrl.trainer.engines import make_engine
    from calibrl.trainer.eval import resolve_model_path
    from calibrl.trainer.policy import load_policy
    from calibrl.trainer.kinds.rewrite import rollout_rewrites

    policy = load_policy(str(resolve_model_path(model)), device=settings.device, dtype="auto")
    policy.model.eval()
    rewrites: list[str] = []
    try:
        engine = make_engine("transformers", policy)
        for start in range(0, len(tasks), settings.batch_size):
            batch = rollout_rewrites(engine, policy.tokenizer, tasks[start : start + settings.batch_size],
                                     group_size=1, max_new_tokens=settings.max_new_tokens, temperature=0.0)
            rewrites.extend(r.rewrite for r in batch.rollouts)
    finally:
        del policy
        gc.collect()
    return rewrites


def _hits(rewrites: Sequence[str], tasks: Sequence["Task"], retrieval: "RetrievalClient", settings: "EvalSettings",
          run_async: "RunAsync") -> list[float]:
    from calibrl.trainer.kinds.rewrite import query_scores

    return [0.0 if score is None else float(score.hit)
            for score in query_scores(rewrites, tasks, retrieval, settings, run_async)]


def rewrite_comparisons(hits: dict[str, Sequence[float]], clusters: Sequence[Hashable], *, resamples: int = 10_000,
                        seed: int = 0) -> list[JsonObject]:
    """Every comparison of :data:`REWRITE_COMPARISONS` whose two arms have per-task hits:
    the paired difference of held-out hit@k with its interval, resampling ``clusters``."""
    out = []
    for a, b in REWRITE_COMPARISONS:
        if a in hits and b in hits:
            diff = paired_difference(hits[a], hits[b], clusters=clusters, resamples=resamples, seed=seed)
            out.append({"a": a, "b": b, "metric": "hit", **diff.as_dict()})
    return out


def rewrite_results(hits: dict[str, Sequence[float]], clusters: Sequence[Hashable], **options: int) -> JsonObject:
    """What results.json keeps of the task-by-task comparison."""
    return {"tasks": len(clusters), "clusters": len(set(clusters)),
            "resamples": options.get("resamples", 10_000),
            "comparisons": rewrite_comparisons(hits, clusters, **options)}


def rewrite_comparison_lines(results: JsonObject, labels: dict[str, str], k: int) -> list[str]:
    """One sentence per comparison, its wording following its interval."""
    return [describe_difference(labels.get(c["a"], c["a"]), labels.get(c["b"], c["b"]), c, f"points of hit@{k}")
            for c in results["comparisons"]]


__all__ = ["REWRITE_COMPARISONS", "greedy_rewrite_hits", "rewrite_comparison_lines", "rewrite_comparisons",
           "rewrite_results"]
