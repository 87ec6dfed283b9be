"""A tiny, randomly initialised causal LM and a byte-level BPE tokenizer trained
here, for tests of the policy, the engines and the rollouts. Nothing is downloaded."""

from __future__ import annotations

import pathlib

CORPUS = [
    "<think> I should look up who wrote the novel. </think> <search> author of the novel Dune </search>",
    "<information>Doc 1(Title: Dune) Dune is a 1965 novel by Frank Herbert.</information>",
    "<think> The passage names the author. </think> <answer> Frank Herbert </answer>",
    "Rewrite the question below as a single search query. Question: what is the capital of France?",
    "Search query: capital city of France\n",
    "Answer the question below. Reason inside the think block, search when knowledge is missing.",
    "The Eiffel Tower is in Paris, the capital of France. Berlin is the capital of Germany.",
    "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
] * 4


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer (any text encodes and decodes exactly) with
    ``<s>`` (BOS, prepended), ``</s>`` (EOS) and ``<pad>``. The format tags are
    ordinary text, split into several tokens as in most real tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", core.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(tokenizer, *, seed: int = 0, hidden: int = 32, layers: int = 2, context: int = 512,
                arch: str = "llama"):
    """A random causal LM sized for ``tokenizer``: ``arch`` "llama" or "qwen2"
    (Qwen2 adds biases to the attention projections)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    # Spread the logits: a default-initialised tiny model is nearly uniform, which
    # makes greedy ties (and flaky comparisons) likely.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def save_tiny_policy(folder: pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write a tiny model and its tokenizer as a ``save_pretrained`` folder."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
