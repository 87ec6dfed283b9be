"""The search half of the demo's domain: two-search questions the agent must learn to ask.

A question names an employer retirement plan and asks for a fact of the fund the plan
invests in by default. The fund's name is in the plan's passage only (the *bridge
document*), so the second search needs a name that only the first one reveals; the fact
is in one of the fund's passages (the *answer document*).

Everything here is search-only and drawn from its own random stream
(``random.Random(f"{seed}-search")``): no entity, value or draw of the rewriter half
(:mod:`calibrl.demo.domain`) is used, so that half stays byte-identical whatever is
drawn here. The corpus, the index and the policies' tokenizer are shared.

- :data:`CLUSTERS` clusters, each a *plan family* (one company word, :data:`FAMILY_SIZE`
  plans that differ only in their industry word: "KaMe Logistics Retirement Plan",
  "KaMe Foods Retirement Plan", ...) and a *fund family* (one fund word,
  :data:`FAMILY_SIZE` funds that differ only in their style word: "SeBa Core Fund",
  "SeBa Select Fund", ...); the plans default to the funds by a random bijection. Family
  words are made-up words of two syllables (:func:`name_word`), so a name is copied, not
  known.
- Near misses compete for both searches: a first query without the industry word ties
  the sibling plans, a second query without the style word ties the sibling funds'
  passages of the aspect (BM25 scores them alike; one document per search).
- Each fund has one passage per aspect of :data:`SEARCH_ASPECTS`; every value is drawn
  uniformly, without replacement over all funds, from a set of at least 840 values, so no
  value repeats and no constant answer is right for more than one question.
- Splits by cluster, entity-disjoint (no plan, fund, company word or fund word is
  shared): :data:`TEST_CLUSTERS` clusters are the test split (``heldout``, one phrasing
  per question), :data:`VALIDATION_CLUSTERS` the validation split (one phrasing), the
  rest train in :data:`TRAIN_PHRASINGS` of 6 phrasings.

Design rules and hypotheses: experiments/LOG.md, D11 (the task), D14-D15 (names, the agent).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from calibrl.demo.domain import Aspect, Entity, Fact, MultiStepTask, Passage, SearchStep

CLUSTERS = 90
FAMILY_SIZE = 3  # plans per plan family = funds per fund family
TEST_CLUSTERS = 30  # 360 test questions
VALIDATION_CLUSTERS = 12  # 144 validation questions
TRAIN_PHRASINGS = 2  # of the six phrasings of each training question
SPLITS = ("train", "validation", "heldout")  # "heldout" is the test split

# Family words (a plan family's company word, a fund family's fund word) are made of NAME_SYLLABLES
# capitalised syllables ("KeLi"), and the policies' tokenizer splits a word at each inner capital
# (calibrl.demo.policy.train_tokenizer): every name is spelled with the same few pieces, so the agent
# can copy a name it has never seen, as it copies a value (experiments/LOG.md, D14).
SYLLABLES = ("Ba", "Be", "Bo", "Da", "De", "Di", "Fa", "Fe", "Fo", "Ga", "Gi", "Ka", "Ke", "Ko", "La", "Li", "Lo",
             "Ma", "Me", "Mi", "Na", "Ni", "No", "Pa", "Pe", "Po", "Ra", "Ri", "Ro", "Sa", "Se", "Ta")
NAME_SYLLABLES = 2


def name_word(rng: random.Random, taken: set[str]) -> str:
    """A family word of :data:`NAME_SYLLABLES` syllables that is no word of ``taken``
    (lower case); added to it."""
    while True:
        word = "".join(rng.choice(SYLLABLES) for _ in range(NAME_SYLLABLES))
        if word.lower() not in taken:
            taken.add(word.lower())
            return word


def family_words(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """``count`` family words of :func:`name_word`, where one that indexes as a word of the
    rewriter half's nicknames or colloquial phrasings ("DiMe" would match "nickel and dime")
    is replaced by one drawn from a stream of its own: ``rng`` draws what it would draw."""
    words = [name_word(rng, taken) for _ in range(count)]
    colliding = _colliding_words()
    for n, word in enumerate(words):
        if word in colliding:
            side = random.Random(f"replace-{word}")
            while word in colliding or word.lower() in taken:
                word = "".join(side.choice(SYLLABLES) for _ in range(NAME_SYLLABLES))
            taken.add(word.lower())
            words[n] = word
    return words


@functools.lru_cache(maxsize=1)
def _colliding_words() -> frozenset[str]:
    """The family words whose index token is a token of a nickname or colloquial phrasing
    of the rewriter half (which must find no corpus word)."""
    from calibrl.demo.domain import ACCOUNT_ASPECTS, ACCOUNTS, FUND_ASPECTS, FUNDS, MANAGERS
    from calibrl.retrieval_server.sparse import tokenize

    phrases = [alias for e in (*FUNDS, *ACCOUNTS, *MANAGERS) for alias in e.aliases]
    phrases += [t.replace("{e}", "") for a in (*FUND_ASPECTS, *ACCOUNT_ASPECTS) for t in a.colloquial]
    stems = {token for tokens in tokenize(phrases) for token in tokens}
    words = name_words()
    return frozenset(w for w, tokens in zip(words, tokenize(list(words))) if set(tokens) & stems)


def name_words() -> tuple[str, ...]:
    """Every family word a name may take."""
    words = [""]
    for _ in range(NAME_SYLLABLES):
        words = [w + s for w in words for s in SYLLABLES]
    return tuple(words)


_FUND_STYLES = ("Opportunity", "Core", "Strategic", "Allocation", "Select", "Enhanced", "Emerging", "Quality",
                "Momentum", "Sustainable")
# Employer plans: a company word (one per plan family) and an industry (shared).
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


def generated_fund_names() -> tuple[str, ...]:
    """Every name a generated fund may take (a fund's default-investment value)."""
    return tuple(f"{word} {style} Fund" for word in name_words() for style in _FUND_STYLES)



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
    """The text of the fund's passage of ``aspect`` stating ``value``. No ticker: the policies'
    tokenizer, trained on training text, made each training fund's ticker one token and split
    a held-out one into letters, so a held-out passage read unlike any training passage
    (experiments/LOG.md, D17)."""
    name = f"the {fund.name}"
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
            f"in the {fund.name}.")


