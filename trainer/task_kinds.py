"""Task kinds: what an agent is trained to do, registered by name like the advantage estimators.

A :class:`TaskKind` bundles everything that differs between agents:

- ``builtin_template``: the prompt template used when ``rollout.prompt_template`` is empty;
- ``rollout``: G sampled rollouts per task as a :class:`~calibrl.trainer.rollout.RolloutBatch`
  (:class:`RolloutSettings` carries the sampling options);
- ``score``: the reward coroutine of a batch's rollouts (a method of
  :class:`~calibrl.trainer.rewards.RewardModel`);
- ``evaluate``: greedy held-out metrics of a policy (``calibrl.trainer.eval``);
- ``metric_names``: the columns of the evaluation table, in order;
- ``max_completion_tokens``: the most tokens one rollout can generate (the Dr. GRPO
  constant of ``loss.aggregation=constant``).

Two kinds are built in: ``rewrite`` (a one-step query rewriter) and ``search`` (a
multi-step Search-R1 agent). A third kind is one more :func:`register_task_kind`
call; nothing else branches on the kind's name. The heavy modules (torch, the
rollout and evaluation code) are imported only when a kind's functions run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence

from calibrl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import RolloutConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.rewards import RewardBreakdown, RewardModel
    from calibrl.trainer.rollout import RolloutBatch
    from calibrl.trainer.tasks import Task

RunAsync = Callable[[Coroutine[Any, Any, Any]], Any]


@dataclass(frozen=True)
class RolloutSettings:
    """How one call samples rollouts: the training loop fills it from ``rollout.*``,
    the evaluation from its :class:`~calibrl.trainer.eval.EvalSettings` (greedy, one per task)."""

    group_size: int  # rollouts per task
    max_new_tokens: int  # per rewrite, or per search turn
    temperature: float
    top_p: float
    prompt_template: str  # the template text (already resolved; never empty)
    chat_template: bool | None  # None = use the tokenizer's chat template when it has one
    seed: int | None = None
    max_turns: int = 4  # search: generated turns, the answer turn included
    search_top_k: int = 3  # search: documents per <search>
    max_obs_tokens: int = 256  # search: retrieved tokens per observation


RolloutFn = Callable[["GenerationEngine", "PreTrainedTokenizerBase", Sequence["Task"], RolloutSettings,
                     "RetrievalClient", RunAsync], "RolloutBatch"]
ScoreFn = Callable[["RewardModel", Sequence[Any]], Coroutine[Any, Any, "list[RewardBreakdown]"]]
EvaluateFn = Callable[["GenerationEngine", "PreTrainedTokenizerBase", Sequence["Task"], "RetrievalClient",
                       "EvalSettings", RunAsync, str, "bool | None"], "dict[str, float]"]


@dataclass(frozen=True)
class TaskKind:
    """One registered kind of agent (see the module docstring for each field's role)."""

    name: str
    builtin_template: str
    rollout: RolloutFn  # (engine, tokenizer, tasks, settings, retrieval, run_async) -> RolloutBatch
    score: ScoreFn  # (reward_model, rollouts) -> coroutine of one RewardBreakdown per rollout
    evaluate: EvaluateFn  # (engine, tokenizer, tasks, retrieval, settings, run_async, template, chat) -> metrics
    metric_names: tuple[str, ...]
    max_completion_tokens: Callable[["RolloutConfig"], int]


TASK_KINDS: dict[str, TaskKind] = {}


def register_task_kind(kind: TaskKind) -> TaskKind:
    """Add ``kind`` to the registry (a second kind of the same name is an error)."""
    if kind.name in TASK_KINDS and TASK_KINDS[kind.name] is not kind:
        raise ConfigError(f"task kind {kind.name!r} is already registered")
    TASK_KINDS[kind.name] = kind
    return kind


def task_kind(name: str) -> TaskKind:
    """The registered kind ``name``; ConfigError naming the known ones otherwise."""
    try:
        return TASK_KINDS[name]
    except KeyError:
        raise ConfigError(f"task kind {name!r}: expected one of {sorted(TASK_KINDS)}") from None


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported on first call (keeps torch out of ``--help``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


# --------------------------------------------------------------------------- rewrite: a one-step query rewriter


def _rollout_rewrites(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                      settings: RolloutSettings,
                      retrieval: "RetrievalClient", run_async: RunAsync) -> "RolloutBatch":
    from calibrl.trainer.rollout import rollout_rewrites

    return rollout_rewrites(
        engine, tokenizer, tasks, group_size=settings.group_size, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
        prompt_template=settings.prompt_template, chat_template=settings.chat_template,
    )


def _score_rewrites(rewards: "RewardModel", rollouts: Sequence[Any]) -> Coroutine[Any, Any, "list[RewardBreakdown]"]:
    return rewards.score_rewrites(rollouts)


def _one_turn(rollout: "RolloutConfig") -> int:
    return rollout.max_new_tokens


# --------------------------------------------------------------------------- search: a multi-step Search-R1 agent


def _rollout_search(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                    settings: RolloutSettings,
                    retrieval: "RetrievalClient", run_async: RunAsync) -> "RolloutBatch":
    from calibrl.trainer.rollout import rollout_search

    return rollout_search(
        engine, tokenizer, tasks, group_size=settings.group_size, retrieval=retrieval, run_async=run_async,
        max_turns=settings.max_turns, top_k=settings.search_top_k, max_new_tokens_per_turn=settings.max_new_tokens,
        max_obs_tokens=settings.max_obs_tokens, temperature=settings.temperature, top_p=settings.top_p,
        seed=settings.seed, prompt_template=settings.prompt_template, chat_template=settings.chat_template,
    )


def _score_search(rewards: "RewardModel", rollouts: Sequence[Any]) -> Coroutine[Any, Any, "list[RewardBreakdown]"]:
    return rewards.score_search(rollouts)


def _all_turns(rollout: "RolloutConfig") -> int:
    return rollout.max_new_tokens * rollout.max_turns


def _register_builtin_kinds() -> None:
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, SEARCH_TEMPLATE

    register_task_kind(TaskKind(
        name="rewrite", builtin_template=REWRITE_TEMPLATE, rollout=_rollout_rewrites, score=_score_rewrites,
        evaluate=_lazy("calibrl.trainer.eval", "evaluate_rewrites"),
        metric_names=("hit@k", "all_gold@k", "recall@k", "mrr", "ndcg@k", "empty_rewrite_rate"),
        max_completion_tokens=_one_turn,
    ))
    register_task_kind(TaskKind(
        name="search", builtin_template=SEARCH_TEMPLATE, rollout=_rollout_search, score=_score_search,
        evaluate=_lazy("calibrl.trainer.eval", "evaluate_search"),
        metric_names=("em", "f1", "answered", "well_formed", "searches", "gold_doc_recall"),
        max_completion_tokens=_all_turns,
    ))


_register_builtin_kinds()

__all__ = ["TASK_KINDS", "RolloutSettings", "TaskKind", "register_task_kind", "task_kind"]
