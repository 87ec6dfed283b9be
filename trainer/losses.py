"""The clipped GRPO policy loss and the per-token quantities it needs.

Pure tensor functions; shapes: ``B`` sequences, ``T`` completion positions,
``V`` vocabulary.

Per token (TRL ``GRPOTrainer``, token-level importance sampling)::

    r    = exp(logp - old_logp)
    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * KL_k3
    KL_k3 = exp(ref - logp) - (ref - logp) - 1          (Schulman's k3 estimator)

Aggregation over the trained tokens (``mask``):

* ``sequence_mean``: mean over each sequence's tokens, then over sequences
  (TRL ``loss_type="grpo"``);
* ``token_mean``: sum over all tokens / number of tokens (TRL ``"bnpo"``, and
  ``"dapo"`` when the batch is the whole accumulated batch);
* ``constant``: sum / (B * max_completion_length) (TRL ``"dr_grpo"``, Dr. GRPO).

Each aggregation is registered (:data:`LOSS_AGGREGATIONS`, :func:`register_loss_aggregation`)
with both halves of what it means: how a micro-batch's tokens become one loss, and that
loss's share of the step under gradient accumulation (its rows, or its trained tokens:
:meth:`LossAggregation.share`, which ``calibrl.trainer.update.micro_batch_weight`` applies;
TRL folds it into the loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from calibrl.errors import InvalidArgument

__all__ = [
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "register_loss_aggregation",
    "masked_entropy_from_logits",
    "policy_loss",
    "token_logprobs",
]



@dataclass(frozen=True)
class LossAggregation:
    """One way to aggregate the per-token losses (registered by ``name``)."""

    name: str
    # (per_token * weights, weights, max_completion_length) -> the scalar loss; all (B, T) but the last
    reduce: Callable[[Tensor, Tensor, "int | None"], Tensor]
    per_token: bool  # a micro-batch's share of the step is its trained tokens (True) or its rows
    needs_max_completion_length: bool = False

    def share(self, mask: Tensor, rows_total: float, tokens_total: float, world: int) -> float:
        """Factor that turns a micro-batch's aggregated loss into its exact share of the
        step's loss (times world size, since gradients are averaged over ranks)."""
        if self.per_token:
            return float(mask.sum()) * world / max(tokens_total, 1.0)
        return mask.shape[0] * world / rows_total


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def register_loss_aggregation(aggregation: LossAggregation) -> LossAggregation:
    """Add ``aggregation`` to the registry (a second one of the same name is an error)."""
    if aggregation.name in LOSS_AGGREGATIONS and LOSS_AGGREGATIONS[aggregation.name] is not aggregation:
        raise InvalidArgument("name", f"loss aggregation {aggregation.name!r} is already registered")
    LOSS_AGGREGATIONS[aggregation.name] = aggregation
    return aggregation


register_loss_aggregation(LossAggregation(
    "sequence_mean", lambda masked, weights, _: (masked.sum(dim=-1) / weights.sum(dim=-1).clamp(min=1.0)).mean(),
    per_token=False))
register_loss_aggregation(LossAggregation(
    "token_mean", lambda masked, weights, _: masked.sum() / weights.sum().clamp(min=1.0), per_token=True))
register_loss_aggregation(LossAggregation(
    "constant", lambda masked, weights, max_length: masked.sum() / (masked.shape[0] * max_length), per_token=False,
    needs_max_completion_length=True))

# Rows of (B*T, V) logits processed at once by the chunked helpers: bounds the
# float32 temporaries to about ROWS_PER_CHUNK * V * 4 bytes.
ROWS_PER_CHUNK = 1024


