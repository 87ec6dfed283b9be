"""Log-probabilities of whole sequences, for the tests and benchmarks that compare a model's
every position (the trainer itself reads only completion positions, with
:func:`calibrl.trainer.policy.completion_logprobs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from calibrl.trainer.policy import completion_logprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch


def sequence_logprobs(
    model: "torch.nn.Module",
    input_ids: "torch.Tensor",
    attention_mask: "torch.Tensor",
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """:func:`~calibrl.trainer.policy.completion_logprobs` over every position: ``logp`` (B, L) with
    ``logp[:, 0] = 0`` (and with ``return_entropy`` the entropy (B, L), 0 at t = 0).
    Values at padded positions are meaningless; mask them."""
    import torch

    entropy_mask = torch.ones(input_ids.shape[0], max(input_ids.shape[1] - 1, 0), dtype=torch.bool,
                              device=input_ids.device) if return_entropy else None
    logp, entropy = completion_logprobs(model, input_ids, attention_mask, start=1, temperature=temperature,
                                        entropy_mask=entropy_mask)
    zeros = torch.zeros((input_ids.shape[0], 1), dtype=logp.dtype, device=logp.device)
    logp = torch.cat([zeros, logp], dim=1)
    if not return_entropy:
        return logp
    return logp, torch.cat([zeros, entropy.to(logp.dtype)], dim=1)


__all__ = ["sequence_logprobs"]
