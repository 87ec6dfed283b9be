"""Programmatic criteria: scorers that need no LLM.

Each scorer takes a batch of items and returns one score in [0, 1] per item,
1 = criterion met; an item's score depends on that item only (batch-invariant: the
embedder encodes each text alone and the cosine is summed exactly). Scorers are
registered by name with their parameters and defaults; a rubric names a scorer
and overrides parameters (checked at rubric load, see ``calibrl.judge_server.rubric``).

=================== =====================================================================
scorer              score
=================== =====================================================================
entity_coverage     share of the query's entities (entity-like tokens and glossary terms
                    found in the query) that the output keeps; 1 when the query has none
intent_similarity   cosine(embed(query), embed(output)) mapped linearly from
                    [floor, ceiling] to [0, 1]
specificity         min(1, content words / min_terms) x (1 - share of vague words)
length              1 inside [min_words, max_words], falling linearly to 0 at half
                    min_words and at twice max_words
format              share of format checks passed (non-empty, single line, no
                    forbidden prefix, optional must_match regex)
invented_entities   1 - min(1, invented / max_invented); invented = entity-like tokens
                    of the output found neither in the query, the glossary nor the
                    retrieved texts. Meant as a penalty criterion.
glossary_terms      n = distinct glossary terms the output names: n / min_terms below
                    min_terms, 1 up to max_terms, then falling linearly to 0 at twice
                    max_terms (max_terms 0: no upper bound)
compliance_leak     0 when any compliance pattern (card number with a valid Luhn check,
                    account number, SSN, IBAN, e-mail, or the rubric's own regexes)
                    matches the output, else 1. Meant as a penalty criterion.
revealed_entity     search steps: 1 when the search query names an entity-like token of
                    the previous observation (the retrieved texts) that the question
                    lacks, else 0; 1 when the observation revealed none; with no
                    previous observation, the share of the question's entities the
                    query keeps (like entity_coverage)
repeated_query      search steps: 0 when the query's word similarity to an earlier query
                    of the trajectory (context key ``earlier_queries``, one a line) is
                    >= ``threshold``, else 1
=================== =====================================================================

A search step is judged as an item with query = the question, output = the search
query, retrieved texts = the previous step's passages (none for the first step) and
context ``earlier_queries`` = the trajectory's earlier queries, one a line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from calibrl import entities
# The query-similarity helpers are shared with the trainer's step rewards, so they live in the core.
from calibrl.entities import EARLIER_QUERIES_KEY, REPEAT_SIMILARITY, query_similarity, repeats_earlier  # noqa: F401
from calibrl.api.judge import JudgeItem
from calibrl.json_types import JsonObject, JsonValue

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

# Default compliance patterns: identifiers that must never reach the index.
DEFAULT_COMPLIANCE_PATTERNS: dict[str, str] = {
    "card_number": r"\b(?:\d[ -]?){12,18}\d\b",
    "account_number": r"(?i)\b(?:account|acct|a/c)\s*(?:no\.?|number|#)?\s*[:#]?\s*\d{6,}\b",
    "ssn": r"\b\d{3}-\d{2}-\d{4}\b",
    "iban": r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){3,7}(?: ?[A-Z0-9]{1,3})?\b",
    "email": r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b",
}


@dataclass(frozen=True)
class ScorerContext:
    """What scorers share beyond the item: the rubric's glossary and the embedder."""

    glossary: tuple[str, ...] = ()
    embed: Callable[[list[str]], "np.ndarray"] | None = None  # texts -> (n, d) unit-norm vectors


ScorerParams = Mapping[str, JsonValue]  # a criterion's params, as its rubric file states them
ScorerFn = Callable[[Sequence[JudgeItem], ScorerParams, ScorerContext], list[float]]


@dataclass(frozen=True)
class ScorerSpec:
    fn: ScorerFn
    defaults: ScorerParams
    needs_embedder: bool = False


def _clip01(value: float) -> float:
    return min(1.0, max(0.0, value))


def _glossary(params: ScorerParams, context: ScorerContext) -> tuple[str, ...]:
    return tuple(context.glossary) + tuple(params.get("glossary", ()))


