"""The demo's simulated subject-matter experts: the rewrites they review and how they grade them.

The experts grade from things no judge reads:

1. **The rewrite's hidden quality**, decided before its text exists. The review generator
   first picks what the rewrite does with the product (names it, keeps the user's nickname,
   drops it, names another product, makes up a ticker) and with the topic (catalogue terms,
   the user's slang, dropped, another topic), then writes a text that does exactly that. The
   experts read this :class:`RewriteQuality`, never the text: no word list, count or pattern
   of the text enters a grade.
2. **The retrieval outcome they check**: the rank of the gold passage when the rewrite is
   searched in the catalogue, with the experts' own keyword search (:class:`CatalogueSearch`).
3. **Their own habits**: each expert of the panel (:data:`PANEL`) notices a defect with
   their own probability, weighs it with their own harshness, cares more or less about a
   search that misses, and grades with their own noise.

Every expert of the panel grades every review; the feedback file carries the grade and the
error tags of the one expert each review was assigned to, as a real review queue does, and
the panel's pairwise agreement (:func:`panel_agreement`) is the most a judge can be expected
to reach. This module imports nothing from the judge (``calibrl.judge_server``) and shares no
list, threshold or rule with it (``tests/test_simulated_experts.py`` checks both).

The constants below were fixed before any judge was validated against the reviews they
produce (``docs/concepts/simulated-experts.md`` states the rule) and are not tuned on results.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from calibrl.demo.domain import INVENTED_ENTITY, MISSED_INTENT, MISSING_KEY_ENTITIES, UNDERSPECIFIED

if TYPE_CHECKING:  # pragma: no cover
    import pathlib

    from calibrl.demo.domain import Entity, Passage, RewriteTask
    from calibrl.json_types import JsonObject

# --- hidden quality -------------------------------------------------------------------------------------------------

# What a rewrite does with the product the user asked about, and with the topic.
PRODUCT_STATES = ("by_name", "by_nickname", "left_out", "another_product", "made_up")
TOPIC_STATES = ("in_catalogue_terms", "in_slang", "left_out", "another_topic")


@dataclass(frozen=True)
class RewriteQuality:
    """What a rewrite does, fixed by the generator before it writes the text."""

    product: str  # one of PRODUCT_STATES
    topic: str  # one of TOPIC_STATES

    def defects(self) -> tuple[str, ...]:
        """The defects an expert can find in a rewrite of this quality (keys of DEFECT_COST)."""
        found = []
        if self.product in ("by_nickname", "left_out"):
            found.append("product_not_named")
        elif self.product == "another_product":
            found.append("wrong_product")
        elif self.product == "made_up":
            found.append("made_up_product")
        if self.topic == "in_slang":
            found.append("topic_in_slang")
        elif self.topic == "left_out":
            found.append("topic_missing")
        elif self.topic == "another_topic":
            found.append("wrong_topic")
        if self.product in ("by_nickname", "left_out") and self.topic in ("in_slang", "left_out"):
            found.append("nothing_to_search_by")
        return tuple(found)


# Grade points each defect costs an expert of harshness 1, and the SME taxonomy tag they write for it.
DEFECT_COST = {"product_not_named": 1.65, "wrong_product": 2.85, "made_up_product": 3.35, "topic_in_slang": 1.15,
               "topic_missing": 1.85, "wrong_topic": 2.35, "nothing_to_search_by": 0.95}
DEFECT_TAG = {"product_not_named": MISSING_KEY_ENTITIES, "wrong_product": MISSED_INTENT,
              "made_up_product": INVENTED_ENTITY, "topic_in_slang": MISSED_INTENT, "topic_missing": UNDERSPECIFIED,
              "wrong_topic": MISSED_INTENT, "nothing_to_search_by": UNDERSPECIFIED}


# --- the reviewed rewrites ------------------------------------------------------------------------------------------

# How the rewrites sent for review were made (weights): what base rewriters produce, from
# verbatim copies to expert rewrites. A move states the quality it aims at; "as_query" keeps the query's.
REVIEW_MOVES = {
    "copy": (("as_query", "as_query"), 34),
    "name_product": (("by_name", "as_query"), 10),
    "use_terms": (("as_query", "in_catalogue_terms"), 10),
    "fix_both": (("by_name", "in_catalogue_terms"), 20),
    "drop_topic": (("by_name", "left_out"), 6),
    "drop_product": (("left_out", "in_catalogue_terms"), 6),
    "other_product": (("another_product", "in_catalogue_terms"), 5),
    "other_topic": (("by_name", "another_topic"), 5),
    "made_up_ticker": (("made_up", "in_catalogue_terms"), 4),
}
_PRODUCT_ONLY = ("{e}", "{e}?", "looking for {e}")
_TERMS_FORMS = ("{e} {t}", "{t} of {e}", "{t} for {e}")


def query_quality(task: "RewriteTask") -> RewriteQuality:
    """The hidden quality of a verbatim copy of ``task.query``: what the query's generator made
    it get wrong (its failure mode, :func:`calibrl.demo.domain.user_query`)."""
    names = task.failure_mode not in (MISSING_KEY_ENTITIES, UNDERSPECIFIED)
    catalogue_terms = task.failure_mode not in (MISSED_INTENT, UNDERSPECIFIED)
    return RewriteQuality("by_name" if names else "by_nickname",
                          "in_catalogue_terms" if catalogue_terms else "in_slang")


def reviewed_rewrite(task: "RewriteTask", move: str, rng: random.Random) -> tuple[str, RewriteQuality]:
    """A rewrite of ``task`` made by ``move`` (a key of REVIEW_MOVES) and its hidden quality."""
    own = query_quality(task)
    (product, topic), _ = REVIEW_MOVES[move]
    quality = RewriteQuality(own.product if product == "as_query" else product,
                             own.topic if topic == "as_query" else topic)
    if quality == own:
        return task.query, quality
    return _realise(task, quality, rng), quality


def _realise(task: "RewriteTask", quality: RewriteQuality, rng: random.Random) -> str:
    from calibrl.demo.domain import ACCOUNT_ASPECTS, ACCOUNTS, ASPECT_BY_KEY, ENTITY_BY_KEY, FUND_ASPECTS, FUNDS

    entity, aspect = ENTITY_BY_KEY[task.entity_key], ASPECT_BY_KEY[task.aspect_key]
    mention = _mention(entity, quality.product, task.query, rng, FUNDS if entity.kind == "fund" else ACCOUNTS)
    if quality.topic == "left_out":
        text = rng.choice(_PRODUCT_ONLY).format(e=mention or entity.kind)
    elif quality.topic == "in_slang":
        text = rng.choice(aspect.colloquial).format(e=mention or "it")
    else:
        if quality.topic == "another_topic":
            pool = FUND_ASPECTS if aspect.kind == "fund" else ACCOUNT_ASPECTS
            aspect = rng.choice([a for a in pool if a.key != aspect.key])
        terms = rng.choice(aspect.glossary)
        text = rng.choice(_TERMS_FORMS).format(e=mention, t=terms) if mention else terms
    text = " ".join(text.split())
    return text[0].upper() + text[1:]


def _mention(entity: "Entity", state: str, query: str, rng: random.Random, pool: Sequence["Entity"]) -> str:
    if state == "by_name":
        if entity.ticker and rng.random() < 0.2:
            return rng.choice((entity.ticker, f"{entity.name} ({entity.ticker})"))
        return entity.name
    if state == "by_nickname":
        return next((a for a in entity.aliases if a in query.lower()), rng.choice(entity.aliases))
    if state == "another_product":
        return rng.choice([e for e in pool if e.key != entity.key]).name
    if state == "made_up":
        return "".join(rng.choice("BCDFGHJKLMNPQRSTVWZ") for _ in range(4)) + "X"
    return ""


# --- the experts' catalogue search ----------------------------------------------------------------------------------


class CatalogueSearch:
    """The keyword search an expert runs to check a rewrite: Okapi BM25 over the catalogue's
    passages (title and text), words of letters and digits, lower case."""

    SATURATION = 1.2  # BM25 k1
    LENGTH_NORM = 0.75  # BM25 b

    def __init__(self, passages: Sequence["Passage"]) -> None:
        self.doc_ids = [p.doc_id for p in passages]
        self.counts = [Counter(_search_words(f"{p.title} {p.text}")) for p in passages]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = sum(self.lengths) / len(self.lengths)
        frequency = Counter(w for c in self.counts for w in c)
        n = len(passages)
        self.idf = {w: math.log(1 + (n - df + 0.5) / (df + 0.5)) for w, df in frequency.items()}

    def scores(self, text: str) -> list[float]:
        words = _search_words(text)
        k1, b = self.SATURATION, self.LENGTH_NORM
        out = []
        for counts, length in zip(self.counts, self.lengths):
            norm = k1 * (1 - b + b * length / self.mean_length)
            out.append(math.fsum(self.idf[w] * counts[w] * (k1 + 1) / (counts[w] + norm) for w in words if counts[w]))
        return out

    def gold_rank(self, text: str, gold_doc_id: str) -> int | None:
        """1-based rank of ``gold_doc_id`` (ties count against it); None when nothing of it matched."""
        scores = self.scores(text)
        gold = scores[self.doc_ids.index(gold_doc_id)]
        if gold <= 0:
            return None
        return 1 + sum(1 for doc_id, s in zip(self.doc_ids, scores) if s >= gold and doc_id != gold_doc_id)


def _search_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


# --- the experts ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expert:
    """One simulated SME's habits."""

    name: str
    notice: float  # probability of noticing each defect the rewrite has
    harshness: float  # multiplies every defect's cost
    leniency: float  # added to every grade (negative: a stricter grader)
    noise: float  # standard deviation of the expert's grade noise, in grade points
    search_miss_cost: float  # grade points off when the gold passage is not the search's first result

    def review(self, quality: RewriteQuality, gold_rank: int | None, rng: random.Random) -> tuple[int, tuple[str, ...]]:
        """(grade 1-5, error tags) this expert gives a rewrite of ``quality`` whose search put
        the gold passage at ``gold_rank``."""
        noticed = [d for d in quality.defects() if rng.random() < self.notice]
        points = 5.0 - self.harshness * math.fsum(DEFECT_COST[d] for d in noticed) + self.leniency
        if gold_rank != 1:
            points -= self.search_miss_cost
        points += rng.gauss(0.0, self.noise)
        grade = min(5, max(1, int(math.floor(points + 0.5))))
        return grade, tuple(dict.fromkeys(DEFECT_TAG[d] for d in noticed))


