"""Advantage estimators: pure tensor functions, registered by name.

Every estimator takes an :class:`AdvantageInputs` (one scalar reward per
rollout plus the token layout of the rollouts) and keyword parameters, and
returns ``(token_adv, metrics)``: ``token_adv`` is a ``(B, T)`` float tensor,
0 wherever ``completion_mask`` is False, and ``metrics`` a flat
``dict[str, float]`` with stable names (TRL's where TRL has one). Inputs are
never modified. The training loop picks an estimator by name through
:func:`compute_advantages`; adding one is a matter of decorating a function
with :func:`register_advantage`.

Estimators
----------
``grpo``
    ``A_i = R_i - mean_g(R)``, optionally divided by ``std + eps`` where the
    std is the group's (``scale="group"``) or the whole batch's
    (``scale="batch"``); this is TRL ``GRPOTrainer``'s ``scale_rewards``,
    including its unbiased std (``torch.std``) and ``eps = 1e-4`` added to the
    std. The rollout's advantage is broadcast to its trained tokens.
    With ``step_credit=True`` (search agents with per-step dense rewards,
    ``calibrl.trainer.kinds.search.step_rewards``) the tokens of intermediate segment k (search
    step k) get instead ``a_k = r_k - mean(r_k over the group's rollouts that
    have a step k)``, scaled like ``A`` (the std of those same-index step
    rewards for "group", of all the batch's step rewards for "batch"): a step
    is credited against the other rollouts' same-index steps, so the tokens
    from the point of failure on get a negative advantage. The answer segment,
    and a step without a reward (NaN), keeps the trajectory advantage ``A``.
``calibadv``
    CalibAdv (Wu et al., arXiv 2604.18235) as released in the authors' verl
    fork: base ``A = (R - mean_g) / (std_g + 1e-6)`` with the unbiased group
    std; for a rollout with ``A < 0`` every token of intermediate segment ``k``
    gets ``A * (1 - s_k)`` (``s_k`` from :mod:`calibrl.trainer.calibadv`), the answer
    segment keeps ``A``; positive rollouts are unchanged; then, per group, the
    positive answer-token advantages are scaled by ``N / (lambda_ * P)`` (``P``
    the sum of positive and ``N`` the sum of the absolute negative answer-token
    advantages), and a group with ``P == 0`` or ``N == 0`` has all its answer
    advantages set to 0.

Departures, on purpose
----------------------
* A group of one rollout gets advantage 0 (its baseline is its own reward).
  The authors' fork uses mean 0 and std 1 for such a group (advantage ``R``);
  TRL never forms one (``num_generations >= 2``) and would produce NaN, which
  it then zeroes. Singleton groups count as zero-std groups.
* A non-finite reward is an error, never a 0 advantage (TRL zeroes NaN).
* ``frac_reward_zero_std`` is the share of *groups* whose rewards are all
  equal (TRL's ``isclose(std, 0)`` rule, i.e. ``std <= 1e-8``). With equal
  group sizes and ``scale`` "group"/"none" this is exactly TRL's number; with
  ``scale_rewards="batch"`` TRL instead reports whether the *batch* std is 0.
* ``reward_std`` is TRL 1.16's: the std of all rewards in the batch (older TRL
  logged the mean of per-group stds; that is ``reward_std_within_group`` here).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from calibrl.errors import InvalidArgument
from calibrl.trainer.calibadv import search_step_found_gold, search_step_scores

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.config import CalibAdvAdvantage
    from calibrl.trainer.rollout import RolloutBatch

__all__ = [
    "ADVANTAGE_BATCH_INPUTS",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "batch_inputs_for",
    "compute_advantages",
    "reward_metrics",
    "register_advantage",
]

# TRL's zero-std rule: torch.isclose(std, 0) with its default atol.
ZERO_STD_ATOL = 1e-8


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """Rewards and token layout of one batch of rollouts.

    Shapes: ``B`` rollouts, ``T`` token positions (the completion part of the
    sequence, padded), ``S`` step-score slots.

    rewards: (B,) float
        One scalar reward per rollout; must be finite.
    group_index: (B,) integer
        Rollouts with equal values form one group (the G samples of one
        task). Any integers, groups need not be contiguous.
    completion_mask: (B, T) bool (or 0/1 integers)
        Generated tokens that are trained; prompt, observation
        (``<information>``) and padding tokens are False.
    segment_index: (B, T) integer
        The generated segment (turn) 0..S-1 each token belongs to; -1 exactly
        where ``completion_mask`` is False.
    answer_mask: (B, T) bool (or 0/1 integers)
        Tokens of the rollout's last generated segment (its answer segment):
        must equal ``completion_mask & (segment_index == last segment)``.
    step_scores: (B, S) float in [0, 1], optional
        CalibAdv step score of each segment; NaN where a rollout has no score
        (treated as 0). Only intermediate segments are read. Ignored by grpo.
    step_rewards: (B, S) float, optional
        Dense reward of each search step (segment k = step k); NaN where a
        rollout has no step k. Read by grpo with ``step_credit=True``.
    step_found_gold: (B, S) float, optional
        1 where search step k retrieved a gold document, 0 where it did not, NaN
        where a rollout has no step k (or no gold labels). Diagnostics only: it
        never changes an advantage (CalibAdv reports how many of the steps it
        softened, and of those GRPO penalises, had found one).
    """

    rewards: Tensor
    group_index: Tensor
    completion_mask: Tensor
    segment_index: Tensor
    answer_mask: Tensor
    step_scores: Tensor | None = None
    step_rewards: Tensor | None = None
    step_found_gold: Tensor | None = None

    def __post_init__(self) -> None:
        _validate_inputs(self)

    @property
    def trained(self) -> Tensor:
        """(B, T) bool view of ``completion_mask``."""
        return _bool_mask("completion_mask", self.completion_mask)

    @property
    def answer(self) -> Tensor:
        """(B, T) bool view of ``answer_mask``."""
        return _bool_mask("answer_mask", self.answer_mask)


def _bool_mask(name: str, mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InvalidArgument(name, f"must be a bool (or 0/1 integer) tensor, got dtype {mask.dtype}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidArgument(name, "integer masks may hold only 0 and 1")
    return mask.bool()


def _validate_inputs(inputs: AdvantageInputs) -> None:
    rewards = inputs.rewards
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise InvalidArgument("rewards", "must be a 1-D float tensor (B,)")
    batch = rewards.shape[0]
    if batch == 0:
        raise InvalidArgument("rewards", "must hold at least one rollout")
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        raise InvalidArgument(
            "rewards",
            f"reward of rollout {int(bad[0])} is {float(rewards[bad[0]])}; a reward that could not be "
            "computed must be retried or the step stopped, never trained on",
        )
    group_index = inputs.group_index
    if not isinstance(group_index, Tensor) or group_index.shape != (batch,) or group_index.dtype.is_floating_point:
        raise InvalidArgument("group_index", f"must be an integer tensor of shape ({batch},) like rewards")

    trained = _bool_mask("completion_mask", inputs.completion_mask)
    if trained.dim() != 2 or trained.shape[0] != batch:
        raise InvalidArgument("completion_mask", f"must have shape ({batch}, T), got {tuple(trained.shape)}")
    shape = tuple(trained.shape)
    segment_index = inputs.segment_index
    if tuple(segment_index.shape) != shape or segment_index.dtype.is_floating_point:
        raise InvalidArgument("segment_index", f"must be an integer tensor of shape {shape} like completion_mask")
    if bool((segment_index[trained] < 0).any()):
        raise InvalidArgument("segment_index", "must be >= 0 on every token where completion_mask is True")
    if bool((segment_index[~trained] != -1).any()):
        raise InvalidArgument("segment_index", "must be -1 exactly where completion_mask is False")
    answer = _bool_mask("answer_mask", inputs.answer_mask)
    if tuple(answer.shape) != shape:
        raise InvalidArgument("answer_mask", f"must have shape {shape} like completion_mask")
    last_segment = segment_index.max(dim=1, keepdim=True).values
    expected = trained & (segment_index == last_segment)
    if not torch.equal(answer, expected):
        row = int((answer != expected).any(dim=1).nonzero()[0])
        raise InvalidArgument(
            "answer_mask",
            f"rollout {row}: must mark exactly the trained tokens of the last generated segment "
            f"(segment {int(last_segment[row])})",
        )
    devices = {t.device for t in (rewards, group_index, inputs.completion_mask, segment_index, inputs.answer_mask)}

    scores = inputs.step_scores
    if scores is not None:
        devices.add(scores.device)
        if scores.dim() != 2 or scores.shape[0] != batch or not scores.dtype.is_floating_point:
            raise InvalidArgument("step_scores", f"must be a float tensor of shape ({batch}, S)")
        known = scores[~torch.isnan(scores)]
        if bool(((known < 0) | (known > 1)).any()):
            raise InvalidArgument("step_scores", "must lie in [0, 1] (NaN marks a rollout without scores)")
        intermediate = trained & ~answer
        if bool(intermediate.any()):
            needed = int(segment_index[intermediate].max()) + 1
            if needed > scores.shape[1]:
                raise InvalidArgument(
                    "step_scores",
                    f"has {scores.shape[1]} slots but an intermediate segment {needed - 1} needs a score "
                    f"(S must be at least {needed})",
                )
    step_rewards = inputs.step_rewards
    if step_rewards is not None:
        devices.add(step_rewards.device)
        if step_rewards.dim() != 2 or step_rewards.shape[0] != batch or not step_rewards.dtype.is_floating_point:
            raise InvalidArgument("step_rewards", f"must be a float tensor of shape ({batch}, S)")
        if bool(torch.isinf(step_rewards).any()):
            raise InvalidArgument("step_rewards", "must be finite (NaN marks a step a rollout does not have)")
    found = inputs.step_found_gold
    if found is not None:
        devices.add(found.device)
        if found.dim() != 2 or found.shape[0] != batch or not found.dtype.is_floating_point:
            raise InvalidArgument("step_found_gold", f"must be a float tensor of shape ({batch}, S)")
        known = found[~torch.isnan(found)]
        if bool(((known != 0) & (known != 1)).any()):
            raise InvalidArgument("step_found_gold", "must hold 0, 1 or NaN")
    if len(devices) > 1:
        raise InvalidArgument("inputs", f"all tensors must be on one device, got {sorted(map(str, devices))}")


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------

AdvantageFn = Callable[..., "tuple[Tensor, dict[str, float]]"]
# (rollout batch, advantage settings) -> (extra AdvantageInputs fields, metrics): what an
# estimator reads from the rollouts themselves beyond rewards and token layout.
BatchInputsFn = Callable[["RolloutBatch", "CalibAdvAdvantage | None"], "tuple[dict[str, Tensor], dict[str, float]]"]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
ADVANTAGE_BATCH_INPUTS: dict[str, BatchInputsFn] = {}


def register_advantage(name: str, batch_inputs: BatchInputsFn | None = None) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(inputs, **params) -> (token_adv, metrics)`` under ``name``.

    ``batch_inputs(batch, settings)``, when given, computes the estimator's extra
    inputs from a :class:`~calibrl.trainer.rollout.RolloutBatch` (CalibAdv's step scores),
    so the training loop never needs to know which estimator runs."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not fn:
            raise InvalidArgument("name", f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        if batch_inputs is not None:
            ADVANTAGE_BATCH_INPUTS[name] = batch_inputs
        return fn

    return decorator


def batch_inputs_for(name: str, batch: "RolloutBatch",
                     settings: "CalibAdvAdvantage | None") -> tuple[dict[str, Tensor], dict[str, float]]:
    """The extra inputs (and their metrics) estimator ``name`` reads from ``batch``;
    none for an estimator that needs only rewards and the token layout."""
    hook = ADVANTAGE_BATCH_INPUTS.get(name)
    return hook(batch, settings) if hook is not None else ({}, {})


def compute_advantages(name: str, inputs: AdvantageInputs, **params: object) -> tuple[Tensor, dict[str, float]]:
    """Run the estimator registered as ``name``.

    Returns ``token_adv`` (B, T) float, 0 where ``completion_mask`` is False,
    and its metrics.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise InvalidArgument("name", f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    fn = ADVANTAGE_ESTIMATORS[name]
    accepted = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    for key in params:
        if key not in accepted:
            raise InvalidArgument(key, f"not a parameter of advantage estimator {name!r}; it takes {accepted}")
    return fn(inputs, **params)


# ---------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Groups:
    inverse: Tensor  # (B,) long: group id 0..G-1 of each rollout
    count: Tensor  # (G,) float64
    mean: Tensor  # (G,) float64
    std: Tensor  # (G,) float64, unbiased; 0 for a group of one


def _groups(rewards: Tensor, group_index: Tensor) -> _Groups:
    """Per-group mean and unbiased std of float64 ``rewards`` (B,)."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, rewards)
    mean = total / count
    squared = torch.zeros_like(count).index_add_(0, inverse, (rewards - mean[inverse]) ** 2)
    std = torch.where(count > 1, (squared / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    return _Groups(inverse, count, mean, std)


def reward_metrics(rewards: Tensor, group_index: Tensor) -> dict[str, float]:
    """``reward``, ``reward_std`` (over the batch), ``reward_std_within_group`` and
    ``frac_reward_zero_std`` (the fraction of GROUPS whose rewards are all equal,
    TRL's meaning) of rewards (B,) grouped by group_index (B,). The one definition:
    every estimator reports these."""
    rewards = rewards.double()
    return _reward_metrics(rewards, _groups(rewards, group_index))


def _reward_metrics(rewards: Tensor, groups: _Groups) -> dict[str, float]:
    batch_std = float(rewards.std()) if rewards.numel() > 1 else 0.0
    return {
        "reward": float(rewards.mean()),
        "reward_std": batch_std,
        "reward_std_within_group": float(groups.std.mean()),
        "frac_reward_zero_std": float((groups.std <= ZERO_STD_ATOL).double().mean()),
    }


def _abs_mean(token_adv: Tensor, trained: Tensor) -> float:
    count = int(trained.sum())
    return float(token_adv.abs()[trained].double().sum() / count) if count else 0.0


# ---------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------

GRPO_SCALES = ("none", "group", "batch")


@register_advantage("grpo")
def grpo_advantages(
    inputs: AdvantageInputs, *, scale: str = "group", eps: float = 1e-4, step_credit: bool = False
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages, TRL ``GRPOTrainer`` semantics.

    rewards (B,) -> ``A = R - mean_g(R)``, divided by ``std + eps`` for
    ``scale`` "group" (unbiased group std) or "batch" (unbiased std of all
    rewards), left as is for "none"; broadcast to ``token_adv`` (B, T).
    ``eps`` defaults to TRL's 1e-4. ``step_credit``: intermediate segments get
    their step's advantage against the group's same-index steps (module docstring).
    """
    if scale not in GRPO_SCALES:
        raise InvalidArgument("scale", f"must be one of {GRPO_SCALES}, got {scale!r}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise InvalidArgument("eps", f"must be a finite number >= 0, got {eps}")
    rewards = inputs.rewards.double()
    groups = _groups(rewards, inputs.group_index)
    advantage = rewards - groups.mean[groups.inverse]
    if scale == "group":
        advantage = advantage / (groups.std[groups.inverse] + eps)
    elif scale == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantage = advantage / (batch_std + eps)
    trained = inputs.trained
    token_adv = torch.where(trained, advantage[:, None], 0.0)
    metrics = _reward_metrics(rewards, groups)
    if step_credit:
        token_adv, credited = _step_credit(inputs, groups, token_adv, scale, eps)
        count = int(trained.sum())
        metrics["advantage/frac_tokens_step_credit"] = float(credited.sum()) / count if count else 0.0
    token_adv = token_adv.to(inputs.rewards.dtype)
    metrics["advantage/abs_mean"] = _abs_mean(token_adv, trained)
    return token_adv, metrics


def _step_credit(inputs: AdvantageInputs, groups: _Groups, token_adv: Tensor, scale: str,
                 eps: float) -> tuple[Tensor, Tensor]:
    """``token_adv`` (B, T) float64 with each intermediate token of a step that has a
    reward set to that step's group-relative advantage; and the (B, T) mask of those tokens."""
    if inputs.step_rewards is None:
        raise InvalidArgument(
            "step_rewards", "grpo with step_credit=True needs a (B, S) tensor of step rewards (NaN where none)"
        )
    step = inputs.step_rewards.double()
    known = ~torch.isnan(step)
    values = torch.nan_to_num(step, nan=0.0)
    num_groups, slots = groups.count.shape[0], step.shape[1]
    count = torch.zeros(num_groups, slots, dtype=torch.float64, device=step.device).index_add_(
        0, groups.inverse, known.double()
    )
    mean = torch.zeros_like(count).index_add_(0, groups.inverse, values) / count.clamp(min=1)
    centred = torch.where(known, values - mean[groups.inverse], 0.0)
    squared = torch.zeros_like(count).index_add_(0, groups.inverse, centred**2)
    std = torch.where(count > 1, (squared / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    step_adv = centred
    if scale == "group":
        step_adv = centred / (std[groups.inverse] + eps)
    elif scale == "batch":
        flat = step[known]
        batch_std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
        step_adv = centred / (batch_std + eps)
    step_adv = torch.where(centred == 0, 0.0, step_adv)  # equal same-index rewards: 0, even with eps = 0
    intermediate = inputs.trained & ~inputs.answer
    slot = inputs.segment_index.clamp(min=0, max=slots - 1)
    in_range = inputs.segment_index < slots
    token_known = intermediate & in_range & known.gather(1, slot)
    return torch.where(token_known, step_adv.gather(1, slot), token_adv), token_known


def _calibadv_batch_inputs(batch: "RolloutBatch",
                           settings: "CalibAdvAdvantage") -> tuple[dict[str, Tensor], dict[str, float]]:
    """CalibAdv's step scores ``(B, S)`` of a batch of search rollouts (settings:
    ``f1_threshold``, ``use_gold``, ``similarity_threshold``) and their mean."""
    device = batch.input_ids.device
    step_scores = search_step_scores(batch.rollouts, batch.group_index, batch.segment_index, settings).to(device)
    found_gold = search_step_found_gold(batch.rollouts, step_scores.shape[1]).to(device)
    known = step_scores[~torch.isnan(step_scores)]
    return ({"step_scores": step_scores, "step_found_gold": found_gold},
            {"calibadv/mean_step_score": float(known.mean()) if known.numel() else 0.0})


@register_advantage("calibadv", batch_inputs=_calibadv_batch_inputs)
def calibadv_advantages(
    inputs: AdvantageInputs, *, lambda_: float = 1.0, eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """CalibAdv: soft penalty on intermediate segments, then answer rebalancing.

    rewards (B,), step_scores (B, S) -> token_adv (B, T):

    1. ``A = (R - mean_g) / (std_g + eps)`` (unbiased std, eps = 1e-6 as in the
       authors' fork);
    2. rollouts with ``A < 0``: token of intermediate segment k -> ``A * (1 - s_k)``
       (NaN score -> s_k = 0: the full negative advantage);
    3. per group, over answer-segment tokens: ``P`` = sum of positive, ``N`` = sum
       of |negative| advantages; positives *= ``N / (lambda_ * P)``; if ``P == 0``
       or ``N == 0`` every answer-token advantage of the group becomes 0.
    """
    if not (lambda_ > 0 and math.isfinite(lambda_)):
        raise InvalidArgument("lambda_", f"must be a finite number > 0, got {lambda_}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise InvalidArgument("eps", f"must be a finite number >= 0, got {eps}")
    if inputs.step_scores is None:
        raise InvalidArgument(
            "step_scores",
            "calibadv needs a (B, S) tensor of step scores; give 0 (or NaN) for rollouts without scores",
        )
    rewards = inputs.rewards.double()
    groups = _groups(rewards, inputs.group_index)
    advantage = (rewards - groups.mean[groups.inverse]) / (groups.std[groups.inverse] + eps)

    trained, answer = inputs.trained, inputs.answer
    intermediate = trained & ~answer
    token_adv = torch.where(trained, advantage[:, None], 0.0)

    # (2) soft penalty on the intermediate segments of negative rollouts.
    scores = torch.nan_to_num(inputs.step_scores.double(), nan=0.0)
    slot = inputs.segment_index.clamp(min=0, max=scores.shape[1] - 1)
    token_score = torch.where(intermediate, scores.gather(1, slot), torch.zeros_like(token_adv))
    softened = intermediate & (advantage < 0)[:, None]
    token_adv = torch.where(softened, token_adv * (1 - token_score), token_adv)

    # (3) rebalance the answer segments of each group.
    answer_adv = torch.where(answer, token_adv, torch.zeros_like(token_adv))
    num_groups = groups.count.shape[0]
    positive = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(
        0, groups.inverse, answer_adv.clamp(min=0).sum(dim=1)
    )
    negative = torch.zeros_like(positive).index_add_(0, groups.inverse, (-answer_adv).clamp(min=0).sum(dim=1))
    balanced = (positive > 0) & (negative > 0)
    factor = torch.where(balanced, negative / (lambda_ * positive.clamp(min=torch.finfo(torch.float64).tiny)), 0.0)
    row_balanced = balanced[groups.inverse][:, None]
    row_factor = factor[groups.inverse][:, None]
    answer_scale = torch.where(row_balanced, torch.where(answer_adv > 0, row_factor, 1.0), 0.0)
    token_adv = torch.where(answer, token_adv * answer_scale, token_adv)

    token_adv = token_adv.to(inputs.rewards.dtype)
    trained_count = int(trained.sum())
    metrics = _reward_metrics(rewards, groups)
    metrics["advantage/abs_mean"] = _abs_mean(token_adv, trained)
    reduced = softened & (token_score > 0)
    metrics["calibadv/frac_tokens_softened"] = float(reduced.sum()) / trained_count if trained_count else 0.0
    metrics["calibadv/rebalance_factor"] = float(factor[balanced].mean()) if bool(balanced.any()) else math.nan
    # The rebalance zeroes a group's answers when it has no positive or no negative answer; groups
    # whose rewards are all equal have zero advantages anyway, so only the others count.
    unequal = groups.std > ZERO_STD_ATOL
    zeroed = unequal & ~balanced
    metrics["calibadv/frac_groups_answer_zeroed"] = (float(zeroed.sum()) / int(unequal.sum())
                                                     if bool(unequal.any()) else 0.0)
    metrics.update(_calibadv_interventions(inputs, advantage, token_adv.double(), scores, groups))
    return token_adv, metrics


def _calibadv_interventions(inputs: AdvantageInputs, advantage: Tensor, token_adv: Tensor, scores: Tensor,
                            groups: _Groups) -> dict[str, float]:
    """What CalibAdv changed against the plain group advantage ``A`` (what GRPO would give
    every trained token), per search step and per token kind.

    A search step is an intermediate segment k of a rollout with at least one trained token.
    GRPO penalises every search step of a rollout with ``A < 0`` in full; CalibAdv softens
    those with ``s_k > 0``. With ``step_found_gold`` the steps that retrieved a gold
    document are counted too."""
    trained, answer = inputs.trained, inputs.answer
    intermediate = trained & ~answer
    slots = scores.shape[1]
    rows = torch.arange(advantage.shape[0], device=advantage.device)[:, None].expand_as(intermediate)
    has_step = torch.zeros(advantage.shape[0], slots, dtype=torch.bool, device=advantage.device)
    has_step[rows[intermediate], inputs.segment_index[intermediate]] = True
    negative_steps = has_step & (advantage < 0)[:, None]
    softened_steps = negative_steps & (scores > 0)
    count = int(negative_steps.sum())
    out = {
        "calibadv/neg_search_steps": float(count),
        "calibadv/frac_neg_search_steps_softened": float(softened_steps.sum()) / count if count else 0.0,
    }
    if inputs.step_found_gold is not None:
        found = torch.nan_to_num(inputs.step_found_gold.double(), nan=0.0)[:, :slots] > 0
        if found.shape[1] < slots:
            found = torch.nn.functional.pad(found, (0, slots - found.shape[1]))
        out["calibadv/frac_neg_search_steps_found_gold"] = (
            float((negative_steps & found).sum()) / count if count else 0.0)
        softened = int(softened_steps.sum())
        out["calibadv/frac_softened_found_gold"] = (
            float((softened_steps & found).sum()) / softened if softened else 0.0)
    change = token_adv - torch.where(trained, advantage[:, None], 0.0)
    for key, mask in (("calibadv/adv_change_search", intermediate), ("calibadv/adv_change_answer", answer)):
        tokens = int(mask.sum())
        out[key] = float(change[mask].sum()) / tokens if tokens else 0.0
    return out
