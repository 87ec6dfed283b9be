"""Tiny models for tests, benchmarks and examples: tokenizers trained here on a
built-in corpus, models from :func:`calibrl.tiny_lm.build_tiny_lm`. Nothing is downloaded.

- :func:`build_tiny_causal_lm` saves a judge-sized model and tokenizer to a folder
  (the tokenizer makes " yes", " no" and the digits single tokens, and knows a chat
  template's role markers) that ``from_pretrained`` loads offline;
- :func:`build_tokenizer`, :func:`build_model` and :func:`save_tiny_policy` make a
  policy-sized model whose tokenizer has seen Search-R1 trajectories.
"""

from __future__ import annotations

import pathlib
from typing import Any, Iterable

from calibrl.fileperms import honour_umask
from calibrl.tiny_lm import TinyLMSpec, build_tiny_lm, train_bpe_tokenizer

# A minimal chat template for tests that need one (a user turn, then the assistant's).
SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_BASE_CORPUS = [
    "You are a strict reviewer of a retrieval agent. The agent rewrote a user's query into a search query.",
    "Read the query, the agent's output and the documents it retrieved, then answer the question.",
    "User query: Agent output: Retrieved documents: Question: Answer yes or no. Answer: yes",
    "Answer with one number from 1 (worst) to 5 (best). Answer: 1 2 3 4 5",
    "Does the output keep the intent of the user's query? Answer: no",
    "Is the output specific enough to retrieve the right documents? Answer: yes",
    "Does the output mention a name, product, code or number that appears neither in the query nor in the documents?",
    "What is the expense ratio of the Vanguard Total Stock Market Index Fund? yes no yes no 1 2 3 4 5",
    "The quick brown fox jumps over the lazy dog. Who wrote Hamlet? When was the bridge built?",
    "<|user|> <|assistant|> <|system|>",
]


def _train_tokenizer(vocab_size: int, extra_texts: Iterable[str]):
    corpus = list(_BASE_CORPUS) * 20 + list(extra_texts) + [" yes", " no", " Yes", " No"] * 50
    return train_bpe_tokenizer(corpus, vocab_size, ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
                               bos="<s>", min_frequency=1)


def build_tiny_causal_lm(
    folder: str | pathlib.Path,
    *,
    arch: str = "llama",
    hidden_size: int = 48,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int = 800,
    max_positions: int = 2048,
    seed: int = 0,
    initializer_range: float = 0.2,
    chat_template: str | None = None,
    extra_texts: Iterable[str] = (),
) -> pathlib.Path:
    """Build and save a tiny randomly initialised causal LM + tokenizer; return the folder.

    ``arch`` is ``"llama"`` or ``"qwen2"``. The same arguments give the same weights
    and tokenizer (seeded). ``initializer_range`` is larger than the usual 0.02 so that
    the random model's next-token distributions differ visibly between prompts.
    """
    from transformers import PreTrainedTokenizerFast

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = _train_tokenizer(vocab_size, extra_texts)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token=None, clean_up_tokenization_spaces=False)
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))

    spec = TinyLMSpec(arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      max_positions=max_positions, tie_word_embeddings=True, initializer_range=initializer_range)
    model = build_tiny_lm(tokenizer, spec, seed)
    model.save_pretrained(str(folder))
    honour_umask(folder)
    return folder


# --------------------------------------------------------------------------- a tiny policy

POLICY_CORPUS = [
    "<think> I should look up who wrote the novel. </think> <search> author of the novel Dune </search>",
    "<information>Doc 1(Title: Dune) Dune is a 1965 novel by Frank Herbert.</information>",
    "<think> The passage names the author. </think> <answer> Frank Herbert </answer>",
    "Rewrite the question below as a single search query. Question: what is the capital of France?",
    "Search query: capital city of France\n",
    "Answer the question below. Reason inside the think block, search when knowledge is missing.",
    "The Eiffel Tower is in Paris, the capital of France. Berlin is the capital of Germany.",
    "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
] * 4


def build_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer (any text encodes and decodes exactly) with
    ``<s>`` (BOS, prepended), ``</s>`` (EOS) and ``<pad>``. The format tags are
    ordinary text, split into several tokens as in most real tokenizers."""
    from transformers import PreTrainedTokenizerFast

    core = train_bpe_tokenizer(POLICY_CORPUS, vocab_size, ["<pad>", "<s>", "</s>"], bos="<s>")
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(tokenizer: Any, *, seed: int = 0, hidden: int = 32, layers: int = 2, context: int = 512,
                arch: str = "llama") -> Any:
    """A random causal LM sized for ``tokenizer`` (:func:`calibrl.tiny_lm.build_tiny_lm`),
    in eval mode. The output projection is redrawn from N(0, 1): a default-initialised
    tiny model is nearly uniform, which makes greedy ties (and flaky comparisons) likely."""
    spec = TinyLMSpec(arch=arch, hidden_size=hidden, num_layers=layers, num_heads=4, max_positions=context,
                      tie_word_embeddings=False, lm_head_std=1.0)
    return build_tiny_lm(tokenizer, spec, seed).eval()


def save_tiny_policy(folder: pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write a tiny model and its tokenizer as a ``save_pretrained`` folder."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    honour_umask(folder)
    return folder
