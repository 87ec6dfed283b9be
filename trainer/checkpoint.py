"""Checkpoints that resume a run exactly.

A checkpoint folder ``<output_dir>/checkpoints/step_000012/`` holds::

    model/            the policy in Hugging Face format (full weights, or only the
                      LoRA adapter) plus its tokenizer: `calibrl eval --model` loads it
    optimizer.pt      AdamW state
    scheduler.pt      learning-rate schedule state
    rng_rank<r>.pt    python, numpy, torch and CUDA generator states of rank r
    pending_rank<r>.pt  (one step off-policy runs) rank r's rollouts already
                      generated for the next step, their behaviour log-probs and,
                      once in, their rewards
    state.json        step, data position, counters, world size
    config.yaml       the full training config of the run

It is written to a temporary folder and renamed into place, so a run killed
while saving never leaves a half checkpoint that looks complete. Resuming loads
the base policy from the config as usual (the frozen reference comes from it),
then overwrites the trainable weights, the optimizer, the schedule, the RNG
states and the data position: the next step is bitwise the step the
uninterrupted run would have taken (on CPU; CUDA kernels may not be
deterministic).
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, TypedDict

from calibrl.errors import NotFound
from calibrl.fileperms import honour_umask

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.rollout import RolloutBatch

STATE_FILE = "state.json"
MODEL_DIR = "model"
STAGING_SUFFIX = ".tmp"  # a checkpoint is written here, then renamed into place


@dataclass
class TrainState:
    """What the loop needs besides tensors to continue where it stopped."""

    step: int = 0  # steps completed
    data_position: dict[str, int] = field(default_factory=dict)  # TaskOrder.state()
    warnings_total: int = 0
    skipped_updates: int = 0  # steps whose gradient norm was not finite
    world_size: int = 1
    reason: str = ""  # why it was written: interval, sigterm, reward_error, final
    rubric_weight_scale: float = 1.0  # review.on_alarm=downweight: the factor in force (calibrl.trainer.rubric_weight)
    downweighted_versions: list[str] = field(default_factory=list)  # the rubric versions it was lowered for


def _is_finished(folder: pathlib.Path) -> bool:
    """A checkpoint renamed into place; a staging folder (``*.tmp``) may hold a state
    file while other files are still missing, so it never counts."""
    return not folder.name.endswith(STAGING_SUFFIX) and (folder / STATE_FILE).exists()


def checkpoint_dir(output_dir: str | pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def find_checkpoint(path: str | pathlib.Path) -> pathlib.Path:
    """``path`` itself when it is a checkpoint, else the latest one under it (a run's
    output dir or its ``checkpoints/`` folder)."""
    path = pathlib.Path(path)
    if path.name.endswith(STAGING_SUFFIX):
        raise NotFound(f"{path} is a checkpoint still being written (or cut off while written); "
                       f"resume from a folder without {STAGING_SUFFIX}")
    if (path / STATE_FILE).exists():
        return path
    for folder in (path / "checkpoints", path):
        candidates = sorted(p for p in folder.glob("step_*") if _is_finished(p))
        if candidates:
            return candidates[-1]
    raise NotFound(f"no checkpoint at {path} (expected a folder with {STATE_FILE}, or a run dir with checkpoints/)")


# --------------------------------------------------------------------------- RNG


class RngState(TypedDict, total=False):
    """One rank's generator states (``rng_rank{N}.pt``)."""

    python: tuple[object, ...]  # random.getstate()
    numpy: "dict[str, Any] | tuple[str, np.ndarray, int, int, float]"  # np.random.get_state()
    torch: "torch.Tensor"  # torch.get_rng_state()
    cuda: "list[torch.Tensor]"  # one per visible GPU, when CUDA is initialised


class SavedPending(TypedDict):
    """Rollouts already taken for the next step (``pending_rank{N}.pt``; see
    :meth:`calibrl.trainer.handoff.PendingBatch.to_saved`)."""

    step: int
    batch: "RolloutBatch"  # tensors on the CPU
    breakdowns: "list[RewardBreakdown] | None"  # None when the scores were not in yet
    data_position: dict[str, int]
    behaviour_logp: "torch.Tensor | None"  # (B, L) on the CPU when sampled before the last update, else None


def rng_state() -> RngState:
    import numpy as np
    import torch

    state: RngState = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: RngState) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save / load