def _check_same_shape(name: str, tensor: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise InvalidArgument(name, f"must have shape {shape} like logp, got {tuple(tensor.shape)}")


def _weights(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``mask`` (bool or 0/1 numbers) as a 0/1 tensor of ``dtype``."""
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidArgument("mask", "must be a bool tensor or hold only 0 and 1")
    return mask.to(dtype)


def _check_loss_args(
    logp: Tensor,
    others: dict[str, Tensor | None],
    beta: float,
    eps_low: float,
    eps_high: float,
    ref_logp: Tensor | None,
) -> None:
    if logp.dim() != 2:
        raise InvalidArgument("logp", f"must be a 2-D (B, T) tensor, got shape {tuple(logp.shape)}")
    for name, tensor in others.items():
        if tensor is not None:
            _check_same_shape(name, tensor, tuple(logp.shape))
    if not 0.0 <= eps_low < 1.0:
        raise InvalidArgument("eps_low", f"must be in [0, 1) so that 1 - eps_low > 0, got {eps_low}")
    if not (0.0 <= eps_high and math.isfinite(eps_high)):
        raise InvalidArgument("eps_high", f"must be a finite number >= 0, got {eps_high}")
    if not (beta >= 0.0 and math.isfinite(beta)):
        raise InvalidArgument("beta", f"must be a finite number >= 0, got {beta}")
    if beta > 0.0 and ref_logp is None:
        raise InvalidArgument("ref_logp", f"is required when beta > 0 (beta={beta})")


def _per_token_terms(
    logp: Tensor,
    old_logp: Tensor,
    token_adv: Tensor,
    ref_logp: Tensor | None,
    beta: float,
    eps_low: float,
    eps_high: float,
    kl_ratio_correction: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(per-token loss, ratio, KL term or None), all (B, T)."""
    ratio = torch.exp(logp - old_logp.detach())
    token_adv = token_adv.detach().to(logp.dtype)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.min(ratio * token_adv, clipped_ratio * token_adv)
    kl = None
    if ref_logp is not None:
        ref_minus_logp = ref_logp.detach() - logp
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
        if kl_ratio_correction:
            kl = kl * ratio
        if beta > 0.0:
            per_token = per_token + beta * kl
    return per_token, ratio, kl


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    token_adv: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: str = "sequence_mean",
    max_completion_length: int | None = None,
    kl_ratio_correction: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss with an optional k3 KL penalty to a reference policy.

    logp, old_logp, token_adv, mask, ref_logp: (B, T). ``logp`` carries the
    gradient; ``old_logp``, ``token_adv`` and ``ref_logp`` are constants.
    ``kl_ratio_correction`` multiplies the k3 term by the ratio ``r`` (the
    DeepSeek-V3.2 unbiased reverse-KL gradient; TRL's
    ``use_bias_correction_kl``, on by default there, off here as in the
    reference semantics).
    Returns the scalar loss and metrics: ``policy_loss``, ``kl`` (masked mean of
    the KL term, k3 or ``r * k3`` with the correction, when ``ref_logp`` is
    given), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean`` (share of tokens whose ratio is clipped in the
    direction of their advantage: below ``1 - eps_low`` with ``A < 0``, above
    ``1 + eps_high`` with ``A > 0``).
    """
    _check_loss_args(logp, {"old_logp": old_logp, "token_adv": token_adv, "mask": mask, "ref_logp": ref_logp},
                     beta, eps_low, eps_high, ref_logp)
    if aggregation not in LOSS_AGGREGATIONS:
        raise InvalidArgument("aggregation", f"must be one of {tuple(LOSS_AGGREGATIONS)}, got {aggregation!r}")
    reduction = LOSS_AGGREGATIONS[aggregation]
    if reduction.needs_max_completion_length:
        if not isinstance(max_completion_length, int) or isinstance(max_completion_length, bool) \
                or max_completion_length < 1:
            raise InvalidArgument(
                "max_completion_length",
                f"must be a positive int with aggregation='constant', got {max_completion_length!r}",
            )

    weights = _weights(mask, logp.dtype)
    per_token, ratio, kl = _per_token_terms(logp, old_logp, token_adv, ref_logp, beta, eps_low, eps_high,
                                            kl_ratio_correction)
    token_count = weights.sum()
    masked = per_token * weights
    loss = reduction.reduce(masked, weights, max_completion_length)

    with torch.no_grad():
        denominator = token_count.clamp(min=1.0)

        def masked_mean(values: Tensor) -> float:
            return float((values.to(weights.dtype) * weights).sum() / denominator)

        low = (ratio < 1.0 - eps_low) & (token_adv < 0)
        high = (ratio > 1.0 + eps_high) & (token_adv > 0)
        metrics = {
            "policy_loss": float(loss.detach()),
            "clip_ratio/low_mean": masked_mean(low),
            "clip_ratio/high_mean": masked_mean(high),
            "clip_ratio/region_mean": masked_mean(low | high),
        }
        if kl is not None:
            metrics["kl"] = masked_mean(kl.detach())
    return loss, metrics


def _check_logits(logits: Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise InvalidArgument("logits", f"must be a 3-D (B, T, V) tensor, got shape {tuple(logits.shape)}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InvalidArgument("temperature", f"must be a finite number > 0, got {temperature}")


def token_logprobs(logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probability of each token under its (already shifted) logits.

    logits: (B, T, V), ``logits[:, t]`` being the prediction for
    ``token_ids[:, t]``; token_ids: (B, T) integer. Returns (B, T) float32
    (float64 for float64 logits), differentiable w.r.t. ``logits``. Computed
    as ``logit[token] - logsumexp(logits)`` in row chunks, upcast to float32
    per chunk, so no full (B, T, V) log-softmax copy is materialised.
    ``temperature`` divides the logits first (TRL's sampling temperature).
    """
    _check_logits(logits, temperature)
    if token_ids.shape != logits.shape[:2] or token_ids.dtype.is_floating_point:
        raise InvalidArgument(
            "token_ids", f"must be an integer tensor of shape {tuple(logits.shape[:2])}, got {tuple(token_ids.shape)}"
        )
    vocab = logits.shape[-1]
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        raise InvalidArgument("token_ids", f"must lie in [0, {vocab}) (the vocabulary of logits)")
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat_logits = logits.reshape(-1, vocab)
    flat_ids = token_ids.reshape(-1, 1)
    pieces = []
    for start in range(0, flat_logits.shape[0], ROWS_PER_CHUNK):
        chunk = flat_logits[start:start + ROWS_PER_CHUNK].to(out_dtype)
        if temperature != 1.0:
            chunk = chunk / temperature
        chosen = chunk.gather(-1, flat_ids[start:start + ROWS_PER_CHUNK]).squeeze(-1)
        pieces.append(chosen - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return logits.new_zeros(token_ids.shape, dtype=out_dtype)
    return torch.cat(pieces).reshape(token_ids.shape)


def masked_entropy_from_logits(
    logits: Tensor, mask: Tensor, *, temperature: float = 1.0, with_grad: bool = False
) -> tuple[Tensor, float]:
    """Entropy of each position's next-token distribution, and its masked mean.

    logits: (B, T, V); mask: (B, T) bool or 0/1. Returns ``entropy`` (B, T)
    float32 (0 where ``mask`` is False) and the mean over masked positions
    (0.0 when none). Computed in row chunks, upcast to float32 per chunk; under
    ``torch.no_grad`` unless ``with_grad`` (an entropy bonus needs the graph,
    a diagnostic does not).
    """
    _check_logits(logits, temperature)
    if tuple(mask.shape) != tuple(logits.shape[:2]):
        raise InvalidArgument("mask", f"must have shape {tuple(logits.shape[:2])} like logits[..., 0]")
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    pieces = []
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        for start in range(0, flat_logits.shape[0], ROWS_PER_CHUNK):
            chunk = flat_logits[start:start + ROWS_PER_CHUNK].to(out_dtype)
            if temperature != 1.0:
                chunk = chunk / temperature
            log_norm = torch.logsumexp(chunk, dim=-1, keepdim=True)
            probs = torch.exp(chunk - log_norm)
            pieces.append(log_norm.squeeze(-1) - (probs * chunk).sum(dim=-1))
        if pieces:
            entropy = torch.cat(pieces).reshape(mask.shape)
        else:
            entropy = logits.new_zeros(mask.shape, dtype=out_dtype)
        weights = _weights(mask, entropy.dtype).to(entropy.device)
        entropy = torch.where(weights > 0, entropy, torch.zeros_like(entropy))
    count = float(weights.sum())
    mean = float(entropy.detach().sum()) / count if count else 0.0
    return entropy, mean
