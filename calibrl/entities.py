"""Entity-like tokens and glossary terms: the text analysis behind the programmatic
criteria (entity coverage, invented entities, specificity).

There is no NER model here on purpose: the judge must be cheap and deterministic.
A token is *entity-like* when it carries a digit (``VTSAX2``, ``401k``, ``2023``),
two or more capitals (``ETF``, ``iShares``, ``McDonald``), or a capital that is not
explained by its position (a capitalised word that does not open a sentence and is
not a common function word). Glossary terms (multi-word, case-insensitive) cover the
domain vocabulary users type in lower case.

The query-similarity helpers at the end (:func:`repeats_earlier`) are what both the
judge's ``repeated_query`` criterion and the trainer's search-step rewards call a
repeated search.
"""

from __future__ import annotations

import re
from typing import Iterable

_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9&'\-./]*[A-Za-z0-9]|[A-Za-z0-9]")
_SENTENCE_END = re.compile(r"[.?!:;]\s*$")

# Function words and question words that are capitalised only by position or habit.
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its itself
    just me more most my myself no nor not now of off on once only or other our ours ourselves out
    over own same she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was we were what when where which while who
    whom why will with would you your yours yourself yourselves please tell show find give get
    list explain describe compare want need know like also per vs versus""".split()
)

# Words that make a search query vague rather than specific.
VAGUE_TERMS = frozenset(
    """thing things stuff info information something anything everything details detail data
    question questions help etc whatever somehow general generally various misc miscellaneous""".split()
)


def tokens(text: str) -> list[str]:
    """Word tokens (letters, digits and inner ``&'-./``), in order."""
    return _TOKEN.findall(text)


def _fold(word: str) -> str:
    """Case-fold and drop a plural ``s`` so ``ETFs`` matches ``ETF``."""
    word = word.lower().strip(".'")
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    return word


def folded_words(text: str) -> set[str]:
    """The folded form of every token of ``text`` (and of its ``-``/``/`` parts)."""
    words: set[str] = set()
    for token in tokens(text):
        words.add(_fold(token))
        for part in re.split(r"[-/.]", token):
            if part:
                words.add(_fold(part))
    return words


def is_entity_like(token: str, sentence_initial: bool) -> bool:
    """Whether a token looks like a name, code, ticker or number (see module doc)."""
    letters = [c for c in token if c.isalpha()]
    has_digit = any(c.isdigit() for c in token)
    if has_digit:
        return len(token) >= 2
    capitals = sum(1 for c in letters if c.isupper())
    if capitals >= 2 or any(c.isupper() for c in token[1:]):
        return True
    if capitals == 1 and token[0].isupper():
        return not sentence_initial and token.lower() not in STOPWORDS
    return False


def entity_tokens(text: str) -> list[str]:
    """Entity-like tokens of ``text``, in order of first appearance, without repeats."""
    found: list[str] = []
    seen: set[str] = set()
    previous_end = 0
    for match in _TOKEN.finditer(text):
        before = text[previous_end : match.start()]
        sentence_initial = previous_end == 0 or bool(_SENTENCE_END.search(before))
        previous_end = match.end()
        token = match.group(0)
        if is_entity_like(token, sentence_initial) and _fold(token) not in seen:
            seen.add(_fold(token))
            found.append(token)
    return found


def _phrase_pattern(term: str) -> re.Pattern[str]:
    words = [re.escape(w) for w in term.lower().split()]
    return re.compile(r"(?<![a-z0-9])" + r"\s+".join(words) + r"s?(?![a-z0-9])")


def glossary_terms_in(text: str, glossary: Iterable[str]) -> list[str]:
    """Glossary terms that occur in ``text`` (case-insensitive, whole words)."""
    lowered = text.lower()
    return [term for term in glossary if term.strip() and _phrase_pattern(term).search(lowered)]


def contains_term(text: str, term: str) -> bool:
    """Whether ``term`` (an entity token or glossary phrase) occurs in ``text``."""
    if " " in term.strip():
        return bool(_phrase_pattern(term).search(text.lower()))
    return _fold(term) in folded_words(text)


def content_words(text: str) -> list[str]:
    """Lower-cased tokens that are neither function words nor vague terms."""
    return [t.lower() for t in tokens(text) if t.lower() not in STOPWORDS and t.lower() not in VAGUE_TERMS]


def vague_words(text: str) -> list[str]:
    return [t.lower() for t in tokens(text) if t.lower() in VAGUE_TERMS]


# --- search queries: the search-step rubric's repeated_query and the trainer's step metrics share these

EARLIER_QUERIES_KEY = "earlier_queries"
# Word similarity at or above which a search query repeats an earlier one (repeated_query's default).
REPEAT_SIMILARITY = 0.7


def query_similarity(a: str, b: str) -> float:
    """Jaccard similarity of the folded content words of two queries (1 for two empty ones)."""
    words_a = {_fold(w) for w in content_words(a)}
    words_b = {_fold(w) for w in content_words(b)}
    if not words_a and not words_b:
        return 1.0
    return len(words_a & words_b) / len(words_a | words_b)


def repeats_earlier(query: str, earlier: Sequence[str], threshold: float = REPEAT_SIMILARITY) -> bool:
    """Whether ``query`` is at least ``threshold`` similar to any of the ``earlier`` queries."""
    return any(query_similarity(query, previous) >= threshold for previous in earlier)
