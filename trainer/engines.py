"""Generation engines: token ids in, sampled token ids out.

Every engine speaks token ids on both sides, so the rollout code builds prompts,
observations and masks once (``calibrl.trainer.rollout``) whatever samples the tokens:

- :class:`TransformersEngine` samples from the policy's own model (CPU or GPU):
  a batched loop over a KV cache with left padding, temperature, nucleus
  (top-p), stop strings, EOS, and a seeded generator. It shares the policy's
  weights, so it is always up to date.
- :class:`VLLMEngine` (the ``gpu`` extra) is a thin adapter over ``vllm.LLM``
  with the same contract: it applies the same :func:`truncate_completion` to what
  vLLM returns, and ``update_weights`` pushes the policy's current weights
  (LoRA merged, names as in the Hugging Face checkpoint; :func:`inference_weights`)
  into the vLLM model after each optimizer step. It runs with one GPU per engine
  (tensor parallel size 1) in the trainer's process.

What a returned completion holds: the sampled tokens up to and including the
first EOS token, or up to the first token whose text completes one of the stop
strings (that token included), or ``max_new_tokens`` tokens.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

from calibrl.errors import ConfigError, FailedPrecondition, InvalidArgument
from calibrl.trainer.policy import pad_token_id

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase
    import torch

    from calibrl.trainer.policy import Policy

ENGINE_KINDS = ("transformers", "vllm")


class GenerationEngine(Protocol):
    def generate(
        self,
        prompts_token_ids: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
    ) -> list[list[int]]:
        """The new tokens of each prompt, in order (see the module docstring)."""
        ...

    def update_weights(self, model: "torch.nn.Module") -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...


# --------------------------------------------------------------------------- shared helpers


def check_sampling(*, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Reject sampling settings no engine can honour, naming the field."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidArgument("max_new_tokens", f"must be an integer >= 1, got {max_new_tokens!r}")
    if not temperature >= 0.0:
        raise InvalidArgument("temperature", f"must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p!r}")


def eos_token_ids(tokenizer: "PreTrainedTokenizerBase", model: "torch.nn.Module | None" = None) -> frozenset[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's
    generation-config EOS ids (chat models often list several)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    return frozenset(ids)


def decode_for_stops(tokenizer: "PreTrainedTokenizerBase", token_ids: Sequence[int]) -> str:
    """Text used to look for stop strings: special tokens kept, so a tag registered
    as a special token is still seen."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


