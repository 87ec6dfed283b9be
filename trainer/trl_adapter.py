"""TRL interop: the retrieval and judge services as ``GRPOTrainer`` reward functions.

::

    funcs = make_reward_funcs("127.0.0.1:50051", "127.0.0.1:50052", RewardConfig(rubric_id="my-rubric"))
    args = GRPOConfig(..., reward_weights=funcs.weights)        # [0.7, 0.3]
    trainer = GRPOTrainer(model=..., reward_funcs=funcs, args=args, train_dataset=tasks_to_dataset(tasks))
    trainer.train()
    funcs.close()

The choice: one callable per reward component (``retrieval``, ``rubric``), named
so TRL logs ``rewards/retrieval/mean`` and ``rewards/rubric/mean``, with the
blend weights handed to TRL as ``reward_weights``. TRL's default aggregation
(``multi_objective_aggregation="sum_then_normalize"``) sums weight x component,
which is exactly calibrl's ``R = w_retrieval * r_ret + w_rubric * r_rub``, so TRL's
``reward`` is the calibrl reward and the components stay visible. The services are
still called once per batch: the first component function of a batch scores the
whole batch (retrieval and judge concurrently, with :class:`RewardModel`'s
retries) and the other reads the result. Pass ``blended=True`` for a single
callable ``calibrl_reward`` returning R itself (weight 1.0): use it with
``multi_objective_aggregation="normalize_then_sum"``, which would otherwise
normalise each component on its own and change the blend.

No silent zeros: TRL turns a ``None`` reward into NaN and then a zero advantage,
so these functions never return one. A batch whose reward cannot be computed
raises :class:`~calibrl.errors.RewardError` out of ``trainer.train()``.

Scope: the single-turn ``rewrite`` task kind (:data:`calibrl.trainer.kinds.rewrite.REWRITE`;
a completion is a rewrite; its first non-empty line is used, as the rewriter's format is
one line). The multi-step search agent
needs per-step retrieval during generation and CalibAdv's per-step advantages,
which TRL's trainer has no place for; use calibrl's own loop for it.

TRL calls reward functions synchronously from the training thread; the async
clients run on a :class:`~calibrl.trainer.aio.BackgroundLoop`.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypedDict

from calibrl.errors import InvalidArgument, RewardError
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.kinds.rewrite import REWRITE
from calibrl.trainer.rewards import RewardBreakdown, RewardConfig, RewardModel
from calibrl.trainer.kinds.rewrite import RewriteRollout
from calibrl.trainer.tasks import Task
from calibrl.trainer.kinds.rewrite import score_rewrites
from calibrl.trainer.search_format import fill_template

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset

log = logging.getLogger(__name__)

BLENDED_NAME = "calibrl_reward"


class TrlRow(TypedDict):
    """One row of :func:`tasks_to_dataset`: the prompt plus the columns the reward functions read."""

    prompt: str
    task_id: str
    query: str
    gold_doc_ids: list[str]
    answers: list[str]
    context: str  # the task's context as a JSON object string


def completion_text(completion: object) -> str:
    """The text of a TRL completion: a string, or a conversation (list of messages) whose
    last assistant message's content is a string or a list of ``{"type": "text"}`` parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence):
        messages = [m for m in completion if isinstance(m, Mapping)]
        replies = [m for m in messages if m.get("role") == "assistant"] or messages
        if not replies:
            return ""
        content = replies[-1].get("content", "")
        if isinstance(content, str):
            return content
        if isinstance(content, Sequence):
            return "".join(part.get("text", "") for part in content
                           if isinstance(part, Mapping) and part.get("type", "text") == "text")
        return ""
    raise InvalidArgument("completions", f"expected a string or a list of messages, got {type(completion).__name__}")


def rewrite_from_completion(completion: object) -> str:
    """The rewrite a completion proposes: its first non-empty line (empty when there is none)."""
    for line in completion_text(completion).splitlines():
        if line.strip():
            return line.strip()
    return ""


