"""Stage 4 of a step: a training batch -> one optimizer update.

:class:`PolicyUpdate` owns the model, its frozen reference, the optimizer and the
schedule. Per step it runs, in order:

- :meth:`PolicyUpdate.forward_without_rewards`: the forward passes that need no
  reward (the reference's log-probs, the policy's first micro-batch), run while
  the rewards are still being computed;
- :meth:`PolicyUpdate.apply`: the clipped surrogate + k3 KL loss over
  ``gradient_accumulation_steps`` micro-batches, the gradient all-reduce
  (multi-process), grad-norm clipping, AdamW and the learning-rate schedule.

:meth:`PolicyUpdate.behaviour_logprobs` gives a batch sampled before this update
(one step off-policy) its behaviour log-probs.

Each micro-batch's loss is weighted by its share of the step's rows
(``sequence_mean``, ``constant``) or trained tokens (``token_mean``) across
micro-batches and ranks, so accumulation and world size never change the objective.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, ContextManager

from calibrl.kernels import math_attention
from calibrl.trainer import distributed as dist_util
from calibrl.trainer.handoff import EarlyForward, MicroBatch, RolloutBatch, TrainingBatch, UpdateResult
from calibrl.trainer.policy import completion_logprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.config import LossConfig, TrainConfig

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- micro-batches


def micro_batches(rows: int, parts: int) -> list[list[int]]:
    """Row indices of ``parts`` near-equal contiguous micro-batches (empty ones dropped)."""
    parts = min(parts, rows)
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts) if bounds[i + 1] > bounds[i]]


def micro_batch(batch: "RolloutBatch", token_adv: "torch.Tensor | None", rows: list[int],
                behaviour_logp: "torch.Tensor | None" = None) -> MicroBatch:
    """Rows ``rows`` (contiguous) of ``batch``, ``token_adv`` and ``behaviour_logp`` (B, L) as a
    :class:`MicroBatch`."""
    rows_slice = slice(rows[0], rows[-1] + 1)
    attn = batch.attention_mask[rows_slice]
    width = int(attn.sum(dim=1).max())
    mask = batch.completion_mask[rows_slice, :width]
    generated = mask.any(dim=0).nonzero()
    start = max(1, int(generated[0])) if generated.numel() else width - 1
    return MicroBatch(
        input_ids=batch.input_ids[rows_slice, :width],
        attention_mask=attn[:, :width],
        start=start,
        mask=mask[:, start:],
        token_adv=None if token_adv is None else token_adv[rows_slice, start:width],
        old_logp=None if behaviour_logp is None else behaviour_logp[rows_slice, start:width],
    )


def micro_logprobs(model: "torch.nn.Module", micro: MicroBatch, temperature: float,
                   with_entropy: bool = False, share_prefix: bool = False) -> "tuple[torch.Tensor, float | None]":
    """Log-probs ``(b, L - start)`` of a micro-batch's tokens from column ``start`` on
    (:func:`calibrl.trainer.policy.completion_logprobs`; ``share_prefix``: a group's prompt
    runs once), and optionally the mean entropy over its generated tokens."""
    logp, entropy = completion_logprobs(model, micro.input_ids, micro.attention_mask, start=micro.start,
                                        temperature=temperature, entropy_mask=micro.mask if with_entropy else None,
                                        share_prefix=share_prefix)
    if entropy is None:
        return logp, None
    count = float(micro.mask.to(entropy.dtype).sum())
    return logp, float(entropy.sum()) / count if count else 0.0


def micro_batch_weight(aggregation: str, mask: "torch.Tensor", rows_total: float, tokens_total: float,
                       world: int) -> float:
    """Factor that turns a micro-batch's aggregated loss into its exact share of the
    step's loss (times world size, since gradients are averaged over ranks): the registered
    aggregation's :meth:`~calibrl.trainer.losses.LossAggregation.share`."""
    from calibrl.trainer.losses import LOSS_AGGREGATIONS  # losses imports torch: not at this module's import

    return LOSS_AGGREGATIONS[aggregation].share(mask, rows_total, tokens_total, world)