def entity_coverage(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    glossary = _glossary(params, context)
    scores = []
    for item in items:
        found = entities.entity_tokens(item.query) + entities.glossary_terms_in(item.query, glossary)
        required = list({" ".join(term.lower().split()): term for term in found}.values())
        if not required:
            scores.append(1.0)
            continue
        contains = _term_finder(item.output)
        kept = sum(1 for term in required if contains(term))
        scores.append(kept / len(required))
    return scores


def _term_finder(text: str) -> Callable[[str], bool]:
    """``entities.contains_term(text, term)`` for many terms, with ``text`` tokenised once
    (once per term made entity coverage quadratic in the text's length)."""
    folded = entities.folded_words(text)
    lowered = text.lower()

    def contains(term: str) -> bool:
        if " " in term.strip():
            return bool(entities._phrase_pattern(term).search(lowered))
        return entities._fold(term) in folded

    return contains


def intent_similarity(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    if context.embed is None:
        raise RuntimeError("intent_similarity needs an embedder; the judge was built without one")
    floor, ceiling = float(params["floor"]), float(params["ceiling"])
    queries = context.embed([item.query for item in items])
    outputs = context.embed([item.output for item in items])
    return [_clip01((exact_dot(q, o) - floor) / (ceiling - floor)) for q, o in zip(queries, outputs)]


def exact_dot(a: "np.ndarray | Sequence[float]", b: "np.ndarray | Sequence[float]") -> float:
    """Inner product of two float32 vectors, correctly rounded: each product is exact in
    float64 and ``math.fsum`` sums without rounding error, so the result never depends
    on a BLAS kernel, the memory alignment or the batch the vectors came in."""
    import numpy as np

    return math.fsum((np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)).tolist())


def specificity(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    min_terms = int(params["min_terms"])
    scores = []
    for item in items:
        content = entities.content_words(item.output)
        vague = entities.vague_words(item.output)
        total = len(content) + len(vague)
        vague_share = len(vague) / total if total else 1.0
        scores.append(_clip01(min(1.0, len(content) / min_terms) * (1.0 - vague_share)))
    return scores


def length(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    low, high = int(params["min_words"]), int(params["max_words"])
    scores = []
    for item in items:
        n = len(item.output.split())
        if n < low:
            floor = low / 2
            scores.append(_clip01((n - floor) / (low - floor)) if low > floor else 0.0)
        elif n > high:
            scores.append(_clip01((2 * high - n) / high))
        else:
            scores.append(1.0)
    return scores


def output_format(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    prefixes = tuple(p.lower() for p in params["forbidden_prefixes"])
    pattern = re.compile(params["must_match"]) if params["must_match"] else None
    scores = []
    for item in items:
        text = item.output.strip()
        checks = [bool(text), not prefixes or not text.lower().startswith(prefixes)]
        if params["single_line"]:
            checks.append("\n" not in text)
        if pattern is not None:
            checks.append(bool(pattern.fullmatch(text)))
        scores.append(sum(checks) / len(checks))
    return scores


def invented_entity_list(item: JudgeItem, glossary: Sequence[str]) -> list[str]:
    """Entity-like tokens of the output found in neither the query, the glossary nor
    the retrieved texts."""
    sources = " \n ".join([item.query, *glossary, *item.retrieved_texts])
    known = entities.folded_words(sources)
    return [
        token
        for token in entities.entity_tokens(item.output)
        if entities._fold(token) not in known
        and not any(part and entities._fold(part) in known for part in re.split(r"[-/.]", token) if len(part) > 2)
    ]


def invented_entities(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    glossary = _glossary(params, context)
    max_invented = int(params["max_invented"])
    return [_clip01(1.0 - len(invented_entity_list(item, glossary)) / max_invented) for item in items]


def glossary_terms(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    glossary = list({" ".join(t.lower().split()): t for t in _glossary(params, context) if t.strip()}.values())
    low, high = int(params["min_terms"]), int(params["max_terms"])
    scores = []
    for item in items:
        contains = _term_finder(item.output)
        named = sum(1 for term in glossary if contains(term))
        if named < low:
            scores.append(named / low)
        elif high and named > high:
            scores.append(_clip01((2 * high - named) / high))
        else:
            scores.append(1.0)
    return scores


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def compliance_patterns(params: ScorerParams) -> dict[str, re.Pattern[str]]:
    named = dict(DEFAULT_COMPLIANCE_PATTERNS) if params["use_default_patterns"] else {}
    named.update(params["patterns"])
    return {name: re.compile(regex) for name, regex in named.items()}


def compliance_leaks(text: str, params: ScorerParams) -> list[str]:
    """Names of the compliance patterns that match ``text``."""
    leaks = []
    for name, pattern in compliance_patterns(params).items():
        for match in pattern.finditer(text):
            if name == "card_number" and params["luhn"]:
                digits = re.sub(r"\D", "", match.group(0))
                if not _luhn_ok(digits):
                    continue
            leaks.append(name)
            break
    return leaks


def compliance_leak(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    return [0.0 if compliance_leaks(item.output, params) else 1.0 for item in items]


def earlier_queries(item: JudgeItem) -> list[str]:
    """The trajectory's earlier queries a search-step item carries in its context."""
    text = dict(item.context).get(EARLIER_QUERIES_KEY, "")
    return [line.strip() for line in text.splitlines() if line.strip()]


def revealed_entities(item: JudgeItem) -> list[str]:
    """Entity-like tokens of the item's retrieved texts that the question does not contain."""
    known = entities.folded_words(item.query)
    found: dict[str, str] = {}
    for text in item.retrieved_texts:
        for token in entities.entity_tokens(text):
            if entities._fold(token) not in known:
                found.setdefault(entities._fold(token), token)
    return list(found.values())


def revealed_entity(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    scores = []
    for item in items:
        if not item.retrieved_texts:
            scores.extend(entity_coverage([item], {"glossary": []}, ScorerContext()))
            continue
        revealed = revealed_entities(item)
        if not revealed:
            scores.append(1.0)
        else:
            contains = _term_finder(item.output)
            scores.append(1.0 if any(contains(term) for term in revealed) else 0.0)
    return scores


def repeated_query(items: Sequence[JudgeItem], params: ScorerParams, context: ScorerContext) -> list[float]:
    threshold = float(params["threshold"])
    return [0.0 if repeats_earlier(item.output, earlier_queries(item), threshold) else 1.0 for item in items]


SCORERS: dict[str, ScorerSpec] = {
    "entity_coverage": ScorerSpec(entity_coverage, {"glossary": []}),
    "intent_similarity": ScorerSpec(intent_similarity, {"floor": 0.3, "ceiling": 0.8}, needs_embedder=True),
    "specificity": ScorerSpec(specificity, {"min_terms": 4}),
    "length": ScorerSpec(length, {"min_words": 3, "max_words": 40}),
    "format": ScorerSpec(
        output_format,
        {"single_line": True, "forbidden_prefixes": ["rewrite:", "rewritten query:", "query:"], "must_match": ""},
    ),
    "invented_entities": ScorerSpec(invented_entities, {"glossary": [], "max_invented": 1}),
    "glossary_terms": ScorerSpec(glossary_terms, {"glossary": [], "min_terms": 1, "max_terms": 4}),
    "compliance_leak": ScorerSpec(compliance_leak, {"patterns": {}, "use_default_patterns": True, "luhn": True}),
    "revealed_entity": ScorerSpec(revealed_entity, {}),
    "repeated_query": ScorerSpec(repeated_query, {"threshold": REPEAT_SIMILARITY}),
}


def check_params(scorer: str, params: ScorerParams) -> str | None:
    """Why ``params`` are not valid for ``scorer`` (None when they are). Used at rubric load."""
    spec = SCORERS[scorer]
    for key, value in params.items():
        if key not in spec.defaults:
            return f"unknown parameter {key!r} for scorer {scorer!r}; valid: {sorted(spec.defaults)}"
        default = spec.defaults[key]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        elif isinstance(default, list):
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        if not ok:
            return f"parameter {key!r} of scorer {scorer!r} must be like {default!r}, got {value!r}"
    merged = {**spec.defaults, **params}
    if scorer == "intent_similarity" and not -1.0 <= merged["floor"] < merged["ceiling"] <= 1.0:
        return f"intent_similarity needs -1 <= floor < ceiling <= 1, got {merged['floor']}, {merged['ceiling']}"
    if scorer == "specificity" and merged["min_terms"] < 1:
        return f"specificity.min_terms must be >= 1, got {merged['min_terms']}"
    if scorer == "length" and not 0 < merged["min_words"] <= merged["max_words"]:
        return f"length needs 0 < min_words <= max_words, got {merged['min_words']}, {merged['max_words']}"
    if scorer == "invented_entities" and merged["max_invented"] < 1:
        return f"invented_entities.max_invented must be >= 1, got {merged['max_invented']}"
    if scorer == "glossary_terms" and not (merged["min_terms"] >= 0 and merged["max_terms"] >= 0
                                           and (merged["max_terms"] == 0 or merged["min_terms"] <= merged["max_terms"])):
        return ("glossary_terms needs min_terms >= 0, max_terms >= 0 and min_terms <= max_terms (max_terms 0: no "
                f"upper bound), got {merged['min_terms']}, {merged['max_terms']}")
    if scorer == "repeated_query" and not 0.0 < merged["threshold"] <= 1.0:
        return f"repeated_query.threshold must be in (0, 1], got {merged['threshold']}"
    regexes = []
    if scorer == "format" and merged["must_match"]:
        regexes.append(("must_match", merged["must_match"]))
    if scorer == "compliance_leak":
        regexes.extend(merged["patterns"].items())
    for name, regex in regexes:
        try:
            re.compile(regex)
        except re.error as exc:
            return f"pattern {name!r} is not a valid regular expression ({exc}): {regex!r}"
    return None


def full_params(scorer: str, params: ScorerParams) -> JsonObject:
    """The scorer's defaults overridden by ``params``."""
    return {**SCORERS[scorer].defaults, **params}
