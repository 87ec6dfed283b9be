"""The transformers judge backend: any Hugging Face causal LM from a local folder.

LLM criteria are scored from the next-token distribution after each prompt (see
``calibrl.judge_server.prompts``), one item at a time, all its criteria together:

- ``prefix_cache`` (default): an item's shared prefix runs once (causal, no mask),
  keeping the KV cache; then all the criterion suffixes run on top of it in one more
  forward, packed end to end into one row with a block-causal attention mask (each
  suffix sees the prefix and its own earlier tokens, never another suffix; its
  positions continue the prefix's), so there is no padding, no per-criterion copy of
  the cache, and the LM head runs only on each suffix's last position. The prefix,
  usually most of the prompt, is computed once per item instead of once per
  criterion. Attention implementations that cannot take such a 4D mask (e.g.
  flash-attention 2) repeat the cache once per criterion instead (right-padded
  suffixes, one row each), as :meth:`TransformersJudge.next_token_logprobs` does.
  For Llama-style models (Llama, Qwen2) both passes run in a loop of our own over the
  model's modules that skips what the answers do not need: the last layer's attention
  and MLP at every position but the C answer positions, and transformers' per-forward
  bookkeeping (``pruned_forward`` module doc); same scores within float rounding.
- ``flat``: the item's criterion prompts, left-padded, in one forward (no reuse).
- ``generate``: greedy generation plus parsing, for comparison only (a parse failure
  raises RewardError; it never becomes a score).

Batch invariance: every mode runs one item per forward pass, so the shapes an item
goes through depend only on the item and the rubric's criteria, never on the other
items of the request or of the server's micro-batch. Sixteen items in one padded
forward moved 30 of 32 scores, by up to 2.8e-6 with a tiny random model
(``benchmarks/bench_invariance.py --probe``); the cost is in ``benchmarks/README.md``.
:meth:`TransformersJudge.next_token_logprobs` still accepts several items, for
that comparison.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from calibrl.devices import resolve_device
from calibrl.kernels import half_precision_attention
from calibrl.errors import ConfigError, RewardError
from calibrl.judge_server import prompts
from calibrl.judge_server.backends import model_id_for
from calibrl.judge_server.backends.encoding import EncodedBatch, PromptEncoder
from calibrl.judge_server.backends.masks import aligned_for_kernels
from calibrl.judge_server.backends.pruned_forward import pruned_forward_for
from calibrl.judge_server.rubric import Criterion, Rubric
from calibrl.api.judge import JudgeItem

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    import torch
    from torch import Tensor

log = logging.getLogger(__name__)

PROMPT_MODES = ("prefix_cache", "flat", "generate")
MASKABLE_ATTENTION = ("sdpa", "eager")


def resolve_dtype(dtype: str, device: str) -> "torch.dtype":
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ConfigError(f"dtype={dtype!r}: must be auto, float32, bfloat16 or float16")
    return table[dtype]


class TransformersJudge:
    """Scores LLM criteria with a local causal LM (see module doc)."""

    def __init__(
        self,
        path: str | pathlib.Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        mode: str = "prefix_cache",
        max_items_per_forward: int = 16,
        prompt_options: prompts.PromptOptions = prompts.PromptOptions(),
        use_chat_template: str = "auto",
        max_new_tokens: int = 4,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if mode not in PROMPT_MODES:
            raise ConfigError(f"llm_mode={mode!r}: must be one of {list(PROMPT_MODES)}")
        folder = pathlib.Path(path)
        self.model_id = model_id_for("transformers", folder)
        self.device = resolve_device(device)
        self.mode = mode
        self.max_items_per_forward = max_items_per_forward
        self.max_new_tokens = max_new_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=resolve_dtype(dtype, self.device)
        ).to(self.device)
        self.model.eval()
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.encoder = PromptEncoder(self.tokenizer, prompt_options, use_chat_template, max_positions)
        self._torch = torch
        # transformers 5.2x renamed past_key_values -> cache; older releases only know the old name.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        self._keep_arg = "logits_to_keep" if "logits_to_keep" in forward_params else None
        attention = getattr(self.model.config, "_attn_implementation", "eager")
        # the attention kernel takes a 4D additive mask: pack the suffixes (module doc); settable for comparisons
        self.packs_suffixes = attention in MASKABLE_ATTENTION
        # Llama-style models: the prefix-cache path skips what the answers do not need (pruned_forward
        # module doc); None = the transformers forward (other models; settable for comparisons)
        self.pruned = pruned_forward_for(self.model)
        log.info("transformers judge %s on %s (%s mode)", self.model_id, self.device, mode)

    # ------------------------------------------------------------------ interface

    def check_rubric(self, rubric: Rubric) -> None:
        tokens = self.encoder.answer_tokens
        if any(c.scale == "likert_1_5" for c in rubric.llm_criteria) and not all(tokens.digits):
            raise ConfigError(f"rubric {rubric.id!r} has 1-5 questions but the judge tokenizer has no "
                              "single-token digits 1-5")

    def score(self, items: Sequence[JudgeItem], criteria: Sequence[Criterion], instructions: str) -> list[list[float]]:
        if not items or not criteria:
            return [[] for _ in items]
        encoded = self.encoder.encode(items, criteria, instructions)
        if self.mode == "generate":
            answers = self.generate_answers(encoded, criteria)
            for row, values in enumerate(answers):
                for col, value in enumerate(values):
                    if value is None:
                        raise RewardError(f"items[{row}]: the judge's generated answer to criterion "
                                          f"{criteria[col].name!r} could not be parsed (generate mode)")
            return [[float(v) for v in values] for values in answers]
        packed = self.mode == "prefix_cache" and (self.pruned is not None or self.packs_suffixes)
        layout = SuffixLayout.build(encoded.suffix_ids, self._torch, self.device, self.model.dtype) if packed else None
        rows: list[list[float]] = []
        for prefix in encoded.prefix_ids:  # one item per forward: batch-invariant (module doc)
            if layout is not None:
                logprobs = self.item_logprobs(prefix, layout)
            else:
                logprobs = self.next_token_logprobs(EncodedBatch([prefix], encoded.suffix_ids))  # (criteria, V)
            rows.extend(self._scores_from_rows(logprobs, criteria, 1))
        return rows

    # ------------------------------------------------------------------ forward passes

    def _forward_mode(self) -> contextlib.ExitStack:
        """No autograd; a half-precision model on the CPU runs attention on SDPA's math kernel
        (:func:`calibrl.kernels.half_precision_attention`: the flash kernel fails on AMX CPUs
        whose ATen kernels are held below AVX-512)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._torch.inference_mode())
        stack.enter_context(half_precision_attention(self.device, self.model.dtype))
        return stack

    def next_token_logprobs(self, batch: EncodedBatch, mode: str | None = None) -> "Tensor":
        """Log-probabilities of the token after each prompt: a float32 tensor of shape
        (items * criteria, vocab), row ``b * C + c`` = item b, criterion c."""
        mode = mode or ("flat" if self.mode == "flat" else "prefix_cache")
        with self._forward_mode():
            if mode == "flat":
                return self._flat(batch)
            return self._prefix_cache(batch)

    def item_logprobs(self, prefix: Sequence[int], layout: "SuffixLayout") -> "Tensor":
        """Log-probabilities of the token after each of one item's criterion prompts, shared
        prefix first, then the packed suffixes (module doc), through the pruned forward where the
        model has one: float32 (criteria, vocab)."""
        torch = self._torch
        with self._forward_mode():
            if self.pruned is not None:
                return self.pruned.item_logprobs(prefix, layout)
            ids = torch.tensor([list(prefix)], dtype=torch.long, device=self.device)
            keep = {self._keep_arg: 1} if self._keep_arg else {}  # the prefix's own logits are not needed
            cache = getattr(self.model(input_ids=ids, use_cache=True, **keep), self._cache_arg)
            n = len(prefix)
            mask = layout.mask(n).clone()  # the layout's kept mask is not handed to code that may edit it in place
            keep = {self._keep_arg: layout.last} if self._keep_arg else {}
            out = self.model(input_ids=layout.ids, attention_mask=mask, position_ids=layout.positions + n,
                             use_cache=True, **{self._cache_arg: cache}, **keep)
            logits = out.logits[0] if self._keep_arg else out.logits[0, layout.last]
            return torch.log_softmax(logits.float(), dim=-1)

    def _prefix_cache(self, batch: EncodedBatch) -> "Tensor":
        torch = self._torch
        n_items, n_criteria = len(batch.prefix_ids), len(batch.suffix_ids)
        prefix, prefix_mask = self._left_pad(batch.prefix_ids)
        prefix_positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
        keep = {self._keep_arg: 1} if self._keep_arg else {}  # the prefix's own logits are not needed
        out = self.model(input_ids=prefix, attention_mask=prefix_mask, position_ids=prefix_positions,
                         use_cache=True, **keep)
        cache = getattr(out, self._cache_arg)
        cache.batch_repeat_interleave(n_criteria)  # row b*C + c holds item b's prefix

        suffix_len = max(len(s) for s in batch.suffix_ids)
        suffix = torch.full((n_criteria, suffix_len), self.pad_id, dtype=torch.long)
        suffix_mask = torch.zeros((n_criteria, suffix_len), dtype=torch.long)
        for c, ids in enumerate(batch.suffix_ids):  # right-padded: a real token never sees a pad
            suffix[c, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            suffix_mask[c, : len(ids)] = 1
        suffix = suffix.repeat(n_items, 1).to(self.device)
        suffix_mask = suffix_mask.repeat(n_items, 1).to(self.device)
        prefix_lengths = prefix_mask.sum(-1).repeat_interleave(n_criteria)
        positions = prefix_lengths[:, None] + torch.arange(suffix_len, device=self.device)[None, :]
        attention = torch.cat([prefix_mask.repeat_interleave(n_criteria, dim=0), suffix_mask], dim=1)
        out = self.model(input_ids=suffix, attention_mask=attention, position_ids=positions,
                         use_cache=True, **{self._cache_arg: cache})
        last = torch.tensor([len(s) - 1 for s in batch.suffix_ids], device=self.device).repeat(n_items)
        logits = out.logits[torch.arange(n_items * n_criteria, device=self.device), last]
        return torch.log_softmax(logits.float(), dim=-1)

    def _flat(self, batch: EncodedBatch) -> "Tensor":
        torch = self._torch
        sequences = [p + s for p in batch.prefix_ids for s in batch.suffix_ids]
        ids, mask = self._left_pad(sequences)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = {self._keep_arg: 1} if self._keep_arg else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **keep)
        return torch.log_softmax(out.logits[:, -1].float(), dim=-1)

    def _left_pad(self, sequences: Sequence[Sequence[int]]) -> tuple["Tensor", "Tensor"]:
        torch = self._torch
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _scores_from_rows(self, logprobs: "Tensor", criteria: Sequence[Criterion], n_items: int) -> list[list[float]]:
        tokens = self.encoder.answer_tokens
        ids = list(tokens.all_ids())
        column = {token: i for i, token in enumerate(ids)}
        picked = logprobs[:, ids].cpu().tolist()  # only the answer tokens leave the device
        rows = []
        for b in range(n_items):
            row = []
            for c, criterion in enumerate(criteria):
                values = picked[b * len(criteria) + c]
                row.append(prompts.score_from_logprobs(criterion, lambda t: values[column[t]], tokens))
            rows.append(row)
        return rows

    def generate_answers(self, batch: EncodedBatch, criteria: Sequence[Criterion]) -> list[list[float | None]]:
        """Greedy-generate a short answer to every prompt and parse it (None = unparsable)."""
        torch = self._torch
        out_rows: list[list[float | None]] = []
        for prefix in batch.prefix_ids:  # one item per call, as in score()
            sequences = [prefix + suffix for suffix in batch.suffix_ids]
            ids, mask = self._left_pad(sequences)
            with self._forward_mode():
                generated = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens, do_sample=False,
                    pad_token_id=self.pad_id, eos_token_id=self.tokenizer.eos_token_id,
                )
            texts = self.tokenizer.batch_decode(generated[:, ids.shape[1] :], skip_special_tokens=True)
            out_rows.append([prompts.parse_answer(criterion, text) for criterion, text in zip(criteria, texts)])
        return out_rows


