"""Multi-process training: ranks, prompt shards, gradient all-reduce, FSDP.

Launch with torchrun; every rank runs the same loop::

    torchrun --nproc_per_node 2 -m calibrl train --config configs/rewriter_grpo.yaml

Each rank generates and scores its own shard of the step's prompts (whole groups,
so group baselines never cross ranks). After the backward pass the gradients are
averaged over ranks (``distributed.strategy=ddp``: one flat all-reduce per step)
or reduce-scattered by FSDP2 (``strategy=fsdp``: weights, gradients and optimizer
state sharded). gloo on CPU (both tested), NCCL on GPU.
Rank 0 logs and writes checkpoints; every rank saves its own RNG state.

The ddp strategy all-reduces by hand instead of wrapping the model in
``DistributedDataParallel``: the policy is also used for generation and for
reference log-probs outside the wrapper, and an explicit all-reduce after the
accumulation steps keeps that simple and exact.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, ValueType

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""  # "" when not distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> DistContext:
    """Join the process group torchrun describes in the environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); a single process when absent."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if on_gpu else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend)


def close_distributed(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_device(device: str, ctx: DistContext) -> str:
    """``cuda`` (or ``auto`` on a GPU machine) becomes ``cuda:<local_rank>`` so each
    rank owns one GPU."""
    if ctx.distributed and (device == "cuda" or (device == "auto" and ctx.backend == "nccl")):
        return f"cuda:{ctx.local_rank}"
    return device


# --------------------------------------------------------------------------- data order


class TaskOrder:
    """A deterministic stream of task indices: a fresh permutation each epoch,
    drawn from its own generator (seeded by seed and epoch), never from the global
    RNG, so generation sampling and data order do not disturb each other. Its
    position is two integers, saved in checkpoints."""

    def __init__(self, num_tasks: int, seed: int, shuffle: bool = True) -> None:
        if num_tasks <= 0:
            raise ValueError("TaskOrder needs at least one task")
        self.num_tasks = num_tasks
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_tasks))
        import numpy as np

        rng = np.random.default_rng([self.seed, epoch])
        return [int(i) for i in rng.permutation(self.num_tasks)]

    def take(self, count: int) -> list[int]:
        """The next ``count`` task indices (crossing into the next epoch as needed)."""
        out: list[int] = []
        while len(out) < count:
            if self.offset >= self.num_tasks:
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.num_tasks - self.offset)
            out.extend(self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_tasks": self.num_tasks, "seed": self.seed}

    def load_state(self, state: Mapping[str, int]) -> None:
        if state.get("num_tasks", self.num_tasks) != self.num_tasks:
            raise ValueError(
                f"checkpoint data position is for {state['num_tasks']} tasks but the run has {self.num_tasks}; "
                "resume with the same tasks file"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._permutation(self.epoch)


def shard(items: Sequence[T], ctx: DistContext) -> list[T]:
    """This rank's contiguous share of ``items`` (len(items) must divide evenly)."""
    if len(items) % ctx.world_size:
        raise ValueError(f"{len(items)} items do not split evenly over {ctx.world_size} ranks")
    per_rank = len(items) // ctx.world_size
    return list(items[ctx.rank * per_rank : (ctx.rank + 1) * per_rank])


# --------------------------------------------------------------------------- collectives


def all_reduce_gradients(parameters: Iterable["torch.nn.Parameter"], ctx: DistContext) -> None:
    """Average the gradients of ``parameters`` over ranks, in one flat buffer."""
    if not ctx.distributed:
        return
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.requires_grad]
    if any(g is None for g in grads):
        # A rank whose shard left a parameter unused still contributes a zero.
        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= ctx.world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Element-wise sum of a short list of numbers over ranks."""
    if not ctx.distributed:
        return [float(v) for v in values]
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def reduce_metrics(metrics: Mapping[str, float], ctx: DistContext) -> dict[str, float]:
    """Average each metric over ranks; names whose last part has a ``min`` or ``max``
    word (``completions/max_length``, ``clip_ratio/low_min``) take the min or max.
    A key missing on some rank is averaged over the ranks that have it."""
    if not ctx.distributed:
        return dict(metrics)
    import torch
    import torch.distributed as dist

    names: list[list[str]] = [[] for _ in range(ctx.world_size)]
    dist.all_gather_object(names, sorted(metrics))
    keys = sorted({k for ks in names for k in ks})
    present = torch.tensor([1.0 if k in metrics else 0.0 for k in keys], dtype=torch.float64)
    values = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    sums = values * present
    mins = torch.where(present > 0, values, torch.full_like(values, float("inf")))
    maxs = torch.where(present > 0, values, torch.full_like(values, float("-inf")))
    dist.all_reduce(sums)
    dist.all_reduce(present)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
    out: dict[str, float] = {}
    for i, key in enumerate(keys):
        words = key.rsplit("/", 1)[-1].split("_")
        if "min" in words:
            out[key] = mins[i].item()
        elif "max" in words:
            out[key] = maxs[i].item()
        else:
            out[key] = (sums[i] / present[i].clamp(min=1)).item()
    return out


def check_in_sync(parameters: Iterable["torch.nn.Parameter"], ctx: DistContext) -> None:
    """Raise when the ranks' copies of the trainable weights differ (a missed or
    mismatched all-reduce would let them drift apart silently)."""
    if not ctx.distributed:
        return
    import torch
    import torch.distributed as dist

    checksum = torch.zeros(2, dtype=torch.float64)
    for p in parameters:
        if p.requires_grad:
            data = p.detach().double()
            checksum[0] += data.sum().cpu()
            checksum[1] += data.abs().sum().cpu()
    gathered = [torch.zeros_like(checksum) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, checksum)
    if any(not torch.equal(gathered[0], other) for other in gathered[1:]):
        raise RuntimeError(f"trainable weights differ across ranks (checksums {[g.tolist() for g in gathered]})")


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when ``flag`` is true on any rank (e.g. SIGTERM seen)."""
    if not ctx.distributed:
        return flag
    return all_reduce_sum([1.0 if flag else 0.0], ctx)[0] > 0


# --------------------------------------------------------------------------- FSDP (GPU)


def apply_fsdp(model: "torch.nn.Module", ctx: DistContext, mixed_precision: bool) -> "torch.nn.Module":
    """Shard ``model`` with FSDP2 (``fully_shard``): each decoder layer, then the root.
    Used for ``distributed.strategy=fsdp``; the model stays the same object."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    # Allocate the all-gather buffers once outside inference mode: the engines
    # generate under torch.inference_mode, and buffers first created there would be
    # inference tensors that the training forward may not write into.
    from torch.distributed.fsdp import FSDPModule

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
                module.reshard()
    return model


def full_state_dicts(model: "torch.nn.Module",
                     optimizer: "torch.optim.Optimizer") -> "tuple[dict[str, ValueType], OptimizerStateType]":
    """Gathered (unsharded, on CPU) model and optimizer state of an FSDP model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def load_full_optimizer_state(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer",
                              state: "OptimizerStateType") -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
