"""Distil SME feedback into a rubric and a golden hold-out set.

Steps (all deterministic: same feedback, same rubric, byte for byte):

1. **Split.** A record goes to the golden hold-out when the first 64 bits of the
   hash of its (query, output) text (:func:`text_key`: case and spacing folded),
   read as a fraction of 2**64, fall below ``golden_fraction``. The split depends on
   the record alone, so adding records never moves old ones; and two reviews of the
   same (query, output) text (another expert, another grade) always land on the same
   side, so no golden text is ever trained on.
2. **Cost of each error tag** (training records only). A record's grade is its
   expert grade, or 5 / 1 for a verdict-only pass / fail. The baseline is the mean
   grade of error-free records (5 when there are none). For tag t:
   ``frequency_t = n_t / n_train``, ``severity_t = max(0, baseline - mean grade of
   records tagged t)``.
3. **Criteria.** A known tag (see :data:`RECIPES`, aliases folded) becomes a
   programmatic criterion and/or an LLM question, as ``criteria_mode`` asks; an
   unknown tag becomes an LLM criterion with a generated question ("Is the output
   free of ...", citing the shortest expert note that carries the tag).
4. **Weights.** Non-critical tags: ``weight_t = frequency_t x severity_t``, normalised
   to sum to 1 over the rubric (split between a tag's programmatic and LLM criteria
   by ``llm_share``); tags seen fewer than ``min_count`` times or with no grade cost
   are left out (and named in the description). Critical tags (invented entities,
   compliance leaks, ``critical_tags``) become penalty criteria whatever their
   frequency: a rare critical error is still critical, so their weight is the share
   of the total a violation costs, ``clip(severity / 4, 0.25, 1)`` (4 = the width of
   the 1-5 grade scale).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal, Sequence

from calibrl.errors import ConfigError
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.judge_server.prompts import DEFAULT_INSTRUCTIONS
from calibrl.judge_server.rubric import Criterion, Rubric

CriteriaMode = Literal["both", "programmatic", "llm"]


@dataclass(frozen=True)
class TagRecipe:
    """How a known error tag becomes criteria. ``name`` says what a high score means."""

    name: str
    scorer: str = ""
    question: str = ""
    good_answer: Literal["yes", "no"] = "yes"
    critical: bool = False


RECIPES: dict[str, TagRecipe] = {
    "missed_intent": TagRecipe(
        "intent", "intent_similarity", "Does the output keep the intent of the user's query?"),
    "missing_entity": TagRecipe(
        "entities", "entity_coverage",
        "Does the output keep every key entity of the query (names, products, tickers, codes, dates)?"),
    "underspecified": TagRecipe(
        "specificity", "specificity",
        "Is the output specific enough to retrieve the right documents, with the concrete terms a search needs?"),
    "too_long": TagRecipe("length", "length", "Is the output a concise search query rather than a long passage?"),
    "bad_format": TagRecipe(
        "format", "format", "Is the output a single well-formed search query with no preamble or commentary?"),
    "invented_entity": TagRecipe(
        "no_invented_entities", "invented_entities",
        "Does the output mention a name, product, code or number that appears neither in the query nor in the "
        "retrieved documents?", good_answer="no", critical=True),
    "compliance_leak": TagRecipe(
        "no_compliance_leak", "compliance_leak",
        "Does the output contain personal or account identifiers such as account, card or social security "
        "numbers or e-mail addresses?", good_answer="no", critical=True),
}

ALIASES: dict[str, str] = {
    "intent_drift": "missed_intent", "wrong_intent": "missed_intent", "lost_intent": "missed_intent",
    "missing_entities": "missing_entity", "dropped_entity": "missing_entity",
    "under_specified": "underspecified", "vague": "underspecified", "too_vague": "underspecified",
    "verbose": "too_long", "format_error": "bad_format", "formatting": "bad_format",
    "invented_entities": "invented_entity", "hallucinated_entity": "invented_entity",
    "hallucination": "invented_entity",
    "pii_leak": "compliance_leak", "pii": "compliance_leak", "leak": "compliance_leak",
}

# Programmatic-only for these: a regex is exact where an LLM question adds nothing.
_PROGRAMMATIC_ONLY = {"compliance_leak"}


@dataclass
class DistillOptions:
    rubric_id: str = "distilled"
    version: str = "1"
    golden_fraction: float = 0.3
    criteria_mode: CriteriaMode = "both"
    llm_share: float = 0.5
    min_count: int = 2
    critical_tags: tuple[str, ...] = ()
    glossary: tuple[str, ...] = ()

    def validate(self) -> None:
        if not 0.0 <= self.golden_fraction < 1.0:
            raise ConfigError(f"golden_fraction={self.golden_fraction}: must be in [0, 1)")
        if not 0.0 < self.llm_share < 1.0:
            raise ConfigError(f"llm_share={self.llm_share}: must be in (0, 1)")
        if self.min_count < 1:
            raise ConfigError(f"min_count={self.min_count}: must be >= 1")
        if self.criteria_mode not in ("both", "programmatic", "llm"):
            raise ConfigError(f"criteria_mode={self.criteria_mode!r}: must be both, programmatic or llm")


@dataclass(frozen=True)
class TagStats:
    tag: str
    count: int
    frequency: float
    mean_grade: float
    severity: float
    critical: bool
    criteria: tuple[str, ...] = ()
    skipped: str = ""


@dataclass
class DistillResult:
    rubric: Rubric
    train: list[FeedbackRecord]
    golden: list[FeedbackRecord]
    baseline_grade: float
    tags: list[TagStats] = field(default_factory=list)


def canonical_tag(tag: str) -> str:
    return ALIASES.get(tag, tag)


def text_key(record: FeedbackRecord) -> str:
    """SHA-256 of a record's (query, output) text, case and spacing folded: reviews of the
    same rewrite of the same query share it, whoever graded them and however."""
    import hashlib
    import json

    folded = [" ".join(record.query.lower().split()), " ".join(record.output.lower().split())]
    return hashlib.sha256(json.dumps(folded, ensure_ascii=False).encode("utf-8")).hexdigest()


def is_golden(record: FeedbackRecord, golden_fraction: float) -> bool:
    """The deterministic hold-out rule (see module doc): by the record's (query, output) text."""
    return int(text_key(record)[:16], 16) / 2**64 < golden_fraction


