"""The search half of the demo's domain: two-search questions the agent must learn to ask.

A question names an employer retirement plan and asks for a fact of the fund the plan
invests in by default. The fund's name is in the plan's passage only (the *bridge
document*), so the second search needs a name that only the first one reveals; the fact
is in one of the fund's passages (the *answer document*).

Everything here is search-only and drawn from its own random stream
(``random.Random(f"{seed}-search")``): no entity, value or draw of the rewriter half
(:mod:`calibrl.demo.domain`) is used, so that half stays byte-identical whatever is
drawn here. The corpus, the index and the policies' tokenizer are shared.

- :data:`CLUSTERS` clusters, each a *plan family* (one four-digit family number,
  :data:`FAMILY_SIZE` plans that differ only in their industry word: "Logistics Retirement
  Plan 4821", "Foods Retirement Plan 4821", ...) and a *fund family* (another number,
  :data:`FAMILY_SIZE` funds that differ only in their style word: "Core Fund 7305",
  "Select Fund 7305", ...); the plans default to the funds by a random bijection. Names
  are copied digit by digit, as values are (the policies' tokenizer splits digits).
- Near misses compete for both searches: a first query without the industry word ties
  the sibling plans, a second query without the style word ties the sibling funds'
  passages of the aspect (BM25 scores them alike; one document per search).
- Each fund has one passage per aspect of :data:`SEARCH_ASPECTS`; every value is drawn
  uniformly, without replacement over all funds, from a set of at least 840 values, so no
  value repeats and no constant answer is right for more than one question.
- Splits by cluster, entity-disjoint (no plan, fund or family number is
  shared): :data:`TEST_CLUSTERS` clusters are the test split (``heldout``, one phrasing
  per question), :data:`VALIDATION_CLUSTERS` the validation split (one phrasing), the
  rest train in :data:`TRAIN_PHRASINGS` of 6 phrasings.

Design rules and hypotheses: experiments/LOG.md, D11-D13.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from calibrl.demo.domain import Aspect, Entity, Fact, MultiStepTask, Passage, SearchStep

CLUSTERS = 90
FAMILY_SIZE = 3  # plans per plan family = funds per fund family
TEST_CLUSTERS = 30  # 360 test questions
VALIDATION_CLUSTERS = 12  # 144 validation questions
TRAIN_PHRASINGS = 2  # of the six phrasings of each training question
SPLITS = ("train", "validation", "heldout")  # "heldout" is the test split

_FUND_STYLES = ("Opportunity", "Core", "Strategic", "Allocation", "Select", "Enhanced", "Emerging", "Quality",
                "Momentum", "Sustainable")
# Employer plans: a family number (one per plan family) and an industry word (one per plan of it).
_INDUSTRIES = ("Logistics", "Foods", "Robotics", "Textiles", "Shipping", "Pharmacy", "Printing", "Aerospace",
               "Ceramics", "Brewing", "Hospitality", "Furniture")
# Managers: a first and a last name, each used once (a manager's name words are all rare).
_FIRST_NAMES = ("Amara", "Bastian", "Chiara", "Dmitri", "Elena", "Farah", "Gideon", "Hana", "Ingrid", "Jonas",
                "Keiko", "Leon", "Marisol", "Nikhil", "Olga", "Pavel", "Rosa", "Soren", "Tamsin", "Viktor", "Yara",
                "Zane", "Anselm", "Beatriz", "Cormac", "Delphine", "Emeka", "Fiona", "Anouk", "Bruno", "Carys",
                "Desmond", "Esther", "Florian", "Greta", "Ilias", "Jovana", "Kwame")
_LAST_NAMES = (
    "Achterberg", "Bianchi", "Castellano", "Dimitrov", "Eriksen", "Fitzgerald", "Gonzaga", "Haddad", "Ivanova",
    "Jablonski", "Kowalczyk", "Laurent", "Mahlangu", "Nakamura", "Oyelaran", "Petrov", "Quintero", "Rasmussen",
    "Sandoval", "Takahashi", "Ueda", "Varga", "Wojcik", "Yilmaz", "Zielinski", "Baptiste", "Chaudhry", "Delacroix",
    "Esposito", "Fontaine", "Gallagher", "Horvath", "Iwasaki", "Jankowski", "Kovalenko", "Lindgren", "Mbeki",
    "Novak",
)
_TICKER_LETTERS = "BCDFGHJKLMNPQRSTVWZ"


FAMILY_NUMBERS = range(2100, 10_000)  # a family's number: four digits, never a year or value of a passage


def fund_name(style: str, number: int) -> str:
    return f"{style} Fund {number}"


def plan_name(industry: str, number: int) -> str:
    return f"{industry} Retirement Plan {number}"


def family_number(entity: Entity) -> str:
    """The number a plan or fund shares with its family (its name's last word)."""
    return entity.name.split()[-1]


def generated_fund_names() -> tuple[str, ...]:
    """Every name a generated fund may take (a fund's default-investment value)."""
    return tuple(fund_name(style, n) for n in FAMILY_NUMBERS for style in _FUND_STYLES)



_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")

# The facts a question may ask for: key, passage title, the catalogue's terms (what a search names).
SEARCH_ASPECTS = (
    Aspect("minimum_investment", "fund", "minimum initial investment", "minimum initial investment", (), ()),
    Aspect("total_assets", "fund", "total net assets", "total net assets", (), ()),
    Aspect("holdings", "fund", "number of holdings", "number of holdings securities", (), ()),
    Aspect("inception", "fund", "inception date", "inception date launched", (), ()),
)
_ASPECT_BY_KEY = {a.key: a for a in SEARCH_ASPECTS}


def search_values(aspect_key: str) -> tuple[str, ...]:
    """Every value a fund's fact of the aspect may take (each at least 840 of them)."""
    if aspect_key == "minimum_investment":
        return tuple(f"${n:,}" for n in range(1_000, 100_000, 100))
    if aspect_key == "total_assets":
        return tuple(f"${n} million" for n in range(100, 1_000))
    if aspect_key == "holdings":
        return tuple(str(n) for n in range(100, 1_000))
    if aspect_key == "inception":
        return tuple(f"{month} {year}" for year in range(1950, 2020) for month in _MONTHS)
    raise KeyError(f"aspect {aspect_key!r}: not one of {[a.key for a in SEARCH_ASPECTS]}")


def fact_text(fund: Entity, aspect: Aspect, value: str) -> str:
    """The text of the fund's passage of ``aspect`` stating ``value``."""
    name = f"the {fund.name} ({fund.ticker})"
    return {
        "minimum_investment": f"The minimum initial investment for {name} is {value}. Later purchases have no "
                              "minimum.",
        "total_assets": f"At the end of its last fiscal year {name} reported total net assets of {value}.",
        "holdings": f"The portfolio of {name} holds {value} securities; the number of holdings changes as securities are bought and sold.",
        "inception": f"{name[0].upper()}{name[1:]} was launched in {value}, its inception date.",
    }[aspect.key]


def bridge_text(plan: Entity, fund: Entity) -> str:
    """The plan's passage: the one place that names its default fund."""
    return (f"Unless the participant chooses otherwise, contributions to the {plan.name} are invested by default "
            f"in the {fund.name} ({fund.ticker}).")


DEFAULT_INVESTMENT = "default investment"


@dataclass(frozen=True)
class Link:
    """One plan of the search half: its default fund, and the cluster of their two families."""

    plan: Entity
    fund: Entity
    cluster: int

    @property
    def bridge_id(self) -> str:
        return f"{self.plan.key}-default-investment"


def careful_name(entity: Entity) -> str:
    """The entity's full catalogue name (what a search must name)."""
    return entity.name


def careless_name(entity: Entity) -> str:
    """The name without its first word (the industry of a plan, the style of a fund): a
    near miss that BM25 ties with the entity's siblings."""
    return " ".join(entity.name.split()[1:])


def first_query(link: Link, careless: bool = False) -> str:
    return f"{careless_name(link.plan) if careless else careful_name(link.plan)} {DEFAULT_INVESTMENT}"


def second_query(fund: Entity, aspect: Aspect, careless: bool = False) -> str:
    return f"{careless_name(fund) if careless else careful_name(fund)} {aspect.terms}"


@dataclass(frozen=True)
class SearchHalf:
    """What :func:`search_half` adds to the domain."""

    passages: list[Passage]
    facts: list[Fact]
    entities: list[Entity]  # the search-only plans and funds
    tasks: list[MultiStepTask]
    links: dict[str, Link]  # bridge document id -> its plan and default fund
    clusters: dict[str, int]  # task id -> its cluster


def search_half(seed: int) -> SearchHalf:
    """The search-only entities, their passages and facts, and every two-search task."""
    rng = random.Random(f"{seed}-search")
    numbers = rng.sample(FAMILY_NUMBERS, 2 * CLUSTERS)
    taken: set[str] = set()
    links: list[Link] = []
    for cluster, (fund_number, plan_number) in enumerate(zip(numbers[:CLUSTERS], numbers[CLUSTERS:])):
        funds = []
        for style in rng.sample(_FUND_STYLES, FAMILY_SIZE):
            ticker = _ticker(rng, taken)
            taken.add(ticker)
            funds.append(Entity(f"fund-{fund_number}-{style}".lower(), "fund", fund_name(style, fund_number), (),
                                ticker))
        plans = [Entity(f"plan-{plan_number}-{industry}".lower(), "account", plan_name(industry, plan_number), ())
                 for industry in rng.sample(_INDUSTRIES, FAMILY_SIZE)]
        rng.shuffle(funds)
        links += [Link(plan, fund, cluster) for plan, fund in zip(plans, funds)]
    funds = [link.fund for link in links]
    passages: list[Passage] = []
    facts: list[Fact] = []
    pools = {a.key: rng.sample(search_values(a.key), len(funds)) for a in SEARCH_ASPECTS}
    for n, fund in enumerate(funds):
        for aspect in SEARCH_ASPECTS:
            doc_id = f"{fund.key}-{aspect.key.replace('_', '-')}"
            value = pools[aspect.key][n]
            facts.append(Fact(fund, aspect, value, doc_id))
            passages.append(Passage(doc_id, f"{fund.name}: {aspect.title}", fact_text(fund, aspect, value)))
    for link in links:
        passages.append(Passage(link.bridge_id, f"{link.plan.name}: {DEFAULT_INVESTMENT}", bridge_text(link.plan,
                                                                                                     link.fund)))
    facts_by_doc = {f.doc_id: f for f in facts}
    order = list(range(CLUSTERS))
    rng.shuffle(order)
    split_of = {c: "heldout" for c in order[:TEST_CLUSTERS]}
    split_of.update({c: "validation" for c in order[TEST_CLUSTERS:TEST_CLUSTERS + VALIDATION_CLUSTERS]})
    tasks: dict[str, list[MultiStepTask]] = {s: [] for s in SPLITS}
    clusters: dict[str, int] = {}
    for link in links:
        split = split_of.get(link.cluster, "train")
        for aspect in SEARCH_ASPECTS:
            fact = facts_by_doc[f"{link.fund.key}-{aspect.key.replace('_', '-')}"]
            steps = (
                SearchStep(first_query(link), link.bridge_id, f"I need the {DEFAULT_INVESTMENT} of the plan first."),
                SearchStep(second_query(link.fund, aspect), fact.doc_id, f"Now the {aspect.title} of that fund."),
            )
            phrasings = [q.format(p=link.plan.name) for q in QUESTIONS[aspect.key]]
            chosen = (sorted(rng.sample(range(len(phrasings)), TRAIN_PHRASINGS)) if split == "train"
                      else [rng.randrange(len(phrasings))])
            for n in chosen:
                task = MultiStepTask(f"ms-{link.plan.key}-{aspect.key.replace('_', '-')}-{n}", phrasings[n],
                                     (fact.value,), (link.bridge_id, fact.doc_id), steps, split)
                tasks[split].append(task)
                clusters[task.task_id] = link.cluster
    for split in ("validation", "heldout"):  # a prefix of the file (what --quick evaluates) mixes the clusters
        rng.shuffle(tasks[split])
    entities = [*(link.plan for link in links), *funds]
    return SearchHalf(passages, facts, entities, [t for s in SPLITS for t in tasks[s]],
                      {link.bridge_id: link for link in links}, clusters)


def _ticker(rng: random.Random, taken: set[str]) -> str:
    while True:
        ticker = "".join(rng.choice(_TICKER_LETTERS) for _ in range(4)) + "X"
        if ticker not in taken:
            return ticker


# Six phrasings of each question; {p} is the plan's full name.
QUESTIONS = {
    "minimum_investment": (
        "What is the minimum initial investment of the default fund of the {p}?",
        "How much must I invest at first in the fund the {p} invests in by default?",
        "What minimum initial investment does the default investment of the {p} require?",
        "Tell me the minimum initial investment of the fund the {p} uses by default.",
        "If I choose nothing in the {p}, what minimum initial investment does that fund require?",
        "What is the smallest first purchase the default fund of the {p} accepts?"),
    "total_assets": (
        "What are the total net assets of the default fund of the {p}?",
        "How large, in net assets, is the fund the {p} invests in by default?",
        "Tell me the total net assets of the default investment of the {p}.",
        "How much money does the default fund of the {p} manage in total?",
        "If I choose nothing in the {p}, how big is that fund by total net assets?",
        "What total net assets did the fund the {p} uses by default hold?"),
    "holdings": (
        "How many securities does the default fund of the {p} hold?",
        "What is the number of holdings of the fund the {p} invests in by default?",
        "Tell me how many holdings the default investment of the {p} has.",
        "How many securities are in the portfolio of the default fund of the {p}?",
        "If I choose nothing in the {p}, how many holdings does that fund have?",
        "What number of securities does the fund the {p} uses by default hold?"),
    "inception": (
        "When was the default fund of the {p} launched?",
        "What is the inception date of the fund the {p} invests in by default?",
        "Tell me when the default investment of the {p} was launched.",
        "Since when has the default fund of the {p} existed?",
        "If I choose nothing in the {p}, when was that fund launched?",
        "What inception date does the fund the {p} uses by default have?"),
}


__all__ = ["CLUSTERS", "FAMILY_SIZE", "Link", "QUESTIONS", "SEARCH_ASPECTS", "SPLITS", "SearchHalf", "TEST_CLUSTERS",
           "TRAIN_PHRASINGS", "VALIDATION_CLUSTERS", "FAMILY_NUMBERS", "bridge_text", "careless_name", "fact_text",
           "family_number", "first_query", "fund_name", "generated_fund_names", "plan_name", "search_half", "search_values", "second_query"]