def truncate_completion(
    token_ids: Sequence[int], tokenizer: "PreTrainedTokenizerBase", *, stop_strings: Sequence[str] = (),
    eos_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """``token_ids`` cut after the first EOS id or after the first token whose text
    completes a stop string, whichever comes first (the shortest prefix that
    contains a stop string)."""
    tokens = list(token_ids)
    for i, token in enumerate(tokens):
        if token in eos_ids:
            tokens = tokens[: i + 1]
            break
    if not stop_strings or not any(s in decode_for_stops(tokenizer, tokens) for s in stop_strings):
        return tokens
    for end in range(1, len(tokens) + 1):
        if any(s in decode_for_stops(tokenizer, tokens[:end]) for s in stop_strings):
            return tokens[:end]
    return tokens  # pragma: no cover - unreachable: the full text contains a stop string


def inference_weights(model: "torch.nn.Module") -> Iterator[tuple[str, "torch.Tensor"]]:
    """The model's weights as an inference engine loads them: Hugging Face checkpoint
    names (``model.layers.0.self_attn.q_proj.weight``) and, for a peft LoRA model,
    the adapters merged into the base weights (the model itself is left unchanged).
    Yields detached tensors on the model's device."""
    import torch

    is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    if not is_peft:
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
        return
    base = model.get_base_model()
    modules = dict(base.named_modules())
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name or ".original_module." in name:  # adapters and modules_to_save originals
                continue
            clean = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
            owner_name, _, leaf = name.rpartition(".")
            layer = modules.get(owner_name.removesuffix(".base_layer"))
            if leaf == "weight" and owner_name.endswith(".base_layer") and hasattr(layer, "get_delta_weight"):
                merged = tensor.detach().clone()
                for adapter in getattr(layer, "active_adapters", ()):
                    if adapter in getattr(layer, "lora_A", {}) and not getattr(layer, "disable_adapters", False):
                        merged += layer.get_delta_weight(adapter).to(merged.dtype)
                yield clean, merged
            else:
                yield clean, tensor.detach()


# --------------------------------------------------------------------------- transformers


class TransformersEngine:
    """Batched sampling from a Hugging Face causal LM (the policy's own model).

    Prompts are left-padded into batches of at most ``max_batch_size``; the model
    runs in eval mode (no dropout) under ``torch.inference_mode`` and its train/eval
    mode is restored afterwards. ``seed`` makes a call reproducible on the same
    device; without it the global torch generator is used. ``share_prompts``: a prompt
    that appears several times in a batch (a GRPO group) is prefilled once and its keys
    and values copied to each of its rows; the logits differ from a per-row prefill only
    by float rounding, so a sample can differ where a draw falls on a boundary.
    """

    def __init__(self, policy: "Policy", *, max_batch_size: int | None = None, share_prompts: bool = False) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise InvalidArgument("max_batch_size", f"must be >= 1 or None, got {max_batch_size!r}")
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.share_prompts = share_prompts
        self.eos_ids = eos_token_ids(policy.tokenizer, policy.model)
        self.pad_id = pad_token_id(policy.tokenizer)
        self.max_context_tokens = _context_length(policy.model)

    def update_weights(self, model: "torch.nn.Module") -> None:
        """Nothing to do: the engine samples from the policy's model itself."""

    def generate(
        self,
        prompts_token_ids: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
    ) -> list[list[int]]:
        import torch

        check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        for i, prompt in enumerate(prompts_token_ids):
            if not prompt:
                raise InvalidArgument(f"prompts_token_ids[{i}]", "is empty; a prompt needs at least one token")
            if self.max_context_tokens is not None and len(prompt) + max_new_tokens > self.max_context_tokens:
                raise InvalidArgument(
                    f"prompts_token_ids[{i}]",
                    f"{len(prompt)} tokens + max_new_tokens {max_new_tokens} exceed the model's context of "
                    f"{self.max_context_tokens} tokens",
                )
        if not prompts_token_ids:
            return []
        model = self.policy.model
        device = _model_device(model)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(int(seed))
        chunk = self.max_batch_size or len(prompts_token_ids)
        was_training = model.training
        model.eval()
        try:
            outputs: list[list[int]] = []
            with torch.inference_mode():
                for start in range(0, len(prompts_token_ids), chunk):
                    outputs.extend(
                        self._generate_batch(
                            prompts_token_ids[start : start + chunk],
                            max_new_tokens=max_new_tokens,
                            temperature=temperature,
                            top_p=top_p,
                            stop_strings=tuple(stop_strings),
                            generator=generator,
                            device=device,
                        )
                    )
            return outputs
        finally:
            model.train(was_training)

    def _generate_batch(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_strings: tuple[str, ...],
        generator: "torch.Generator | None",
        device: "torch.device | str",
    ) -> list[list[int]]:
        import torch

        model = self.policy.model
        tokenizer = self.policy.tokenizer
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        completions: list[list[int]] = [[] for _ in range(batch)]
        finished = [False] * batch
        extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
        # transformers 5.x names the KV cache argument `cache`; earlier versions `past_key_values`.
        cache_argument = "cache" if _accepts(model, "cache") else "past_key_values"
        logits, past = self._prefill(prompts, input_ids, attention_mask, position_ids, cache_argument, extra)
        step_positions = position_ids
        for new_token in range(max_new_tokens):
            if new_token:
                out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=step_positions,
                            use_cache=True, **{cache_argument: past}, **extra)
                logits, past = out.logits[:, -1, :], getattr(out, cache_argument)
            next_tokens = sample_next_token(logits.float(), temperature=temperature, top_p=top_p, generator=generator)
            chosen = next_tokens.tolist()
            for row in range(batch):
                if finished[row]:
                    continue
                completions[row].append(chosen[row])
                if chosen[row] in self.eos_ids:
                    finished[row] = True
                elif stop_strings:
                    text = decode_for_stops(tokenizer, completions[row])
                    finished[row] = any(s in text for s in stop_strings)
            if all(finished):
                break
            # Finished rows keep decoding padding that nobody reads: the batch stays rectangular.
            fed = [self.pad_id if finished[row] else chosen[row] for row in range(batch)]
            step_ids = torch.tensor(fed, dtype=torch.long, device=device).unsqueeze(-1)
            step_positions = step_positions[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
        return completions

    def _prefill(self, prompts: list[list[int]], input_ids: "torch.Tensor", attention_mask: "torch.Tensor",
                 position_ids: "torch.Tensor", cache_argument: str, extra: dict[str, int],
                 ) -> tuple["torch.Tensor", Any]:
        """The prompts' forward pass: next-token logits (B, V) and the KV cache. With
        ``share_prompts``, each distinct prompt runs once (same padding and positions as in
        the batch) and its cache rows and logits are copied to the rows that repeat it."""
        import torch

        model = self.policy.model
        group_of: dict[tuple[int, ...], int] = {}
        of_row = [group_of.setdefault(tuple(prompt), len(group_of)) for prompt in prompts]
        if not self.share_prompts or len(group_of) == len(prompts):
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=True, **{cache_argument: None}, **extra)
            return out.logits[:, -1, :], getattr(out, cache_argument)
        first = torch.tensor([of_row.index(group) for group in range(len(group_of))], device=input_ids.device)
        out = model(input_ids=input_ids[first], attention_mask=attention_mask[first],
                    position_ids=position_ids[first], use_cache=True, **{cache_argument: None}, **extra)
        expand = torch.tensor(of_row, device=input_ids.device)
        cache = getattr(out, cache_argument)
        cache.batch_select_indices(expand)
        return out.logits[expand, -1, :], cache