def split_golden(records: Sequence[FeedbackRecord], golden_fraction: float) -> tuple[list, list]:
    train = [r for r in records if not is_golden(r, golden_fraction)]
    golden = [r for r in records if is_golden(r, golden_fraction)]
    return train, golden


def grade_value(record: FeedbackRecord) -> float:
    if record.grade is not None:
        return float(record.grade)
    return 5.0 if record.verdict == "pass" else 1.0


def _generated_question(tag: str, notes: list[str]) -> str:
    text = f"Is the output free of this problem that experts flagged: {tag.replace('_', ' ')}?"
    if notes:
        example = min(notes, key=lambda n: (len(n), n)).strip().replace("\n", " ")
        text += f' (An expert described it as: "{example[:200]}")'
    return text


def _tag_stats(train: Sequence[FeedbackRecord],
               critical: set[str]) -> tuple[float, dict[str, list[FeedbackRecord]], dict[str, TagStats]]:
    """(baseline grade of the error-free records, the records of each canonical tag, each tag's stats)."""
    clean = [grade_value(r) for r in train if not r.error_tags]
    baseline = sum(clean) / len(clean) if clean else 5.0
    by_tag: dict[str, list[FeedbackRecord]] = defaultdict(list)
    for record in train:
        for tag in sorted({canonical_tag(t) for t in record.error_tags}):
            by_tag[tag].append(record)

    stats: dict[str, TagStats] = {}
    for tag in sorted(by_tag):
        tagged = by_tag[tag]
        mean_grade = sum(grade_value(r) for r in tagged) / len(tagged)
        severity = round(max(0.0, baseline - mean_grade), 4)
        stats[tag] = TagStats(tag, len(tagged), round(len(tagged) / len(train), 4), round(mean_grade, 4),
                              severity, tag in critical)
    return baseline, by_tag, stats


def _recipe_for(tag: str, critical: set[str], tagged: Sequence[FeedbackRecord]) -> TagRecipe:
    """The known recipe of ``tag``, or a yes/no question generated from its records' notes."""
    if tag in RECIPES:
        recipe = RECIPES[tag]
        return TagRecipe(recipe.name, recipe.scorer, recipe.question, recipe.good_answer, tag in critical)
    notes = [r.notes for r in tagged if r.notes.strip()]
    return TagRecipe(f"no_{tag}"[:64], "", _generated_question(tag, notes), "yes", tag in critical)


def _criterion_kinds(tag: str, recipe: TagRecipe, criteria_mode: str) -> list[str]:
    """Which criterion kinds a tag gets under the mode ("programmatic", "llm")."""
    kinds = []
    if recipe.scorer and criteria_mode in ("both", "programmatic"):
        kinds.append("programmatic")
    if recipe.question and (criteria_mode == "llm" or (
            criteria_mode == "both" and (tag not in _PROGRAMMATIC_ONLY or not recipe.scorer))):
        kinds.append("llm")
    return kinds


