"""Task kinds: what an agent is trained to do, registered by name like the advantage estimators.

A :class:`TaskKind` bundles everything that differs between agents:

- ``builtin_template``: the prompt template used when ``rollout.prompt_template`` is empty;
- ``rollout``: G sampled rollouts per task as a :class:`~calibrl.trainer.rollout.RolloutBatch`
  (:class:`RolloutSettings` carries the sampling options);
- ``score``: the reward coroutine of a batch's rollouts, one
  :class:`~calibrl.trainer.rewards.RewardBreakdown` each;
- ``evaluate``: greedy held-out metrics of a policy (``calibrl eval``);
- ``metric_names``: the columns of the evaluation table, in order;
- ``max_completion_tokens``: the most tokens one rollout can generate (the Dr. GRPO
  constant of ``loss.aggregation=constant``);
- ``formats``: the JSONL record formats its tasks are read from (:class:`RecordFormat`;
  the first is the kind's own, the one ``write_record`` writes);
- ``required``: the task fields that must not be empty, each with the reason shown
  when one is;
- ``write_record``: one task as a record of its own format (``write_tasks``);
- ``multi_step``: rollouts are multi-step trajectories whose search steps can be scored
  (step rewards, ``advantage.step_credit`` and CalibAdv need that);
- ``query_baseline``: the metrics of each task's query sent unchanged, no model
  (``calibrl eval --raw-query-baseline``), or None when the kind has no such row;
- ``sample_items``: each task's greedy output as a ``calibrl sme sample`` item
  (``calibrl eval --sme-items``), or None;
- ``step_metrics``: the kind's own metrics of a training step, from its rollouts and
  their rewards (the search agent's ``search/*`` and ``steps/*``), or None;
- ``reward_weights``: the weight of each reward component under a ``RewardConfig`` (the
  reward is their weighted sum), or None; ``review.on_alarm=downweight`` re-blends with it.

Two kinds are built in, one package each (:mod:`calibrl.trainer.kinds`): ``rewrite`` (a
one-step query rewriter) and ``search`` (a multi-step Search-R1 agent); importing
:mod:`calibrl.trainer` registers them. A third kind is one :func:`register_task_kind`
call in one module; nothing else branches on a kind's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Mapping, Protocol, Sequence, TypeVar

from calibrl.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.handoff import Rollout
    from transformers import PreTrainedTokenizerBase

    from calibrl.sme.items import SampleItem
    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import RolloutConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.eval import EvalSettings
    from calibrl.trainer.rewards import RewardBreakdown, RewardConfig, RewardModel
    from calibrl.trainer.rollout import RolloutBatch
    from calibrl.trainer.tasks import Task

T = TypeVar("T")
RunAsync = Callable[[Coroutine[Any, Any, T]], T]  # runs a coroutine to its result from synchronous code
JsonRecord = Mapping[str, object]  # one parsed JSONL line


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


class RolloutFn(Protocol):
    def __call__(self, engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                 settings: RolloutSettings, retrieval: "RetrievalClient", run_async: RunAsync) -> "RolloutBatch": ...


class RewardFn(Protocol):
    """The rewards of a batch of the kind's rollouts, one per rollout (the services through ``rewards``)."""

    def __call__(self, rewards: "RewardModel",
                 rollouts: Sequence["Rollout"]) -> Coroutine[Any, Any, "list[RewardBreakdown]"]: ...


class StepMetricsFn(Protocol):
    """The kind's metrics of one training step (name -> value), from its rollouts and their rewards."""

    def __call__(self, rollouts: Sequence["Rollout"], breakdowns: Sequence["RewardBreakdown"]) -> dict[str, float]: ...


class EvaluateFn(Protocol):
    def __call__(self, engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                 retrieval: "RetrievalClient", settings: "EvalSettings", run_async: RunAsync, template: str,
                 chat_template: bool | None) -> dict[str, float]: ...


class BaselineFn(Protocol):
    def __call__(self, tasks: Sequence["Task"], retrieval: "RetrievalClient", settings: "EvalSettings",
                 run_async: RunAsync) -> dict[str, float]: ...


class SampleItemsFn(Protocol):
    """(items, outputs left out because they were empty) of one model on ``tasks``."""

    def __call__(self, engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", tasks: Sequence["Task"],
                 retrieval: "RetrievalClient", settings: "EvalSettings", run_async: RunAsync, template: str,
                 chat_template: bool | None, name: str) -> "tuple[list[SampleItem], int]": ...


@dataclass(frozen=True)
class RecordFormat:
    """One JSONL record format of task files (``tasks.format``)."""

    name: str
    key: str  # a record holding this key is of this format (fmt=auto)
    parse: Callable[[JsonRecord, str], "Task"]  # (record, "file:line") -> a task of the format's kind


@dataclass(frozen=True)
class TaskKind:
    """One registered kind of agent (see the module docstring for each field's role)."""

    name: str
    builtin_template: str
    rollout: RolloutFn  # (engine, tokenizer, tasks, settings, retrieval, run_async) -> RolloutBatch
    score: RewardFn  # (reward_model, rollouts) -> coroutine of one RewardBreakdown per rollout
    evaluate: EvaluateFn  # (engine, tokenizer, tasks, retrieval, settings, run_async, template, chat) -> metrics
    metric_names: tuple[str, ...]
    max_completion_tokens: Callable[["RolloutConfig"], int]
    formats: tuple[RecordFormat, ...] = ()
    required: Mapping[str, str] = field(default_factory=dict)  # Task field -> why it may not be empty
    write_record: Callable[["Task"], dict[str, object]] | None = None
    multi_step: bool = False
    query_baseline: BaselineFn | None = None
    sample_items: SampleItemsFn | None = None
    step_metrics: StepMetricsFn | None = None
    reward_weights: Callable[["RewardConfig"], dict[str, float]] | None = None


TASK_KINDS: dict[str, TaskKind] = {}


def register_task_kind(kind: TaskKind) -> TaskKind:
    """Add ``kind`` to the registry (a second kind of the same name, or a record format
    name or key another kind already reads, is an error)."""
    if kind.name in TASK_KINDS and TASK_KINDS[kind.name] is not kind:
        raise ConfigError(f"task kind {kind.name!r} is already registered")
    others = [f for k in TASK_KINDS.values() if k.name != kind.name for f in k.formats]
    for fmt in kind.formats:
        for other in others:
            if fmt.name == other.name or fmt.key == other.key:
                raise ConfigError(f"task kind {kind.name!r}: record format {fmt.name!r} (key {fmt.key!r}) clashes "
                                  f"with the registered format {other.name!r} (key {other.key!r})")
    TASK_KINDS[kind.name] = kind
    return kind


def task_kind(name: str) -> TaskKind:
    """The registered kind ``name``; ConfigError naming the known ones otherwise."""
    try:
        return TASK_KINDS[name]
    except KeyError:
        raise ConfigError(f"task kind {name!r}: expected one of {sorted(TASK_KINDS)}") from None


def record_formats() -> dict[str, RecordFormat]:
    """Every registered record format by name, in registration order."""
    return {fmt.name: fmt for kind in TASK_KINDS.values() for fmt in kind.formats}


__all__ = ["TASK_KINDS", "RecordFormat", "RewardFn", "RolloutSettings", "StepMetricsFn", "TaskKind", "record_formats",
           "register_task_kind", "task_kind"]