def tasks_to_dataset(tasks: Iterable[Task], prompt_template: str | None = None,
                     as_hf_dataset: bool = True) -> "Dataset | list[TrlRow]":
    """Rewrite tasks as TRL rows: ``prompt`` plus the columns the reward functions read
    (``task_id``, ``query``, ``gold_doc_ids``, ``answers``, ``context`` as a JSON object string).

    ``prompt_template`` takes ``{query}`` and optionally ``{context}``; the default is the
    rewriter prompt of :mod:`calibrl.trainer.search_format`. Returns a ``datasets.Dataset`` (or the
    list of row dicts with ``as_hf_dataset=False``).
    """
    template = prompt_template or REWRITE.builtin_template
    rows: list[TrlRow] = []
    for task in tasks:
        if task.kind != REWRITE.name:
            raise InvalidArgument("tasks", f"task {task.task_id!r} is a {task.kind} task; the TRL adapter scores "
                                  f"{REWRITE.name} tasks only (use calibrl's loop for multi-step agents)")
        rows.append(TrlRow(
            prompt=fill_template(template, task.query, task.context),
            task_id=task.task_id,
            query=task.query,
            gold_doc_ids=list(task.gold_doc_ids),
            answers=list(task.answers),
            context=json.dumps(dict(task.context), sort_keys=True),
        ))
    if not as_hf_dataset:
        return rows
    from datasets import Dataset

    return Dataset.from_list(rows)


def _task_at(columns: Mapping[str, Sequence[Any]], index: int) -> Task:
    def column(name: str, required: bool) -> Any:
        values = columns.get(name)
        if values is None:
            if required:
                raise InvalidArgument(
                    name, "missing from the reward function's dataset columns; build the dataset with "
                    "calibrl.trainer.trl_adapter.tasks_to_dataset (columns query, gold_doc_ids, [answers], [context])"
                )
            return None
        return values[index]

    context = column("context", required=False) or {}
    if isinstance(context, str):
        context = json.loads(context) if context.strip() else {}
    pairs = tuple(sorted((str(k), str(v)) for k, v in dict(context).items()))
    task_id = column("task_id", required=False)
    return Task(
        task_id=str(task_id) if task_id is not None else f"row-{index}",
        kind=REWRITE.name,
        query=str(column("query", required=True)),
        gold_doc_ids=tuple(column("gold_doc_ids", required=True) or ()),
        answers=tuple(column("answers", required=False) or ()),
        context=pairs,
    )


class TrlRewardScorer:
    """Scores a TRL batch once and serves each component's column from that result."""

    def __init__(self, reward_model: RewardModel, loop: BackgroundLoop, timeout_s: float | None = None) -> None:
        self.reward_model = reward_model
        self.loop = loop
        self.timeout_s = timeout_s
        self.weights = reward_model.config.rewrite_weights()
        self.batches_scored = 0
        self.last_breakdowns: list[RewardBreakdown] = []
        self._cached_key: tuple | None = None
        self._unread: set[str] = set()

    def breakdowns(self, component: str, prompts: Sequence[object], completions: Sequence[object],
                   columns: Mapping[str, Sequence[Any]]) -> list[RewardBreakdown]:
        key = (tuple(map(repr, prompts)), tuple(map(repr, completions)))
        if key == self._cached_key and component in self._unread:
            self._unread.discard(component)
            return self.last_breakdowns
        if len(prompts) != len(completions):
            raise InvalidArgument("completions", f"{len(completions)} completions for {len(prompts)} prompts")
        rollouts = [RewriteRollout(_task_at(columns, i), rewrite_from_completion(c)) for i, c in enumerate(completions)]
        results = self.loop.run(score_rewrites(self.reward_model, rollouts), self.timeout_s)
        if len(results) != len(rollouts):  # RewardModel never does this; guard the no-partial-batch rule anyway
            raise RewardError(f"{len(results)} rewards for {len(rollouts)} completions")
        self.batches_scored += 1
        self.last_breakdowns = results
        self._cached_key = key
        self._unread = set(self.weights) | {BLENDED_NAME}
        self._unread.discard(component)
        return results


