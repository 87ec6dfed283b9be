"""Helpers for tests, benchmarks and demos: a tiny random causal LM and a synthetic,
deterministic set of SME feedback records. Nothing here downloads anything.

- :func:`build_tiny_causal_lm` trains a small byte-level BPE tokenizer on a built-in
  corpus (so " yes", " no" and the digits are single tokens), builds a randomly
  initialised Llama or Qwen2 model of a few hundred kB, and saves both to a folder
  that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load offline.
- :func:`synthetic_feedback` generates expert-graded rewrites of fund questions with
  the typical error modes (missing entity, missed intent, under-specification,
  invented entity, compliance leak, plus an unknown tag), with the glossary of the
  domain in :data:`SYNTHETIC_GLOSSARY`.
"""

from __future__ import annotations

import pathlib
import random
from typing import Iterable

from judge_server.feedback import FeedbackRecord

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = list(_BASE_CORPUS) * 20 + list(extra_texts) + [" yes", " no", " Yes", " No"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", bos)])
    return tokenizer


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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = _train_tokenizer(vocab_size, extra_texts)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token=None, clean_up_tokenization_spaces=False)
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))

    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions, initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    if arch == "llama":
        config, model_cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        raise ValueError(f"arch={arch!r}: must be 'llama' or 'qwen2'")
    torch.manual_seed(seed)
    model = model_cls(config)
    model.save_pretrained(str(folder))
    return folder


# --------------------------------------------------------------------------- synthetic SME feedback

_FUNDS = [
    ("VTSAX", "Vanguard Total Stock Market Index Fund"),
    ("VFIAX", "Vanguard 500 Index Fund"),
    ("VBTLX", "Vanguard Total Bond Market Index Fund"),
    ("VTIAX", "Vanguard Total International Stock Index Fund"),
    ("VGSLX", "Vanguard Real Estate Index Fund"),
    ("VWIAX", "Vanguard Wellesley Income Fund"),
    ("VIMAX", "Vanguard Mid-Cap Index Fund"),
    ("VSMAX", "Vanguard Small-Cap Index Fund"),
]
_TOPICS = [
    ("expense ratio", "charges an annual expense ratio of {x}% of assets"),
    ("minimum initial investment", "requires a minimum initial investment of ${x},000"),
    ("dividend schedule", "pays dividends every {x} months"),
    ("turnover rate", "reported a portfolio turnover rate of {x}%"),
    ("capital gains distribution", "made a capital gains distribution of ${x} per share"),
    ("top holdings", "lists its top holdings, the largest {x} positions by weight"),
]
_UNRELATED_INTENTS = [
    "How do I reset my online password?",
    "Where is the nearest branch office open on weekends?",
    "How do I change the mailing address on my profile?",
    "What are the customer service phone hours?",
]

SYNTHETIC_GLOSSARY: tuple[str, ...] = tuple(
    sorted({t for t, _ in _FUNDS} | {n for _, n in _FUNDS} | {t for t, _ in _TOPICS}))


def synthetic_feedback(n: int = 120, seed: int = 0) -> list[FeedbackRecord]:
    """``n`` deterministic SME-graded query rewrites (see module doc)."""
    rng = random.Random(seed)
    records = []
    kinds = (["clean"] * 45 + ["missing_entity"] * 14 + ["missed_intent"] * 12 + ["underspecified"] * 12
             + ["invented_entity"] * 8 + ["compliance_leak"] * 5 + ["wrong_time_period"] * 4)
    for index in range(n):
        ticker, name = rng.choice(_FUNDS)
        topic, fact = rng.choice(_TOPICS)
        kind = rng.choice(kinds)
        query = rng.choice([f"{ticker} {topic}", f"{ticker.lower()} {topic}?", f"whats the {topic} for {ticker}",
                            f"{topic} of {ticker} pls"])
        docs = [f"The {name} ({ticker}) {fact.format(x=rng.randint(2, 9))}.",
                f"{name} overview: an index fund offered by Vanguard with low costs.",
                f"{rng.choice(_FUNDS)[1]} {rng.choice(_TOPICS)[1].format(x=rng.randint(2, 9))}."]
        tags: list[str] = []
        notes = ""
        if kind == "clean":
            output = rng.choice([f"What is the {topic} of the {name} ({ticker})?",
                                 f"{name} ({ticker}) {topic}",
                                 f"{topic} of {ticker}, the {name}"])
            grade = rng.choice([4, 5, 5])
        elif kind == "missing_entity":
            output = rng.choice([f"What is the {topic} of this fund?", f"fund {topic}"])
            grade, tags, notes = rng.choice([2, 3]), ["missing_entity"], "dropped the fund ticker"
        elif kind == "missed_intent":
            output = rng.choice(_UNRELATED_INTENTS)
            grade, tags, notes = rng.choice([1, 2]), ["missed_intent", "missing_entity"], "not what the user asked"
        elif kind == "underspecified":
            output = rng.choice(["fund info", "info about this", "some details please"])
            grade, tags, notes = rng.choice([2, 3]), ["underspecified", "missing_entity"], "too vague to search"
        elif kind == "invented_entity":
            other = rng.choice([t for t, _ in _FUNDS if t != ticker] + ["VXQZX", "Fidelity Contrafund"])
            output = f"What is the {topic} of the {name} ({ticker}) compared with {other} and Morningstar ratings?"
            grade, tags, notes = 2, ["invented_entity"], "added a fund the user never mentioned"
        elif kind == "compliance_leak":
            account = f"{rng.randint(10_000_000, 99_999_999)}"
            query = f"my account {account} {ticker} {topic}"
            output = f"What is the {topic} of {ticker} for account {account}?"
            grade, tags, notes = 1, ["compliance_leak"], "account number sent to the index"
        else:
            output = f"What was the {topic} of the {name} ({ticker}) over the last decade?"
            grade, tags, notes = 3, ["wrong_time_period"], "user asked about now, not history"
        records.append(FeedbackRecord(
            query=query, output=output, grade=grade, error_tags=tuple(sorted(tags)),
            retrieved_doc_ids=(f"{ticker}-{topic.replace(' ', '-')}", f"{ticker}-overview", "other"),
            retrieved_texts=tuple(docs), gold_doc_ids=(f"{ticker}-{topic.replace(' ', '-')}",), notes=notes,
            id=f"syn-{seed}-{index:04d}",
        ))
    return records