def _tag_criteria(tag: str, s: TagStats, recipe: TagRecipe, kinds: list[str], tag_weight: float,
                  llm_share: float) -> list[Criterion]:
    """The criteria of one tag: one per kind, the tag's weight shared ``1 - llm_share`` / ``llm_share``
    when it gets both."""
    shares = {"programmatic": 1.0 - llm_share, "llm": llm_share} if len(kinds) == 2 else {kinds[0]: 1.0}
    criteria = []
    for kind in kinds:
        weight = round(tag_weight * shares[kind], 4)
        if kind == "programmatic":
            criteria.append(Criterion(recipe.name, "programmatic", weight, s.severity, s.critical,
                                      scorer=recipe.scorer, tags=(tag,)))
        else:
            name = recipe.name + ("_llm" if "programmatic" in kinds else "")
            criteria.append(Criterion(name, "llm", weight, s.severity, s.critical, question=recipe.question,
                                      scale="yes_no", good_answer=recipe.good_answer, tags=(tag,)))
    return criteria


def distill(records: Sequence[FeedbackRecord], options: DistillOptions | None = None) -> DistillResult:
    """Build the rubric and the golden set from SME feedback records."""
    options = options or DistillOptions()
    options.validate()
    if not records:
        raise ConfigError("no feedback records to distil")
    train, golden = split_golden(records, options.golden_fraction)
    if not train:
        raise ConfigError(
            f"golden_fraction={options.golden_fraction} left no training records out of {len(records)}")
    critical = {canonical_tag(t) for t in options.critical_tags} | {t for t, r in RECIPES.items() if r.critical}

    baseline, by_tag, stats = _tag_stats(train, critical)

    def recipe_for(tag: str) -> TagRecipe:
        return _recipe_for(tag, critical, by_tag[tag])

    def parts(tag: str, recipe: TagRecipe) -> list[str]:
        return _criterion_kinds(tag, recipe, options.criteria_mode)

    positive_raw: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for tag, s in stats.items():
        kinds = parts(tag, recipe_for(tag))
        if not kinds:
            skipped[tag] = f"no {options.criteria_mode} criterion for this tag"
        elif s.critical:
            continue
        elif s.count < options.min_count:
            skipped[tag] = f"seen {s.count} < min_count={options.min_count} times"
        elif s.frequency * s.severity <= 0:
            skipped[tag] = "no grade cost"
        else:
            positive_raw[tag] = s.frequency * s.severity
    if not positive_raw:
        raise ConfigError(
            "the feedback has no non-critical error tag with a grade cost (after min_count="
            f"{options.min_count}); tags seen: {dict((t, s.count) for t, s in stats.items()) or 'none'}. "
            "A rubric needs at least one non-penalty criterion: collect more graded feedback or lower --min-count.")
    total_raw = sum(positive_raw.values())

    criteria: list[Criterion] = []
    final_stats: list[TagStats] = []
    for tag, s in stats.items():
        if tag in skipped:
            final_stats.append(TagStats(**{**s.__dict__, "skipped": skipped[tag]}))
            continue
        recipe = recipe_for(tag)
        kinds = parts(tag, recipe)
        if s.critical:
            tag_weight = min(1.0, max(0.25, s.severity / 4.0))
        else:
            tag_weight = positive_raw[tag] / total_raw
        new = _tag_criteria(tag, s, recipe, kinds, tag_weight, options.llm_share)
        criteria.extend(new)
        final_stats.append(TagStats(**{**s.__dict__, "criteria": tuple(c.name for c in new)}))

    criteria.sort(key=lambda c: (c.penalty, -c.weight, c.name))
    description = (
        f"Distilled from {len(records)} SME feedback records ({len(train)} used, {len(golden)} held out as the "
        f"golden set); baseline grade of error-free records {baseline:.2f}; criteria mode {options.criteria_mode}."
    )
    if skipped:
        description += " Tags left out: " + "; ".join(f"{t} ({why})" for t, why in sorted(skipped.items())) + "."
    has_llm = any(c.kind == "llm" for c in criteria)
    rubric = Rubric(
        id=options.rubric_id,
        version=options.version,
        description=description,
        criteria=tuple(criteria),
        instructions=DEFAULT_INSTRUCTIONS if has_llm else "",
        glossary=tuple(sorted(set(options.glossary), key=lambda t: (t.lower(), t))),
    )
    return DistillResult(rubric, train, golden, baseline, final_stats)
