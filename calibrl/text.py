"""Answer normalisation and answer metrics, shared by the retrieval signals
(does a passage contain a gold answer?) and the trainer (answer EM / F1).

Normalisation follows the common QA convention: lower case, punctuation and
the articles a/an/the removed, white space collapsed.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, strip punctuation and articles, collapse white space."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: Iterable[str]) -> float:
    """Best token-level F1 of the prediction against the gold answers (0 with no gold)."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
            continue
        common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision = overlap / len(pred_tokens)
        recall = overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains_answer(passage: str, golds: Iterable[str]) -> bool:
    """Whether any non-empty normalised gold answer occurs in the normalised passage
    on word boundaries."""
    haystack = f" {normalize_answer(passage)} "
    for gold in golds:
        needle = normalize_answer(gold)
        if needle and f" {needle} " in haystack:
            return True
    return False