PANEL = (
    Expert("sme-ana", notice=0.93, harshness=1.0, leniency=0.0, noise=0.42, search_miss_cost=1.05),
    Expert("sme-ben", notice=0.86, harshness=1.12, leniency=-0.22, noise=0.55, search_miss_cost=1.35),
    Expert("sme-chloe", notice=0.89, harshness=0.88, leniency=0.18, noise=0.47, search_miss_cost=0.68),
)
PASS_GRADE = 4  # the feedback format's pass line (a grade of 4 or 5 is a pass)


@dataclass(frozen=True)
class PanelReview:
    """One reviewed rewrite: its hidden quality, the experts' search outcome, every expert's grade."""

    feedback_id: str
    task_id: str
    query: str
    rewrite: str
    quality: RewriteQuality
    gold_rank: int | None
    grades: dict[str, int]
    tags: dict[str, tuple[str, ...]]
    assigned: str  # the expert whose grade the feedback file carries
    move: str = ""

    def record(self) -> "JsonObject":
        return {"id": self.feedback_id, "task_id": self.task_id, "query": self.query, "output": self.rewrite,
                "move": self.move, "product": self.quality.product, "topic": self.quality.topic,
                "gold_rank": self.gold_rank, "grades": dict(self.grades),
                "error_tags": {k: list(v) for k, v in self.tags.items()}, "assigned": self.assigned}