def sample_next_token(logits: "torch.Tensor", *, temperature: float, top_p: float,
                      generator: "torch.Generator | None" = None) -> "torch.Tensor":
    """One token per row from ``logits`` (B, V): argmax when ``temperature`` is 0,
    else a draw from ``softmax(logits / temperature)`` restricted to the smallest
    set of tokens whose probability reaches ``top_p``. Returns (B,) long. Raises
    FailedPrecondition when a row's logits hold NaN or +inf, or no finite value (a
    sampler would otherwise fail with an opaque error, or quietly pick token 0)."""
    import torch

    broken = torch.isnan(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    if bool(broken.any()):
        rows = broken.nonzero().flatten().tolist()
        raise FailedPrecondition(
            f"the policy's next-token logits are NaN or infinite in rows {rows[:8]} of {logits.shape[0]}: its weights or "
            "activations are not finite (a diverged or corrupt checkpoint, or a half-precision overflow); resume from "
            "an earlier checkpoint, lower optimizer.lr, or run with precision=fp32"
        )
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def top_p_filter(logits: "torch.Tensor", top_p: float) -> "torch.Tensor":
    """``logits`` (B, V) with every token outside the nucleus set to -inf. The nucleus
    keeps tokens in order of probability until their cumulative probability reaches
    ``top_p``; the most likely token is always kept."""
    import torch

    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _context_length(model: "torch.nn.Module") -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _model_device(model: "torch.nn.Module") -> "torch.device":
    return next(model.parameters()).device


def _accepts(model: "torch.nn.Module", argument: str) -> bool:
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return argument in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- vLLM


class VLLMEngine:
    """A thin adapter over ``vllm.LLM`` (the ``gpu`` extra; not importable on CPU).

    ``engine_kwargs`` go to ``vllm.LLM`` (``gpu_memory_utilization``, ``dtype``,
    ``max_model_len``, ...). The engine runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so :meth:`update_weights` can hand the
    new weights to the model directly; tensor parallelism is therefore 1.
    """

    def __init__(self, model_path: str, *, tokenizer: "PreTrainedTokenizerBase" = None, **engine_kwargs: Any) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"engine 'vllm' needs the vllm package, which is not installed ({exc}); install the GPU extra "
                "with pip install 'calibrl[gpu]' on a CUDA machine, or choose engine 'transformers'"
            ) from None
        if engine_kwargs.get("tensor_parallel_size", 1) != 1:
            raise ConfigError(
                "engine 'vllm': tensor_parallel_size must be 1 (the engine shares the trainer's process and "
                "receives full weights); scale rollouts with more trainer ranks instead"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(tokenizer)
        engine_kwargs.setdefault("enable_prefix_caching", True)
        self.llm = LLM(model=model_path, tokenizer=model_path, **engine_kwargs)
        self.max_context_tokens = getattr(getattr(self.llm.llm_engine, "model_config", None), "max_model_len", None)

    def generate(
        self,
        prompts_token_ids: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
    ) -> list[list[int]]:
        from vllm import SamplingParams

        check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        if not prompts_token_ids:
            return []
        # One request per prompt; a per-request seed keeps a seeded call reproducible.
        params = [
            SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                stop=list(stop_strings) or None,
                include_stop_str_in_output=True,
                seed=None if seed is None else int(seed) + i,
            )
            for i in range(len(prompts_token_ids))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts_token_ids], params, use_tqdm=False
        )
        return [
            truncate_completion(
                list(out.outputs[0].token_ids), self.tokenizer, stop_strings=stop_strings, eos_ids=self.eos_ids
            )
            for out in outputs
        ]

    def update_weights(self, model: "torch.nn.Module") -> None:
        """Load ``model``'s current weights (LoRA merged) into the vLLM model and drop
        cached prefixes computed with the old weights."""
        weights = [(name, tensor) for name, tensor in inference_weights(model)]

        def load(vllm_model: "torch.nn.Module") -> None:
            vllm_model.load_weights(weights=iter(weights))

        self.llm.apply_model(load)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()


# --------------------------------------------------------------------------- selection


def make_engine(kind: str, policy: "Policy", **kwargs: Any) -> GenerationEngine:
    """The engine named ``kind``: "transformers" (kwargs: ``max_batch_size``) or
    "vllm" (kwargs go to ``vllm.LLM``; the policy's ``model_id`` is the weights path)."""
    if kind == "transformers":
        return TransformersEngine(policy, **kwargs)
    if kind == "vllm":
        return VLLMEngine(policy.model_id, tokenizer=policy.tokenizer, **kwargs)
    raise ConfigError(f"engine {kind!r} is not one of {list(ENGINE_KINDS)}")
