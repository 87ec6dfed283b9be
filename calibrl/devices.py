"""The one rule for turning a ``device`` setting into a torch device name, shared by
the retrieval embedder, the judge's transformers backend and the trainer."""

from __future__ import annotations

import re

from calibrl.errors import InvalidArgument

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cpu``, ``cuda`` and
    ``cuda:N`` are returned as they are once checked (CUDA must be available).
    Raises InvalidArgument naming ``device`` otherwise."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not (device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device)):
        raise InvalidArgument("device", f"{device!r} is not a device; use {DEVICE_CHOICES}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument("device", f"{device!r} asked for CUDA but torch sees no CUDA device; use cpu or auto")
    return device


__all__ = ["DEVICE_CHOICES", "resolve_device"]