def review_sample(train_tasks: Sequence["RewriteTask"], passages: Sequence["Passage"], rng: random.Random,
                  count: int = 300) -> list[PanelReview]:
    """``count`` rewrites of training queries, each graded by every expert of the panel and
    assigned to one of them in turn (shuffled)."""
    search = CatalogueSearch(passages)
    moves = list(REVIEW_MOVES)
    weights = [REVIEW_MOVES[m][1] for m in moves]
    reviews = []
    for i in range(count):
        task = rng.choice(train_tasks)
        move = rng.choices(moves, weights)[0]
        rewrite, quality = reviewed_rewrite(task, move, rng)
        rank = search.gold_rank(rewrite, task.gold_doc_ids[0])
        graded = {e.name: e.review(quality, rank, rng) for e in PANEL}
        reviews.append(PanelReview(f"sme-{i:04d}", task.task_id, task.query, rewrite, quality, rank,
                                   {k: g for k, (g, _) in graded.items()}, {k: t for k, (_, t) in graded.items()},
                                   PANEL[i % len(PANEL)].name, move))
    order = list(range(count))
    rng.shuffle(order)  # who reviews what does not follow the sample's order
    return [_assign(r, PANEL[order[i] % len(PANEL)].name) for i, r in enumerate(reviews)]