def token_weighted_mean(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Each loss metric (but ``policy_loss``) averaged over micro-batches, weighted by their trained tokens."""
    total = sum(tokens for tokens, _ in parts)
    names = sorted({name for _, metrics in parts for name in metrics if name != "policy_loss"})
    out = {}
    for name in names:
        values = [(tokens, metrics[name]) for tokens, metrics in parts if name in metrics]
        out[name] = sum(t * v for t, v in values) / total if total else 0.0
    return out


def reference_perplexity(ref_logps: "list[torch.Tensor | None]", masks: "list[torch.Tensor]") -> dict[str, float]:
    """``policy/ref_ppl``: the perplexity of the generated tokens under the frozen
    reference, ``exp(-mean log p_ref)`` over every micro-batch's completion tokens
    (``ref_logps[i]``, ``masks[i]``: (b, L - start)), at the sampling temperature (the
    log-probs of the KL term). Gibberish the reference would never write drives it up
    (the CalibAdv paper's collapse signal). ``{}`` without a reference (``loss.beta`` = 0
    loads none) or without a generated token."""
    if not ref_logps or any(logp is None for logp in ref_logps):
        return {}
    total, count = 0.0, 0.0
    for logp, mask in zip(ref_logps, masks):
        weights = mask.to(logp.dtype)
        total += float((logp.detach() * weights).sum())
        count += float(weights.sum())
    if not count:
        return {}
    mean = total / count
    return {"policy/ref_ppl": math.exp(min(-mean, 700.0)), "policy/ref_logp_mean": mean}


def policy_loss_for(loss: "LossConfig", max_completion_length: int, logp: "torch.Tensor",
                    old_logp: "torch.Tensor", token_adv: "torch.Tensor", mask: "torch.Tensor",
                    ref_logp: "torch.Tensor | None") -> "tuple[torch.Tensor, dict[str, float]]":
    """``calibrl.trainer.losses.policy_loss`` with the run's loss settings."""
    from calibrl.trainer.losses import policy_loss  # losses imports torch: not at this module's import

    return policy_loss(logp, old_logp, token_adv, mask, ref_logp=ref_logp, beta=loss.beta, eps_low=loss.eps_low,
                       eps_high=loss.eps_high, aggregation=loss.aggregation,
                       max_completion_length=max_completion_length, kl_ratio_correction=loss.kl_ratio_correction)


def apply_update(optimizer: "torch.optim.Optimizer", grad_norm: float) -> bool:
    """``optimizer.step()`` unless the (all-reduced, pre-clip) gradient norm is NaN or
    infinite: one such step would poison AdamW's moments for good. Every rank sees
    the same norm, so every rank skips together. Returns whether it stepped."""
    if not math.isfinite(grad_norm):
        return False
    optimizer.step()
    return True


# --------------------------------------------------------------------------- the update


class PolicyUpdate:
    """The clipped GRPO update of the policy (one job: turn training batches into weights)."""

    def __init__(self, config: "TrainConfig", model: "torch.nn.Module", reference: "torch.nn.Module | None",
                 optimizer: "torch.optim.Optimizer", scheduler: "torch.optim.lr_scheduler.LRScheduler",
                 ctx: dist_util.DistContext, autocast: ContextManager[None], max_completion_length: int) -> None:
        self.config, self.model, self.reference = config, model, reference
        self.optimizer, self.scheduler, self.ctx, self.autocast = optimizer, scheduler, ctx, autocast
        self.max_completion_length = max_completion_length
        self.params = [p for p in model.parameters() if p.requires_grad]
        # FSDP2 frees the gathered weights after each forward pass: one pass per micro-batch there
        sharded = ctx.distributed and config.distributed.strategy == "fsdp"
        self.share_prefix = config.rollout.share_prompt_prefix and not sharded

    def behaviour_logprobs(self, batch: "RolloutBatch") -> "torch.Tensor":
        """``(B, L)`` log-probs of the sampled tokens under the current weights, in
        eval mode like the sampler (no LoRA dropout): the behaviour policy itself."""
        import torch

        old = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
        was_training = self.model.training
        self.model.eval()
        try:
            for rows in micro_batches(len(batch), self.config.gradient_accumulation_steps):
                micro = micro_batch(batch, None, rows)
                with torch.no_grad(), self.autocast:
                    logp, _ = micro_logprobs(self.model, micro, self.config.rollout.temperature,
                                             share_prefix=self.share_prefix)
                old[rows[0] : rows[-1] + 1, micro.start : micro.start + logp.shape[1]] = logp.float()
        finally:
            self.model.train(was_training)
        return old

    def forward_without_rewards(self, batch: "RolloutBatch") -> EarlyForward:
        """The reference's log-probs of every micro-batch and the policy's forward pass
        of the first (peak memory is unchanged: one graph)."""
        import torch

        temperature = self.config.rollout.temperature
        parts = micro_batches(len(batch), self.config.gradient_accumulation_steps)
        ref_logps, masks = [], []
        for rows in parts:
            ref_logp, micro = None, micro_batch(batch, None, rows)
            if self.reference is not None:
                with torch.no_grad(), self.autocast:
                    ref_logp, _ = micro_logprobs(self.reference, micro, temperature, share_prefix=self.share_prefix)
            ref_logps.append(ref_logp)
            masks.append(micro.mask)
        with self.autocast:
            first = micro_logprobs(self.model, micro_batch(batch, None, parts[0]), temperature, with_entropy=True,
                                   share_prefix=self.share_prefix)
        return EarlyForward(parts, ref_logps, first, reference_perplexity(ref_logps, masks))

    def apply(self, training: "TrainingBatch", early: EarlyForward) -> UpdateResult:
        """Loss and backward over the micro-batches, then one optimizer step."""
        loss_value, loss_metrics = self._backward(training, early)
        grad_norm = self._clip_gradients()
        learning_rate = self.scheduler.get_last_lr()[0]
        stepped = apply_update(self.optimizer, grad_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "learning_rate": learning_rate,
                   **token_weighted_mean(loss_metrics), **early.reference_metrics}
        return UpdateResult(metrics, stepped)

    def _backward(self, training: "TrainingBatch", early: EarlyForward) -> tuple[float, list[tuple[float, dict]]]:
        batch, config = training.batch, self.config
        rows_total, tokens_total = dist_util.all_reduce_sum([len(batch), float(batch.completion_mask.sum())], self.ctx)
        loss_metrics: list[tuple[float, dict[str, float]]] = []
        loss_value = 0.0
        for n, (rows, ref_logp) in enumerate(zip(early.parts, early.ref_logps)):
            micro = micro_batch(batch, training.token_adv, rows, training.behaviour_logp)
            if n == 0:
                # EarlyForward is frozen: it keeps this logp until the step ends, but the backward
                # below frees the graph's saved tensors (retain_graph=False), so only (b, L) floats stay
                logp, entropy = early.first
            else:
                with self.autocast:
                    logp, entropy = micro_logprobs(self.model, micro, config.rollout.temperature, with_entropy=True,
                                                    share_prefix=self.share_prefix)
            old_logp = logp.detach() if micro.old_logp is None else micro.old_logp
            loss, metrics = policy_loss_for(config.loss, self.max_completion_length, logp, old_logp,
                                            micro.token_adv, micro.mask, ref_logp)
            weight = micro_batch_weight(config.loss.aggregation, micro.mask, rows_total, tokens_total,
                                        self.ctx.world_size)
            (loss * weight).backward()
            metrics["entropy"] = entropy
            loss_metrics.append((float(micro.mask.sum()), metrics))
            loss_value += float(loss.detach()) * weight  # averaged over ranks by the step log: the step's loss
        return loss_value, loss_metrics

    def _clip_gradients(self) -> float:
        """All-reduce (DDP) and clip the gradients; returns the pre-clip norm."""
        import torch

        if self.config.distributed.strategy == "ddp":
            dist_util.all_reduce_gradients(self.params, self.ctx)
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))


