"""The types that pass between the stages of a step, in one place, all frozen.

One step hands these on, in order (``calibrl.trainer.loop`` runs the stages)::

    sampling  -> PendingBatch   (a RolloutBatch + its reward futures; behaviour log-probs off-policy)
    pipeline  -> StepRollouts   (this step's PendingBatch, the next step's when sampled ahead)
    scoring   -> ScoredBatch    (one RewardBreakdown per row)
    advantage -> TrainingBatch  (per-token advantages)
    update    -> EarlyForward (before the rewards), MicroBatch (per micro-batch), UpdateResult

Every class here is a frozen dataclass: a stage cannot reassign a field of what it
received (``dataclasses.FrozenInstanceError``); a stage that adds something (the
behaviour log-probs, the scores) hands on a copy made with :func:`dataclasses.replace`.
The tensors and lists inside are not copied, so a stage must not write into them either
(no stage does; the tests check the fields).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from calibrl.errors import CalibrlError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.checkpoint import SavedPending
    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.tasks import Task


# --------------------------------------------------------------------------- rollouts


class Rollout(Protocol):
    """One row's record, of its task kind's own type (a rewrite, a search trajectory, ...): what the
    kind's reward, metrics and estimators read. Every kind's record names the task it answers."""

    @property
    def task(self) -> "Task": ...


@dataclass(frozen=True)
class RolloutBatch:
    """G rollouts per task as one token batch (shapes: B rows, L tokens)."""

    input_ids: "torch.Tensor"  # (B, L) prompt + completion (+ observations), right-padded
    attention_mask: "torch.Tensor"  # (B, L)
    completion_mask: "torch.Tensor"  # (B, L) bool: sampled tokens (prompt, observations, padding False)
    segment_index: "torch.Tensor"  # (B, L) long: sampled segment 0..S-1 of each trained token, -1 elsewhere
    answer_mask: "torch.Tensor"  # (B, L) bool: tokens of each row's last sampled segment
    group_index: "torch.Tensor"  # (B,) long: task index; group_size consecutive rows per task
    completion_texts: list[str]  # what followed the prompt (search: from the prompt's <think>, observations included)
    rollouts: Sequence[Rollout]  # the kind's record of each row, same order
    prompt_lengths: list[int] = field(default_factory=list)  # prompt tokens of each row

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: "torch.device | str") -> "RolloutBatch":
        """A copy with every tensor on ``device``."""
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            completion_mask=self.completion_mask.to(device),
            segment_index=self.segment_index.to(device),
            answer_mask=self.answer_mask.to(device),
            group_index=self.group_index.to(device),
        )


# --------------------------------------------------------------------------- sampling and scoring


@dataclass(frozen=True)
class ScoredBatch:
    """A step's rollouts with one reward breakdown per row (the hand-off to the
    advantage stage)."""

    step: int
    batch: RolloutBatch  # on the training device
    breakdowns: list["RewardBreakdown"]  # one per row: the total reward and its components
    behaviour_logp: "torch.Tensor | None" = None  # (B, L) when sampled before the last update, else None

    @property
    def rewards(self) -> "torch.Tensor":
        """(B,) float32 total rewards, on the batch's device."""
        import torch  # lazy: torch is heavy and the CLI's --help must stay instant

        return torch.tensor([b.total for b in self.breakdowns], dtype=torch.float32,
                            device=self.batch.input_ids.device)