def _assign(review: PanelReview, expert: str) -> PanelReview:
    from dataclasses import replace

    return replace(review, assigned=expert)


@dataclass(frozen=True)
class PairKappa:
    """Two experts' agreement on pass/fail over every review, with its bootstrap interval."""

    first: str
    second: str
    kappa: float
    low: float
    high: float
    n_items: int
    n_tasks: int

    def to_json(self) -> "JsonObject":
        return {"first": self.first, "second": self.second, "kappa": self.kappa, "low": self.low, "high": self.high,
                "n_items": self.n_items, "n_tasks": self.n_tasks}


def panel_agreement(reviews: Sequence[PanelReview], *, seed: int = 0,
                    resamples: int | None = None) -> list[PairKappa]:
    """Cohen's kappa on pass/fail of each pair of experts over every review, with a 95%
    bootstrap interval that resamples whole tasks (the reviews of one query go together)."""
    from itertools import combinations

    from calibrl.stats import DEFAULT_RESAMPLES, kappa_interval

    resamples = DEFAULT_RESAMPLES if resamples is None else resamples
    names = [e.name for e in PANEL]
    tasks = [r.task_id for r in reviews]
    pairs = []
    for first, second in combinations(names, 2):
        interval = kappa_interval([r.grades[first] >= PASS_GRADE for r in reviews],
                                  [r.grades[second] >= PASS_GRADE for r in reviews], clusters=tasks,
                                  resamples=resamples, seed=seed)
        pairs.append(PairKappa(first, second, interval.estimate, interval.low, interval.high, len(reviews),
                               len(set(tasks))))
    return pairs


def read_panel(path: "str | pathlib.Path") -> list[PanelReview]:
    """The panel's reviews as :func:`calibrl.demo.domain.write_domain` wrote them (``sme_panel.jsonl``)."""
    import json
    import pathlib

    reviews = []
    for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            data = json.loads(line)
            reviews.append(PanelReview(
                data["id"], data["task_id"], data["query"], data["output"],
                RewriteQuality(data["product"], data["topic"]), data["gold_rank"], dict(data["grades"]),
                {k: tuple(v) for k, v in data["error_tags"].items()}, data["assigned"], data.get("move", "")))
    return reviews


def agreement_line(pairs: Sequence[PairKappa]) -> str:
    """One sentence: the experts' pairwise kappas with their intervals."""
    return "experts' pairwise Cohen's kappa on pass/fail: " + ", ".join(
        f"{p.first} vs {p.second} {p.kappa:.3f} [{p.low:.2f}, {p.high:.2f}]" for p in pairs) + (
        f" ({pairs[0].n_items} reviews, {pairs[0].n_tasks} tasks resampled)" if pairs else "")


__all__ = [
    "CatalogueSearch", "DEFECT_COST", "DEFECT_TAG", "Expert", "PANEL", "PairKappa", "PanelReview", "REVIEW_MOVES",
    "RewriteQuality", "agreement_line", "panel_agreement", "query_quality", "read_panel", "review_sample",
    "reviewed_rewrite",
]
