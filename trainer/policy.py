"""The policy: a Hugging Face causal LM loaded from a local folder, its frozen
reference, and per-token log-probabilities.

- :func:`load_policy` loads any ``AutoModelForCausalLM`` folder (or a folder
  holding a peft LoRA adapter, whose base it finds from ``adapter_config.json``),
  optionally wraps it in a fresh LoRA adapter (:class:`LoraSettings`, needs
  ``peft``) and turns on gradient checkpointing. Nothing is downloaded.
- :func:`make_reference` gives the frozen model of the KL term: a deep copy in
  eval mode with gradients off, or, for a LoRA policy, a view of the same base
  with the adapters disabled (no second copy of the weights).
- :func:`completion_logprobs` is the one place log-probabilities are computed, for
  the policy, its behaviour copy and the reference alike.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import pathlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from calibrl.devices import resolve_device as device_name
from calibrl.errors import ConfigError, InvalidArgument, NotFound
from calibrl.kernels import cpu_half_precision

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedTokenizerBase
    from transformers.utils import ModelOutput
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoraSettings:
    """A fresh LoRA adapter on the policy (peft)."""

    r: int = 16  # adapter rank
    alpha: int = 32  # scaling numerator: the update is scaled by alpha / r
    dropout: float = 0.05  # dropout on the adapter input
    target_modules: tuple[str, ...] | str = "all-linear"  # module names, or peft's "all-linear"

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidArgument("lora.r", f"must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise InvalidArgument("lora.alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidArgument("lora.dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise InvalidArgument("lora.target_modules", "must name at least one module (or 'all-linear')")


@dataclass
class Policy:
    """The trained model and what is needed to talk to it."""

    model: "torch.nn.Module"  # transformers PreTrainedModel, or a peft PeftModel around one
    tokenizer: "PreTrainedTokenizerBase"
    device: "torch.device | str"  # torch.device
    model_id: str  # the folder the weights came from (the vLLM engine loads it too)
    lora: LoraSettings | None = field(default=None)

    @property
    def is_lora(self) -> bool:
        return _is_peft(self.model)


# --------------------------------------------------------------------------- loading


def resolve_device(device: str = "auto") -> "torch.device":
    """``calibrl.devices.resolve_device`` as a ``torch.device``."""
    import torch

    return torch.device(device_name(device))


def resolve_dtype(dtype: str, device: "torch.device") -> "torch.dtype":
    """"auto" is bfloat16 on a GPU that supports it, float32 otherwise."""
    import torch

    if dtype not in DTYPES:
        raise InvalidArgument("dtype", f"{dtype!r} is not one of {list(DTYPES)}")
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, dtype)


# transformers builds a model under process-wide patches (parameters created on the meta device):
# two threads loading at once (``calibrl demo`` evaluates two arms at a time) would see each other's
# patches, so models are built one at a time
_LOADING = threading.Lock()


def load_policy(
    path: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
) -> Policy:
    """Load the policy from a local folder (``save_pretrained`` output, or a peft
    adapter folder whose base is a local folder). ``lora`` adds a fresh trainable
    adapter; an adapter folder is loaded trainable as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise NotFound(f"policy path {path!r} is not a folder; calibrl loads models only from local folders")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)

    adapter_config = folder / "adapter_config.json"
    base_path = folder
    if adapter_config.exists():
        if lora is not None:
            raise ConfigError(
                f"{path} already holds a LoRA adapter; load it without lora settings (it stays trainable) "
                "or point at its base model to start a fresh adapter"
            )
        base_path = pathlib.Path(json.loads(adapter_config.read_text())["base_model_name_or_path"])
        if not base_path.is_dir():
            raise NotFound(f"the base model {str(base_path)!r} named in {adapter_config} is not a local folder")
    elif not (folder / "config.json").exists():
        raise NotFound(f"policy path {path!r} holds no config.json (expected a save_pretrained folder)")

    tokenizer_path = folder if _has_tokenizer(folder) else base_path
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path), local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    # Half precision on the CPU: transformers' eager attention (plain matmuls), since torch's CPU flash
    # kernel fails for bf16 on AMX CPUs whose ATen kernels are held below AVX-512 (calibrl.kernels).
    eager = {"attn_implementation": "eager"} if cpu_half_precision(torch_device, torch_dtype) else {}
    with _LOADING:
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch_dtype,
                                                                      local_files_only=True, **eager)
        model.to(torch_device)
        if adapter_config.exists():
            peft = _import_peft()
            model = peft.PeftModel.from_pretrained(model, str(folder), is_trainable=True)
        elif lora is not None:
            model = wrap_lora(model, lora)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    return Policy(model=model, tokenizer=tokenizer, device=torch_device, model_id=str(base_path), lora=lora)


