"""Prompt building and score extraction shared by the LLM backends (transformers, vLLM).

A judge prompt is ``prefix + suffix``. The prefix is the same for every criterion of
an item (instructions, query, output, retrieved passages), so backends compute it
once (transformers: one KV cache per item; vLLM: prefix caching). The suffix asks
one criterion's question and ends right where the answer token goes::

    <instructions>

    User query: vtsax expense ratio
    Agent output: What is the expense ratio of the VTSAX fund?
    Retrieved documents:
    [1] VTSAX has an expense ratio of ...

    Question: Does the output keep every key entity of the query?
    Answer yes or no.
    Answer:

The score comes from the next-token distribution, no text is parsed:

- ``yes_no``: ``P(yes) / (P(yes) + P(no))``, with P summed over the single-token
  spellings of each answer (``yes``, `` yes``, ``Yes``, ...); when the criterion's
  ``good_answer`` is ``no`` the score is ``1 - that``.
- ``likert_1_5``: ``E[k] = sum_k k P(k) / sum_k P(k)`` over the digits 1-5, mapped
  to [0, 1] as ``(E[k] - 1) / 4``.

Generation-and-parse (:func:`parse_answer`) exists for comparison only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from calibrl.errors import ConfigError
from calibrl.judge_server.rubric import Criterion
from calibrl.api.judge import JudgeItem

DEFAULT_INSTRUCTIONS = (
    "You are a strict reviewer of a retrieval agent. The agent rewrote a user's query into a search query "
    "for a fixed document index. Read the query, the agent's output and the documents it retrieved, then "
    "answer the question about the output."
)

_YES = ("yes", "Yes", "YES")
_NO = ("no", "No", "NO")
_DIGITS = ("1", "2", "3", "4", "5")
SPLIT_MARK = "\u2063CALIBRL-SPLIT\u2063"


@dataclass(frozen=True)
class PromptOptions:
    max_docs: int = 5
    max_doc_chars: int = 600


def item_prefix(item: JudgeItem, instructions: str, options: PromptOptions = PromptOptions()) -> str:
    """The shared part of every criterion prompt of ``item``."""
    lines = [instructions.strip() or DEFAULT_INSTRUCTIONS, "", f"User query: {item.query.strip()}",
             f"Agent output: {item.output.strip()}"]
    docs = item.retrieved_texts[: options.max_docs]
    if docs:
        lines.append("Retrieved documents:")
        for rank, text in enumerate(docs, start=1):
            text = " ".join(text.split())
            if len(text) > options.max_doc_chars:
                text = text[: options.max_doc_chars].rstrip() + " ..."
            lines.append(f"[{rank}] {text}")
    return "\n".join(lines) + "\n\n"


def criterion_suffix(criterion: Criterion) -> str:
    """The question part of a prompt; ends where the answer token goes."""
    if criterion.scale == "likert_1_5":
        how = "Answer with one number from 1 (worst) to 5 (best)."
    else:
        how = "Answer yes or no."
    return f"Question: {criterion.question.strip()}\n{how}\nAnswer:"


def chat_parts(apply_template: Callable[[str], str], prefix: str, suffix: str) -> tuple[str, str]:
    """Wrap prefix+suffix in a chat template as one user turn and split the rendered
    text back into (shared prefix, criterion suffix). ``apply_template(content)``
    renders one user message with the generation prompt."""
    rendered = apply_template(prefix + SPLIT_MARK + suffix)
    if rendered.count(SPLIT_MARK) != 1:
        raise ConfigError("the chat template altered the prompt; set use_chat_template=false")
    head, tail = rendered.split(SPLIT_MARK)
    return head, tail


@dataclass(frozen=True)
class AnswerTokens:
    """Token ids of the single-token spellings of each possible answer."""

    yes: tuple[int, ...]
    no: tuple[int, ...]
    digits: tuple[tuple[int, ...], ...]  # one tuple per grade 1..5

    def all_ids(self) -> tuple[int, ...]:
        ids = set(self.yes) | set(self.no)
        for group in self.digits:
            ids |= set(group)
        return tuple(sorted(ids))

    def for_scale(self, scale: str) -> tuple[int, ...]:
        if scale == "likert_1_5":
            return tuple(sorted({i for group in self.digits for i in group}))
        return tuple(sorted(set(self.yes) | set(self.no)))


def answer_tokens(encode: Callable[[str], Sequence[int]], need_likert: bool = True) -> AnswerTokens:
    """Find the answer token ids with ``encode(text) -> ids`` (no special tokens).
    Spellings that are not a single token are skipped; an answer with no single-token
    spelling is a configuration error (the model cannot be scored from one token)."""

    def single(variants: Sequence[str]) -> tuple[int, ...]:
        ids: set[int] = set()
        for word in variants:
            for spelling in (word, " " + word):
                encoded = list(encode(spelling))
                if len(encoded) == 1:
                    ids.add(encoded[0])
        return tuple(sorted(ids))

    yes, no = single(_YES), single(_NO)
    digits = tuple(single((d,)) for d in _DIGITS)
    missing = [name for name, ids in (("yes", yes), ("no", no)) if not ids]
    if need_likert:
        missing += [d for d, ids in zip(_DIGITS, digits) if not ids]
    if missing:
        raise ConfigError(f"the judge tokenizer has no single-token spelling of {missing}; "
                          "this model cannot be scored from next-token probabilities")
    if set(yes) & set(no):
        raise ConfigError("the judge tokenizer maps 'yes' and 'no' to the same token")
    return AnswerTokens(yes, no, digits)


def _logsumexp(values: Sequence[float]) -> float:
    finite = [v for v in values if v != -math.inf]
    if not finite:
        return -math.inf
    top = max(finite)
    return top + math.log(sum(math.exp(v - top) for v in finite))


def score_from_logprobs(criterion: Criterion, logprob: Callable[[int], float], tokens: AnswerTokens) -> float:
    """A criterion's score in [0, 1] from the log-probabilities of the next token.
    ``logprob(token_id)`` may return -inf for a token it does not know (e.g. outside
    vLLM's returned top-k); when every answer token is unknown the score cannot be
    computed and a ValueError is raised (never a silent 0)."""
    if criterion.scale == "likert_1_5":
        masses = [_logsumexp([logprob(i) for i in group]) for group in tokens.digits]
        top = max(masses)
        if top == -math.inf:
            raise ValueError(f"criterion {criterion.name!r}: no probability on any of the answers 1-5")
        weights = [math.exp(m - top) for m in masses]
        expectation = sum((k + 1) * w for k, w in enumerate(weights)) / sum(weights)
        return (expectation - 1.0) / 4.0
    yes = _logsumexp([logprob(i) for i in tokens.yes])
    no = _logsumexp([logprob(i) for i in tokens.no])
    if yes == -math.inf and no == -math.inf:
        raise ValueError(f"criterion {criterion.name!r}: no probability on 'yes' or 'no'")
    p_yes = 1.0 / (1.0 + math.exp(no - yes)) if yes != -math.inf else 0.0
    return p_yes if criterion.good_answer == "yes" else 1.0 - p_yes


def score_from_logprob_map(criterion: Criterion, logprobs: Mapping[int, float], tokens: AnswerTokens) -> float:
    """:func:`score_from_logprobs` over a sparse ``{token_id: logprob}`` map (vLLM)."""
    return score_from_logprobs(criterion, lambda i: logprobs.get(i, -math.inf), tokens)


_ANSWER = re.compile(r"^\W*(yes|no|[1-5])\b", re.IGNORECASE)


def parse_answer(criterion: Criterion, generated: str) -> float | None:
    """Score from generated text (generate-and-parse mode); None when it cannot be parsed."""
    match = _ANSWER.match(generated)
    if not match:
        return None
    answer = match.group(1).lower()
    if criterion.scale == "likert_1_5":
        return (int(answer) - 1) / 4.0 if answer.isdigit() else None
    if answer not in ("yes", "no"):
        return None
    met = (answer == "yes") == (criterion.good_answer == "yes")
    return 1.0 if met else 0.0
