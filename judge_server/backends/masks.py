"""Attention masks laid out for GPU kernels (used by the transformers judge and its
pruned forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

MASK_ALIGN = 16  # elements: a CUDA mask's rows start on a 64-byte (float32) or 32-byte (bfloat16) boundary


def aligned_for_kernels(mask: "Tensor") -> "Tensor":
    """``mask`` itself on the CPU; on a GPU, a copy whose start and row stride are multiples
    of :data:`MASK_ALIGN` elements. PyTorch's cuDNN attention reads the additive mask with
    aligned vector loads: a view that starts part way into a row (as the judge's
    ``SuffixLayout.mask`` returns) or rows of odd width failed on an H200 with "misaligned
    address", which also poisons the CUDA context. The values are the same, so the scores are too."""
    return mask if mask.device.type == "cpu" else aligned_copy(mask)


def aligned_copy(mask: "Tensor") -> "Tensor":
    """A copy of ``mask`` in fresh storage whose rows are :data:`MASK_ALIGN` elements apart
    (zero-padded beyond the last column, which the view hides)."""
    width = mask.shape[-1]
    padded = mask.new_zeros((*mask.shape[:-1], -(-width // MASK_ALIGN) * MASK_ALIGN))
    padded[..., :width] = mask
    return padded[..., :width]


__all__ = ["MASK_ALIGN", "aligned_copy", "aligned_for_kernels"]