@dataclass(frozen=True)
class SuffixLayout:
    """A rubric's criterion suffixes packed end to end into one row (module doc), built once
    per ``score`` call: ``ids`` (1, S) the S suffix tokens, ``positions`` (1, S) each token's
    offset in its own suffix (the prefix length is added per item), ``last`` (C,) the index
    of each suffix's last token, and ``block`` (S, S) additive mask among the suffix tokens:
    0 where a token may attend (its own suffix, causally), the dtype's minimum elsewhere."""

    ids: "Tensor"
    positions: "Tensor"
    last: "Tensor"
    block: "Tensor"
    # the widest mask built so far in this score call (the layout's life): mask() returns a view of it
    kept: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, suffix_ids: Sequence[Sequence[int]], torch: "ModuleType", device: str,
              dtype: "torch.dtype") -> "SuffixLayout":
        lengths = [len(s) for s in suffix_ids]
        total = sum(lengths)
        allowed = torch.zeros((total, total), dtype=torch.bool)
        start = 0
        for n in lengths:
            allowed[start : start + n, start : start + n] = torch.ones((n, n), dtype=torch.bool).tril()
            start += n
        ids = torch.tensor([[t for s in suffix_ids for t in s]], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])[None, :]
        last = torch.tensor(lengths).cumsum(0) - 1
        block = torch.zeros((total, total), dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return cls(ids.to(device), positions.to(device), last.to(device), block.to(device))

    def mask(self, prefix_length: int) -> "Tensor":
        """(1, 1, S, prefix_length + S) additive mask: every suffix token sees the whole prefix.

        Its prefix columns are all zeros, so the mask of a shorter prefix is the right-hand part
        of a longer one's: one mask, as wide as the longest prefix of the call so far, is built
        and each item gets a view of it (a view, not a copy: callers must not edit it in place)."""
        import torch

        wide = self.kept.get("mask")
        if wide is None or wide.shape[-1] - self.block.shape[0] < prefix_length:
            seen = self.block.new_zeros((self.block.shape[0], max(prefix_length, 256)))
            wide = self.kept["mask"] = torch.cat([seen, self.block], dim=1)[None, None]
        return aligned_for_kernels(wide[..., wide.shape[-1] - self.block.shape[0] - prefix_length :])
