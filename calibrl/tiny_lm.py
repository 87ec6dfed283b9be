"""A tiny, randomly initialised causal LM: the one builder behind the demo's
policies, the test models and the benchmarks. Nothing is downloaded.

:func:`build_tiny_lm` sizes a Llama or Qwen2 model (:class:`TinyLMSpec`) for a
given tokenizer and seeds its initialisation, so the same spec, tokenizer and
seed give the same weights on any machine with the same torch build.
:func:`train_bpe_tokenizer` is the one tokenizer trainer: the corpus, special tokens and
added tokens differ by use (the demo trains on its domain, the tests on a small corpus:
see :mod:`calibrl.testing`), the byte-level BPE is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from calibrl.errors import InvalidArgument

ARCHITECTURES = ("llama", "qwen2")  # Qwen2 adds biases to the attention projections


@dataclass(frozen=True)
class TinyLMSpec:
    """Shape and initialisation of a tiny causal LM."""

    arch: str = "llama"  # one of ARCHITECTURES
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: half the heads (grouped-query attention), at least 1
    intermediate_size: int | None = None  # None: twice the hidden size
    max_positions: int = 512
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # std of the initial weights (the transformers default)
    lm_head_std: float | None = None  # redraw the output projection from N(0, std): spreads the logits

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise InvalidArgument("arch", f"{self.arch!r} is not one of {list(ARCHITECTURES)}")
        for name in ("hidden_size", "num_layers", "num_heads", "max_positions"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise InvalidArgument("hidden_size", f"{self.hidden_size} must be a multiple of num_heads={self.num_heads}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str], *,
                        bos: str | None = None, min_frequency: int | None = None,
                        added_tokens: Sequence[str] = (), individual_digits: bool = False,
                        split_inner_capitals: bool = False) -> Any:
    """A byte-level BPE tokenizer (a ``tokenizers.Tokenizer``: any text encodes and decodes exactly)
    trained on ``texts`` with ``special_tokens`` first in its vocabulary. ``bos``: a special token
    prepended to every encoding; ``min_frequency``: the BPE trainer's (None keeps its default);
    ``added_tokens``: texts that each become one token, added after training; ``individual_digits``:
    every digit its own pre-token (a number is then spelled digit by digit);
    ``split_inner_capitals``: a word is split before each capital that follows a lower-case letter
    ("KeLi" -> "Ke", "Li")."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    core = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if individual_digits else []
    if split_inner_capitals:
        steps.append(pre_tokenizers.Split(Regex("(?<=[a-z])[A-Z][a-z]*"), behavior="isolated"))
    core.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level
    core.decoder = decoders.ByteLevel()
    options = {} if min_frequency is None else {"min_frequency": min_frequency}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False, **options)
    core.train_from_iterator(list(texts), trainer)
    if added_tokens:
        core.add_tokens([AddedToken(text, normalized=False, special=False) for text in added_tokens])
    if bos is not None:
        core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                            special_tokens=[(bos, core.token_to_id(bos))])
    return core


def build_tiny_lm(tokenizer: Any, spec: TinyLMSpec = TinyLMSpec(), seed: int = 0) -> Any:
    """A randomly initialised causal LM for ``tokenizer`` (vocabulary, BOS/EOS/pad ids),
    seeded with ``seed``; in train mode, as transformers returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[spec.arch]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or max(1, spec.num_heads // 2),
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    if spec.lm_head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, spec.lm_head_std)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


__all__ = ["ARCHITECTURES", "TinyLMSpec", "build_tiny_lm", "train_bpe_tokenizer"]