DEFAULT_INVESTMENT = "default investment"


@dataclass(frozen=True)
class Link:
    """One plan of the search half: its family word, its default fund and that fund's family word."""

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
    """The name without its second word (the industry of a plan, the style of a fund): a
    near miss that BM25 ties with the entity's siblings."""
    words = entity.name.split()
    return " ".join([words[0], *words[2:]])


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
    words: set[str] = set()
    fund_words = family_words(rng, CLUSTERS, words)
    company_words = family_words(rng, CLUSTERS, words)
    taken: set[str] = set()
    links: list[Link] = []
    for cluster, (fund_word, company_word) in enumerate(zip(fund_words, company_words)):
        funds = []
        for style in rng.sample(_FUND_STYLES, FAMILY_SIZE):
            ticker = _ticker(rng, taken)
            taken.add(ticker)
            funds.append(Entity(f"{fund_word}-{style}".lower(), "fund", f"{fund_word} {style} Fund", (), ticker))
        plans = [Entity(f"{company_word}-{industry}".lower(), "account", f"{company_word} {industry} Retirement Plan",
                        ()) for industry in rng.sample(_INDUSTRIES, FAMILY_SIZE)]
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
           "TRAIN_PHRASINGS", "VALIDATION_CLUSTERS", "bridge_text", "careless_name", "fact_text", "first_query",
           "generated_fund_names", "search_half", "search_values", "second_query"]