def wrap_lora(model: "torch.nn.Module", lora: LoraSettings) -> "PeftModel":
    """``model`` inside a fresh peft LoRA adapter (only the adapter is trainable)."""
    peft = _import_peft()
    target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    config = peft.LoraConfig(
        task_type="CAUSAL_LM", r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise InvalidArgument("lora.target_modules",
                              f"{lora.target_modules!r} does not fit this model: {exc}") from None


def enable_gradient_checkpointing(model: "torch.nn.Module") -> None:
    """Recompute activations in the backward pass (non-reentrant, so it works with
    LoRA where the embeddings do not need gradients)."""
    checkpoint_kwargs = {"use_reentrant": False}
    base = model.get_base_model() if _is_peft(model) else model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    if _is_peft(model) and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False  # a cache is pointless (and warned about) while training


def _import_peft() -> "ModuleType":
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA needs the peft package: pip install 'calibrl[lora]'") from None
    return peft


def _has_tokenizer(folder: pathlib.Path) -> bool:
    return any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _is_peft(model: "torch.nn.Module") -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


# --------------------------------------------------------------------------- reference


def make_reference(policy: Policy) -> "torch.nn.Module":
    """The frozen reference of the KL term, as the policy is now.

    Full fine-tuning: a deep copy, eval mode, no gradients (twice the weight memory).
    LoRA: the policy's own base with its adapters disabled, which is exactly the
    model before training, at no memory cost."""
    if policy.is_lora:
        return _adapter_disabled_reference_class()(policy.model)
    reference = copy.deepcopy(policy.model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@functools.cache
def _adapter_disabled_reference_class() -> type:
    import torch

    class _AdapterDisabledReference(torch.nn.Module):
        """Calls a peft model with its adapters disabled, in eval mode, without
        gradients. The peft model is held outside the module tree so that
        ``requires_grad_``/``eval``/``to`` on the reference never touch the policy."""

        def __init__(self, peft_model: "PeftModel") -> None:
            super().__init__()
            object.__setattr__(self, "_peft_model", peft_model)
            self.eval()

        @property
        def config(self) -> "PretrainedConfig":
            return self._peft_model.config

        def forward(self, *args: object, **kwargs: object) -> "ModelOutput":
            model = self._peft_model
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad(), model.disable_adapter():
                    return model(*args, **kwargs)
            finally:
                model.train(was_training)

    return _AdapterDisabledReference


# --------------------------------------------------------------------------- log-probabilities


def pad_token_id(tokenizer: "PreTrainedTokenizerBase") -> int:
    """The id that pads a batch: the tokenizer's pad token, else its EOS, else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


def completion_logprobs(
    model: "torch.nn.Module",
    input_ids: "torch.Tensor",
    attention_mask: "torch.Tensor",
    *,
    start: int = 1,
    temperature: float = 1.0,
    entropy_mask: "torch.Tensor | None" = None,
    share_prefix: bool = False,
) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """Log-probabilities of ``input_ids[:, start:]`` under ``model``: the one place
    the trainer turns a forward pass into log-probs (policy, behaviour copy and
    reference alike).

    ``input_ids``, ``attention_mask``: (B, L), right-padded (positions are counted
    from the first attended token, so left padding works too); ``start`` >= 1.
    Returns ``logp`` (B, L - start) with ``logp[:, j] = log p(input_ids[:, start + j]
    | the tokens before it)`` at ``temperature``, and, when ``entropy_mask`` (B, L -
    start) is given, the entropy of each of those next-token distributions (0 where
    the mask is False; no gradient), else None. The model projects only the last
    ``L - start + 1`` positions to the vocabulary (``logits_to_keep``, as TRL does):
    the prompt's hidden states are computed, its logits are not. Gradients flow
    into ``logp`` unless the caller disables them.

    ``share_prefix``: rows whose columns before ``start - 1`` are the same (a GRPO group's
    rollouts of one prompt) run those columns once, and the rest of each row attends to
    their keys and values (:func:`shared_prefix_logits`): the same log-probs up to float
    rounding, and gradients flow through the shared pass. Without shared rows, or for a
    model whose forward cannot take a cache, it is the plain forward."""
    # lazy: losses imports torch, which this module does not
    from calibrl.trainer.losses import masked_entropy_from_logits, token_logprobs as logprobs_from_logits

    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise InvalidArgument(
            "input_ids", f"must be (B, L) with attention_mask of the same shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if not 1 <= start <= max(1, input_ids.shape[1]):
        raise InvalidArgument("start", f"must be in [1, L={input_ids.shape[1]}], got {start}")
    keep = input_ids.shape[1] - start + 1
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    groups = prefix_groups(model, input_ids, attention_mask, start - 1) if share_prefix else None
    if groups is not None:
        logits = shared_prefix_logits(model, input_ids, attention_mask, position_ids, groups)
    else:
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        if _forward_accepts(model, "logits_to_keep"):
            inputs["logits_to_keep"] = keep
        logits = model(**inputs).logits[:, -keep:-1, :]
    logp = logprobs_from_logits(logits, input_ids[:, start:], temperature=temperature)
    entropy = None
    if entropy_mask is not None:
        entropy = masked_entropy_from_logits(logits.detach(), entropy_mask, temperature=temperature)[0]
    return logp, entropy


@dataclass(frozen=True)
class PrefixGroups:
    """Rows of a batch that share their first ``width`` columns (ids and attention mask):
    ``first[g]`` is the first row of group g, ``of_row[b]`` the group of row b."""

    width: int
    first: "torch.Tensor"
    of_row: "torch.Tensor"


def prefix_groups(model: "torch.nn.Module", input_ids: "torch.Tensor", attention_mask: "torch.Tensor",
                  width: int) -> PrefixGroups | None:
    """The groups of rows of ``input_ids`` that share columns ``[0, width)``, or None when
    sharing cannot help or cannot run: no two rows alike, an empty prefix, a model whose
    forward takes no cache, or gradient checkpointing in training (it turns the cache off)."""
    import torch

    rows = input_ids.shape[0]
    if width < 1 or rows < 2 or _cache_argument(model) is None:
        return None
    target = _base_model(model)
    if target.training and _checkpointing(target):
        return None
    keyed = torch.cat([input_ids[:, :width], attention_mask[:, :width].to(input_ids.dtype)], dim=1)
    _, of_row = torch.unique(keyed, dim=0, return_inverse=True)
    count = int(of_row.max()) + 1
    if count == rows:
        return None
    order = torch.arange(rows, device=of_row.device)
    first = torch.full((count,), rows, dtype=order.dtype, device=of_row.device).scatter_reduce(
        0, of_row, order, reduce="amin")
    return PrefixGroups(width, first, of_row)


def shared_prefix_logits(model: "torch.nn.Module", input_ids: "torch.Tensor", attention_mask: "torch.Tensor",
                         position_ids: "torch.Tensor", groups: PrefixGroups) -> "torch.Tensor":
    """Logits ``(B, L - width - 1, V)`` at columns ``width .. L - 2``: one forward pass over
    each group's shared columns (its first row), its keys and values copied to every row of
    the group (an index: gradients of the copies add up in the shared pass), then one pass
    over every row's remaining columns with the full attention mask and positions."""
    cache_argument = _cache_argument(model)
    width, first = groups.width, groups.first
    keep = {"logits_to_keep": 1} if _forward_accepts(model, "logits_to_keep") else {}
    prefix = model(input_ids=input_ids[first, :width], attention_mask=attention_mask[first, :width],
                   position_ids=position_ids[first, :width], use_cache=True, **keep)
    cache = getattr(prefix, cache_argument)
    cache.batch_select_indices(groups.of_row)
    out = model(input_ids=input_ids[:, width:], attention_mask=attention_mask,
                position_ids=position_ids[:, width:], use_cache=True, **{cache_argument: cache})
    return out.logits[:, :-1, :]


def _base_model(model: "torch.nn.Module") -> "torch.nn.Module":
    target = getattr(model, "_peft_model", model)  # the LoRA reference wraps the peft policy
    return target.get_base_model() if hasattr(target, "get_base_model") else target


def _checkpointing(model: "torch.nn.Module") -> bool:
    # transformers 5.x: is_activation_checkpointing (is_gradient_checkpointing is deprecated)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def _forward_accepts(model: "torch.nn.Module", argument: str) -> bool:
    try:
        return argument in inspect.signature(_base_model(model).forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_argument(model: "torch.nn.Module") -> str | None:
    """The forward's KV-cache argument: transformers 5.x ``cache``, earlier ``past_key_values``."""
    for argument in ("cache", "past_key_values"):
        if _forward_accepts(model, argument):
            return argument
    return None