def save_checkpoint(
    directory: str | pathlib.Path,
    *,
    model: "torch.nn.Module",
    tokenizer: "PreTrainedTokenizerBase",
    optimizer: "torch.optim.Optimizer",
    scheduler: "torch.optim.lr_scheduler.LRScheduler",
    state: TrainState,
    config_yaml: str,
    rank: int = 0,
    rng: RngState | None = None,
    pending: SavedPending | None = None,
    full_model_state: "dict[str, torch.Tensor] | None" = None,
    optimizer_state: dict[str, object] | None = None,
) -> pathlib.Path:
    """Write a checkpoint. Every rank calls it (each writes its RNG state and its
    ``pending`` rollouts, if any); rank 0 writes the rest. ``rng`` is this rank's RNG state to store (default: the
    current one). ``full_model_state`` / ``optimizer_state`` are given when the
    model is sharded (FSDP) and the caller gathered them; otherwise they are read
    from ``model`` and ``optimizer``. Returns the final folder."""
    import torch

    directory = pathlib.Path(directory)
    staging = directory.with_name(directory.name + STAGING_SUFFIX)
    if rank == 0:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    _barrier()
    torch.save(rng if rng is not None else rng_state(), staging / f"rng_rank{rank}.pt")
    if pending is not None:
        torch.save(pending, staging / f"pending_rank{rank}.pt")
    if rank == 0:
        model_dir = staging / MODEL_DIR
        if full_model_state is None:
            model.save_pretrained(model_dir, safe_serialization=True)
        else:
            model.save_pretrained(model_dir, state_dict=full_model_state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)
        honour_umask(model_dir)  # safetensors writes 0600
        torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(scheduler.state_dict(), staging / "scheduler.pt")
        (staging / "config.yaml").write_text(config_yaml, encoding="utf-8")
        (staging / STATE_FILE).write_text(json.dumps(asdict(state), indent=2), encoding="utf-8")
    _barrier()
    if rank == 0:
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    _barrier()
    return directory


def load_train_state(directory: str | pathlib.Path) -> TrainState:
    data = json.loads((pathlib.Path(directory) / STATE_FILE).read_text(encoding="utf-8"))
    return TrainState(**data)


def load_model_weights(directory: str | pathlib.Path, model: "torch.nn.Module") -> None:
    """Overwrite ``model``'s trainable weights with those saved in a checkpoint."""
    from safetensors.torch import load_file

    model_dir = pathlib.Path(directory) / MODEL_DIR
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.exists():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(str(adapter)))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise NotFound(f"{adapter}: adapter keys not in the model: {unexpected[:5]}")
        return
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise NotFound(f"{model_dir}: no safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained drops tied duplicates (e.g. lm_head tied to the embeddings).
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not _is_tied_alias(model, k, state)]
    if unexpected or really_missing:
        raise NotFound(
            f"{model_dir}: weights do not match the model (missing {really_missing[:5]}, unexpected {unexpected[:5]})"
        )


def _is_tied_alias(model: "torch.nn.Module", key: str, state: "Mapping[str, torch.Tensor]") -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    if target is None:
        return False
    return any(p is target for name, p in params.items() if name in state)


def load_optimizer_and_schedule(directory: str | pathlib.Path, optimizer: "torch.optim.Optimizer",
                                scheduler: "torch.optim.lr_scheduler.LRScheduler") -> dict[str, object]:
    """Restore the scheduler; return the optimizer state (the caller loads it, since a
    sharded optimizer needs the distributed loader)."""
    import torch

    directory = pathlib.Path(directory)
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
    return torch.load(directory / "optimizer.pt", weights_only=False)


def load_rng(directory: str | pathlib.Path, rank: int) -> None:
    import torch

    path = pathlib.Path(directory) / f"rng_rank{rank}.pt"
    if not path.exists():
        raise NotFound(f"{path}: no RNG state for rank {rank}; resume with the world size the run was saved with")
    set_rng_state(torch.load(path, weights_only=False))


def load_pending(directory: str | pathlib.Path, rank: int) -> SavedPending | None:
    """The rollouts rank ``rank`` had already generated for the next step (a run one
    step off-policy), or None when the checkpoint holds none."""
    import torch

    path = pathlib.Path(directory) / f"pending_rank{rank}.pt"
    if not path.exists():
        return None
    return torch.load(path, weights_only=False)


def prune_checkpoints(output_dir: str | pathlib.Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (0 keeps all)."""
    if keep <= 0:
        return
    folder = pathlib.Path(output_dir) / "checkpoints"
    done = sorted(p for p in folder.glob("step_*") if _is_finished(p))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