@dataclass(frozen=True)
class PendingBatch:
    """One step's rollouts from generation to update: the batch, its behaviour
    log-probs when it was sampled before the last update (one step off-policy), and
    its reward futures, one per generation chunk, until settled."""

    step: int
    batch: RolloutBatch  # on the training device
    futures: tuple["concurrent.futures.Future[list[RewardBreakdown]]", ...]  # in chunk order
    data_position: dict[str, int]  # TaskOrder.state() just after this step's tasks were taken
    breakdowns: list["RewardBreakdown"] | None = None  # one per row once every future is in
    generation_s: float = field(default=0.0)
    sampling_metrics: dict[str, float] = field(default_factory=dict)  # sampling/* of dynamic sampling, else empty
    # (B, L) log-probs under the weights that sampled the batch, taken before the update that follows its
    # sampling (pipeline.py); None on-policy, where the loss uses the current log-probs, detached.
    behaviour_logp: "torch.Tensor | None" = None

    def settle(self) -> list["RewardBreakdown"]:
        """The rows' rewards, waiting for the futures; raises the first failure."""
        if self.breakdowns is not None:
            return self.breakdowns
        breakdowns: list[RewardBreakdown] = []
        failure = None
        for future in self.futures:
            try:
                breakdowns.extend(future.result())
            except CalibrlError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return breakdowns

    def with_scores(self) -> "PendingBatch":
        """A copy holding its settled scores and no futures (raises the first failure)."""
        return replace(self, breakdowns=self.settle(), futures=())

    def without_scores(self) -> "PendingBatch":
        """A copy with no scores and no futures (a resumed run asks for them again)."""
        return replace(self, breakdowns=None, futures=())

    def with_behaviour_logp(self, behaviour_logp: "torch.Tensor | None") -> "PendingBatch":
        """A copy carrying the behaviour log-probs (B, L) of its rows."""
        return replace(self, behaviour_logp=behaviour_logp)

    def scored(self) -> ScoredBatch:
        """Wait for the rewards (raises the first failure) and hand the batch on."""
        return ScoredBatch(self.step, self.batch, self.settle(), self.behaviour_logp)

    def to_saved(self) -> "SavedPending":
        """What a checkpoint stores of it (tensors on the CPU; scores when settled)."""
        behaviour = None if self.behaviour_logp is None else self.behaviour_logp.to("cpu")
        return {"step": self.step, "batch": self.batch.to("cpu"), "breakdowns": self.breakdowns,
                "data_position": self.data_position, "behaviour_logp": behaviour}


@dataclass(frozen=True)
class StepRollouts:
    """What :meth:`calibrl.trainer.pipeline.RolloutPipeline.take` hands a step."""

    current: PendingBatch | None  # this step's rollouts (None only when sampling failed)
    upcoming: PendingBatch | None  # the next step's, sampled ahead (off-policy), else None
    failure: CalibrlError | None  # why sampling failed, else None

    def with_upcoming_behaviour(self, behaviour_logprobs: "Callable[[RolloutBatch], torch.Tensor]") -> "StepRollouts":
        """A copy whose upcoming batch (when there is one) carries ``behaviour_logprobs`` of its rows."""
        if self.upcoming is None:
            return self
        return replace(self, upcoming=self.upcoming.with_behaviour_logp(behaviour_logprobs(self.upcoming.batch)))


# --------------------------------------------------------------------------- advantages and update


@dataclass(frozen=True)
class TrainingBatch:
    """What the update consumes: the rollouts' tokens and masks, their behaviour
    log-probs (None on-policy) and per-token advantages."""

    step: int
    batch: RolloutBatch  # input_ids, attention_mask, completion_mask (B, L)
    token_adv: "torch.Tensor"  # (B, L) float, 0 wherever completion_mask is False
    breakdowns: list["RewardBreakdown"]  # one per row (for the per-component reward metrics)
    metrics: dict[str, float]  # the estimator's: reward, reward_std, frac_reward_zero_std, ...
    behaviour_logp: "torch.Tensor | None" = None  # (B, L) when the batch was sampled before the last update


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the step's batch, cut to their longest row; the loss-side tensors
    start at ``start``, the first column holding a generated token of any row."""

    input_ids: "torch.Tensor"  # (b, L)
    attention_mask: "torch.Tensor"  # (b, L)
    start: int
    mask: "torch.Tensor"  # (b, L - start) completion_mask
    token_adv: "torch.Tensor | None"  # (b, L - start), or None before advantages exist
    old_logp: "torch.Tensor | None" = None  # (b, L - start) behaviour log-probs of a stale batch, else None


@dataclass(frozen=True)
class EarlyForward:
    """Forward passes of a batch done before its rewards are in."""

    parts: list[list[int]]  # the micro-batches' rows
    ref_logps: "list[torch.Tensor | None]"  # per micro-batch, None without a KL term
    first: "tuple[torch.Tensor, float | None] | None"  # the policy's (logp, entropy) of micro-batch 0
    reference_metrics: dict[str, float] = field(default_factory=dict)  # reference_perplexity's, {} without a reference


@dataclass(frozen=True)
class UpdateResult:
    """What one update reports."""

    metrics: dict[str, float]  # loss, grad_norm, learning_rate, and the loss's own metrics
    stepped: bool  # False when a non-finite gradient norm skipped the optimizer step


__all__ = [
    "EarlyForward", "MicroBatch", "PendingBatch", "Rollout", "RolloutBatch", "ScoredBatch", "StepRollouts",
    "TrainingBatch", "UpdateResult",
]