def autocast_for(config: "TrainConfig", device: str) -> ContextManager[None]:
    """bf16 autocast when ``precision`` asks for it (``auto``: on CUDA), else a no-op.
    On CPU, attention also runs through SDPA's math kernel (:class:`CpuBf16Autocast`)."""
    import torch

    if not use_bf16(config, device):
        return contextlib.nullcontext()
    if device.startswith("cuda"):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return CpuBf16Autocast()


class CpuBf16Autocast:
    """bf16 autocast on CPU with ``scaled_dot_product_attention`` on its math kernel
    (:func:`calibrl.kernels.math_attention`: torch's CPU flash kernel fails for bf16 on an
    AMX processor whose ATen kernels are held below AVX-512). Re-entrant: each ``with``
    opens its own autocast and kernel choice (the update enters one context per pass)."""

    def __init__(self) -> None:
        self._open: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(math_attention())
        stack.enter_context(torch.autocast(device_type="cpu", dtype=torch.bfloat16))
        self._open.append(stack)

    def __exit__(self, *exc_info: object) -> None:
        self._open.pop().__exit__(*exc_info)


def use_bf16(config: "TrainConfig", device: str) -> bool:
    """Whether the run computes in bfloat16 (``precision=bf16``, or ``auto`` on CUDA)."""
    if config.precision == "bf16":
        return True
    return config.precision == "auto" and device.startswith("cuda")


__all__ = [
    "CpuBf16Autocast", "EarlyForward", "MicroBatch", "PolicyUpdate", "UpdateResult", "apply_update", "autocast_for",
    "micro_batch", "micro_batch_weight", "micro_batches", "micro_logprobs", "policy_loss_for", "reference_perplexity",
    "token_weighted_mean", "use_bf16",
]