class _ComponentReward:
    """A TRL reward function for one component (or the blended total)."""

    def __init__(self, scorer: TrlRewardScorer, component: str) -> None:
        self.scorer = scorer
        self.component = component
        self.__name__ = component  # TRL logs rewards/<__name__>/mean

    def __call__(self, prompts: Sequence[object], completions: Sequence[object],
                 **columns: Sequence[Any]) -> list[float]:
        results = self.scorer.breakdowns(self.component, prompts, completions, columns)
        if self.component == BLENDED_NAME:
            return [r.total for r in results]
        return [r.components[self.component] for r in results]


class TrlRewardFuncs(list):
    """The list to pass as ``GRPOTrainer(reward_funcs=...)``; ``weights`` go to
    ``GRPOConfig(reward_weights=...)``. Close it (or use ``with``) to release the clients."""

    def __init__(self, funcs: list[_ComponentReward], weights: list[float], scorer: TrlRewardScorer,
                 on_close: Callable[[], None] | None = None) -> None:
        super().__init__(funcs)
        self.weights = weights
        self.names = [f.__name__ for f in funcs]
        self.scorer = scorer
        self._on_close = on_close

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def __enter__(self) -> "TrlRewardFuncs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reward_funcs_for(reward_model: RewardModel, *, blended: bool = False, loop: BackgroundLoop | None = None,
                     timeout_s: float | None = None, on_close: Callable[[], None] | None = None) -> TrlRewardFuncs:
    """TRL reward functions over any :class:`RewardModel` (gRPC or in-process clients)."""
    owned_loop = loop is None
    loop = loop or BackgroundLoop(name="calibrl-trl-rewards")
    scorer = TrlRewardScorer(reward_model, loop, timeout_s)
    if blended:
        funcs, weights = [_ComponentReward(scorer, BLENDED_NAME)], [1.0]
    else:
        funcs = [_ComponentReward(scorer, name) for name in scorer.weights]
        weights = list(scorer.weights.values())

    def close() -> None:
        try:
            if on_close is not None:
                on_close()
        finally:
            if owned_loop:
                loop.close()

    return TrlRewardFuncs(funcs, weights, scorer, close)


def make_reward_funcs(
    retrieval_target: str,
    judge_target: str | None,
    config: RewardConfig,
    *,
    blended: bool = False,
    loop: BackgroundLoop | None = None,
    timeout_s: float | None = None,
    **client_options: Any,
) -> TrlRewardFuncs:
    """Reward functions for TRL's GRPOTrainer backed by the two services.

    ``judge_target`` may be None when the config never calls the judge (``w_rubric=0`` or
    ``binary_only``). ``client_options`` go to both gRPC clients (``timeout_s`` of each
    call, ``max_attempts``, ``metadata`` such as ``[("authorization", "Bearer KEY")]``,
    ``channel_credentials``, ...). ``timeout_s`` here bounds a whole batch's scoring.
    """
    # lazy: grpc_clients imports grpc, which this module does not
    from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient

    config.validate()
    owned_loop = loop is None
    loop = loop or BackgroundLoop(name="calibrl-trl-rewards")
    retrieval = GrpcRetrievalClient(retrieval_target, **client_options)
    judge = GrpcJudgeClient(judge_target, **client_options) if judge_target else None
    try:
        model = RewardModel(config, retrieval, judge)
    except BaseException:
        if owned_loop:
            loop.close()
        raise

    def close_clients() -> None:
        async def close_all() -> None:
            await retrieval.close()
            if judge is not None:
                await judge.close()

        try:
            loop.run(close_all(), 10)
        finally:
            if owned_loop:
                loop.close()

    return reward_funcs_for(model, blended=blended, loop=loop, timeout_s=timeout_s, on_close=close_clients)


__all__ = [
    "BLENDED_NAME",
    "TrlRewardFuncs",
    "TrlRewardScorer",
    "completion_text",
    "make_reward_funcs",
    "reward_funcs_for",
    "rewrite_from_completion",
    "tasks_to_dataset",
]
