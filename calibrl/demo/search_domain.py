"""The search half of the demo's domain: the two-search questions and their held-out split.

The rewriter half (:mod:`calibrl.demo.domain`: 12 funds, 6 accounts, their passages,
rewrite tasks, SME feedback, glossary) has too few chains for a held-out set with
power: 60 two-search questions, 21 of them held out. This module adds *search-only*
entities, drawn from their own random stream (``random.Random(f"{seed}-search")``) so
that the rewriter half stays byte-identical whatever is drawn here:

- :data:`NEW_FUNDS` generated funds (name from word lists, ticker, the six fund-aspect
  passages and a portfolio-manager passage);
- :data:`NEW_MANAGERS` generated managers (tenure and education passages);
- :data:`NEW_PLANS` employer retirement plans, each with one passage: its default
  investment, a fund no other account defaults to.

Two chains make the questions: account -> its default fund -> one of six fund facts,
and fund -> its manager -> one of two manager facts. A question's *answer document*
is the fact's passage. Every account has its own default fund, so the account chains
have distinct answer documents; a manager may manage several funds, so manager chains
may share one. The split is by answer document: :data:`HELDOUT_QUESTIONS` answer
documents are held out, each asked by exactly one chain in one phrasing (independent
questions, each with its own answer document); every chain whose answer document is
not held out trains, in :data:`TRAIN_PHRASINGS` phrasings. The other chains to a
held-out answer document are dropped, so no held-out answer document is gold in any
training question, nor in the warm start.

Names are built so that BM25 ranks the reference trajectory's passage first for each
search: every generated name has a first word no other name or passage uses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from calibrl.demo.domain import (
    ACCOUNT_ASPECTS,
    ACCOUNTS,
    FUND_ASPECTS,
    FUNDS,
    MANAGER_ASPECTS,
    Entity,
    Fact,
    MultiStepTask,
    Passage,
    SearchStep,
    _account_text,
    _doc_id,
    _fund_text,
    _manager_text,
    answer_of,
    value_choices,
)

NEW_FUNDS = 96
NEW_MANAGERS = 32
NEW_PLANS = 102  # every fund not yet a default becomes one
HELDOUT_QUESTIONS = 360  # of 724 answer documents (108 accounts x 6 fund facts + 38 managers x 2)
TRAIN_PHRASINGS = 2  # of the six phrasings of each training chain

# First words of generated fund names: one per fund, shared with no other name, passage,
# nickname or slang word of the domain.
_FUND_WORDS = (
    "Alder", "Birchwood", "Cedarbrook", "Driftwood", "Elmstead", "Fernhill", "Glenmoor", "Hawthorn", "Ironwood",
    "Juniper", "Kestrel", "Larkspur", "Maplewood", "Northgate", "Orchard", "Pinecrest", "Quarrystone", "Redwood",
    "Saltmarsh", "Thornbury", "Upland", "Valewood", "Willowby", "Yarrow", "Zephyr", "Bramble", "Clover", "Dunmore",
    "Eastwick", "Foxglove", "Goldcrest", "Heather", "Ivybridge", "Kingfisher", "Lindenfield", "Marigold", "Osprey",
    "Primrose", "Starling", "Tamarack", "Verbena", "Wrenfield", "Ashgrove", "Bluestone", "Coppice", "Dovecote",
    "Everholt", "Fallowfield", "Gorsemoor", "Hollyhock", "Inglewood", "Jasmine", "Knapweed", "Lavender",
    "Meadowsweet", "Nettlebed", "Oakhurst", "Peregrine", "Quillwort", "Rosebay", "Sorrel", "Teasel", "Umberleigh",
    "Vetchley", "Wychwood", "Yewdale", "Ambleside", "Bracken", "Campion", "Dogrose", "Eyebright", "Fieldfare",
    "Gannet", "Harebell", "Ibisford", "Kittiwake", "Lapwing", "Merlin", "Nightjar", "Oxlip", "Plover", "Redstart",
    "Sandpiper", "Whinchat", "Yellowhammer", "Avocet", "Bittern", "Curlew", "Dunlin", "Goldfinch", "Hornbeam",
    "Linnet", "Moorhen", "Pipistrelle", "Sedgefield", "Tansy",
)
_FUND_STYLES = ("Opportunity", "Core", "Strategic", "Allocation", "Select", "Enhanced", "Emerging", "Quality",
                "Momentum", "Sustainable")
# Employer plans: a company word (one per plan) and an industry (shared).
_COMPANY_WORDS = (
    "Abernathy", "Bellweather", "Corrigan", "Dalmore", "Everly", "Fairbanks", "Galloway", "Hollister", "Inverness",
    "Jessop", "Kimberton", "Langford", "Mowbray", "Newcombe", "Ormond", "Prescott", "Quincy", "Rutherford",
    "Stanwick", "Tolliver", "Underhill", "Vickery", "Whitlock", "Yardley", "Aldridge", "Blackwood", "Carrington",
    "Dunleavy", "Ellison", "Fenwick", "Garrick", "Hartwell", "Iverson", "Kendrick", "Lockhart", "Merriweather",
    "Northcott", "Pemberton", "Radcliffe", "Sheridan", "Thackeray", "Wexford", "Ashby", "Brockman", "Ainsworth",
    "Barrington", "Chadwick", "Davenport", "Eastbrook", "Fairweather", "Gresham", "Holloway", "Ingram", "Jellicoe",
    "Kensworth", "Marchbank", "Nettleton", "Oakley", "Pendleton", "Quimby", "Rowntree", "Sallowby", "Treadwell",
    "Upshaw", "Vandermeer", "Wakefield", "Yelverton", "Atherton", "Bexley", "Colbourne", "Drummond", "Egerton",
    "Fotheringham", "Grantham", "Haverford", "Islington", "Jarrow", "Kilbride", "Lowther", "Mansfield", "Norbury",
    "Overton", "Pickering", "Rushworth", "Stafford", "Tenbury", "Uxbridge", "Waverley", "Wolcott", "Aylward",
    "Brantley", "Cranston", "Dewhurst", "Elphick", "Farnsworth", "Gilchrist", "Huxtable", "Kirkwood", "Lambert",
    "Morland", "Nesbitt", "Pargeter",
)
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
    return tuple(f"{word} {style} Fund" for word in _FUND_WORDS for style in _FUND_STYLES)


@dataclass(frozen=True)
class Chain:
    """One two-search question before phrasing: bridge document, answer fact, reference searches."""

    chain_id: str
    questions: tuple[str, ...]  # its six phrasings
    answer: str
    bridge_id: str
    fact: Fact
    steps: tuple[SearchStep, ...]
    shortcut_query: str


@dataclass(frozen=True)
class SearchHalf:
    """What :func:`search_half` adds to the domain."""

    passages: list[Passage]
    facts: list[Fact]
    entities: list[Entity]  # the search-only funds, plans and managers
    tasks: list[MultiStepTask]


def search_half(seed: int, facts: Sequence[Fact], default_funds: Sequence[Entity],
                fund_managers: Sequence[Entity]) -> SearchHalf:
    """The search-only entities, their passages and facts, and every two-search task.
    ``facts``, ``default_funds`` and ``fund_managers``: the rewriter half's (its 12
    funds' managers and its 6 accounts' default funds stay as they are)."""
    rng = random.Random(f"{seed}-search")
    funds = _new_funds(rng)
    managers = _new_managers(rng)
    plans = _new_plans(rng)
    passages: list[Passage] = []
    new_facts: list[Fact] = []
    for fund in funds:
        for aspect in FUND_ASPECTS:
            value = rng.choice(value_choices(aspect.key))  # with replacement: 96 funds, pools of 4-12 values
            new_facts.append(Fact(fund, aspect, value, _doc_id(fund, aspect)))
            passages.append(Passage(_doc_id(fund, aspect), f"{fund.name}: {aspect.title}",
                                    _fund_text(fund, aspect, value)))
    for manager in managers:
        for aspect in MANAGER_ASPECTS:
            value = rng.choice(_manager_values(aspect.key))
            new_facts.append(Fact(manager, aspect, value, _doc_id(manager, aspect)))
            passages.append(Passage(_doc_id(manager, aspect), f"{manager.name}: {aspect.title}",
                                    _manager_text(manager, aspect, value)))
    # every new manager manages at least one new fund; the rest of the new funds draw a manager
    new_fund_managers = list(managers) + [rng.choice(managers) for _ in range(len(funds) - len(managers))]
    rng.shuffle(new_fund_managers)
    for fund, manager in zip(funds, new_fund_managers):
        passages.append(_manager_passage(fund, manager))
    # every plan defaults to a fund no other account defaults to
    taken = {f.key for f in default_funds}
    plan_defaults = rng.sample([f for f in (*FUNDS, *funds) if f.key not in taken], len(plans))
    default_aspect = next(a for a in ACCOUNT_ASPECTS if a.key == "default_investment")
    for plan, fund in zip(plans, plan_defaults):
        fact = Fact(plan, default_aspect, fund.name, _doc_id(plan, default_aspect))
        new_facts.append(fact)
        passages.append(Passage(fact.doc_id, f"{plan.name}: {default_aspect.title}",
                                _account_text(plan, default_aspect, fund.name)))
    by_pair = {(f.entity.key, f.aspect.key): f for f in (*facts, *new_facts)}
    chains = _account_chains(list(zip((*ACCOUNTS, *plans), (*default_funds, *plan_defaults))), by_pair)
    chains += _manager_chains(list(zip((*FUNDS, *funds), (*fund_managers, *new_fund_managers))), by_pair)
    return SearchHalf(passages, new_facts, [*funds, *plans, *managers], _split(chains, rng))


def _manager_values(aspect_key: str) -> tuple[str, ...]:
    """The values a generated manager's fact may take: no doctorate, whose stem ("doctor")
    is a word of the HSA's nickname, which must stay absent from the corpus."""
    return tuple(v for v in value_choices(aspect_key) if "doctorate" not in v)


def _new_funds(rng: random.Random) -> list[Entity]:
    taken = {f.ticker for f in FUNDS}
    funds = []
    for word in rng.sample(_FUND_WORDS, NEW_FUNDS):
        ticker = _ticker(rng, taken)
        taken.add(ticker)
        funds.append(Entity(word.lower(), "fund", f"{word} {rng.choice(_FUND_STYLES)} Fund", (), ticker))
    return funds


def _ticker(rng: random.Random, taken: set[str]) -> str:
    while True:
        ticker = "".join(rng.choice(_TICKER_LETTERS) for _ in range(4)) + "X"
        if ticker not in taken:
            return ticker


def _new_managers(rng: random.Random) -> list[Entity]:
    firsts = rng.sample(_FIRST_NAMES, NEW_MANAGERS)
    return [Entity(last.lower(), "manager", f"{first} {last}", ())
            for first, last in zip(firsts, rng.sample(_LAST_NAMES, NEW_MANAGERS))]


def _new_plans(rng: random.Random) -> list[Entity]:
    return [Entity(f"{word.lower()}-plan", "account", f"{word} {rng.choice(_INDUSTRIES)} Retirement Plan", ())
            for word in rng.sample(_COMPANY_WORDS, NEW_PLANS)]


def _manager_passage(fund: Entity, manager: Entity) -> Passage:
    return Passage(f"{fund.key}-manager", f"{fund.name}: portfolio manager",
                   f"{fund.name} ({fund.ticker}) is managed by portfolio manager {manager.name}.")


def _account_chains(account_funds: list[tuple[Entity, Entity]], by_pair: dict) -> list[Chain]:
    """account -> its default fund -> a fact of that fund."""
    chains = []
    for account, fund in account_funds:
        bridge_id = f"{account.key}-default-investment"
        for aspect in FUND_ASPECTS:
            fact = by_pair[(fund.key, aspect.key)]
            steps = (
                SearchStep(f"{account.name} default investment", bridge_id,
                           f"I need the default investment of the {account.name} first."),
                SearchStep(f"{fund.name} {aspect.terms}", fact.doc_id,
                           f"The default investment is the {fund.name}; now its {aspect.title}."),
            )
            questions = tuple(q.format(a=account.name) for q in DEFAULT_FUND_QUESTIONS[aspect.key])
            chains.append(Chain(f"ms-{account.key}-{aspect.key.replace('_', '-')}", questions, fact.value, bridge_id,
                                fact, steps, f"{account.name} {aspect.terms}"))
    return chains


def _manager_chains(fund_managers: list[tuple[Entity, Entity]], by_pair: dict) -> list[Chain]:
    """fund -> its manager -> a fact of that manager."""
    chains = []
    for fund, manager in fund_managers:
        bridge_id = f"{fund.key}-manager"
        for aspect in MANAGER_ASPECTS:
            fact = by_pair[(manager.key, aspect.key)]
            steps = (
                SearchStep(f"{fund.name} portfolio manager", bridge_id,
                           f"I need the portfolio manager of the {fund.name} first."),
                SearchStep(f"{manager.name} {aspect.terms}", fact.doc_id,
                           f"The manager is {manager.name}; now the {aspect.title}."),
            )
            questions = tuple(q.format(f=fund.name) for q in MANAGER_QUESTIONS[aspect.key])
            chains.append(Chain(f"ms-{fund.key}-{aspect.key}", questions, answer_of(aspect.key, fact.value),
                                bridge_id, fact, steps, f"{fund.name} {aspect.terms}"))
    return chains


def _split(chains: list[Chain], rng: random.Random) -> list[MultiStepTask]:
    """Hold out :data:`HELDOUT_QUESTIONS` answer documents, each asked by one chain in one
    phrasing; train every chain whose answer document is not held out, in
    :data:`TRAIN_PHRASINGS` phrasings; drop the rest. Held-out tasks come in a random
    order (a prefix of the file, as ``--quick`` evaluates, mixes both chains)."""
    by_answer: dict[str, list[Chain]] = {}
    for chain in chains:
        by_answer.setdefault(chain.fact.doc_id, []).append(chain)
    answer_docs = sorted(by_answer)
    if len(answer_docs) < 2 * HELDOUT_QUESTIONS:
        raise ValueError(f"{len(answer_docs)} answer documents: too few to hold out {HELDOUT_QUESTIONS}")
    heldout_docs = set(rng.sample(answer_docs, HELDOUT_QUESTIONS))
    heldout = []
    for doc in sorted(heldout_docs):
        chain = rng.choice(by_answer[doc])
        n = rng.randrange(len(chain.questions))
        heldout.append(_task(chain, n, "heldout"))
    rng.shuffle(heldout)
    train = [
        _task(chain, n, "train")
        for chain in chains if chain.fact.doc_id not in heldout_docs
        for n in sorted(rng.sample(range(len(chain.questions)), TRAIN_PHRASINGS))
    ]
    return train + heldout


def _task(chain: Chain, n: int, split: str) -> MultiStepTask:
    return MultiStepTask(f"{chain.chain_id}-{n}", chain.questions[n], (chain.answer,),
                         (chain.bridge_id, chain.fact.doc_id), chain.steps, split, chain.shortcut_query)


# Six phrasings of each two-search question.
DEFAULT_FUND_QUESTIONS = {
    "expense_ratio": ("What is the expense ratio of the default investment of the {a}?",
                      "How high is the annual fee of the fund the {a} invests in by default?",
                      "What expense ratio does the default fund of the {a} charge?",
                      "If I put money in the {a} and choose nothing, what annual fee does that fund charge?",
                      "Tell me the expense ratio of the fund the {a} uses by default.",
                      "What does the default investment of the {a} charge as its expense ratio?"),
    "minimum_investment": ("What is the minimum initial investment of the fund that the {a} invests in by default?",
                           "What minimum investment does the default fund of the {a} require?",
                           "How much must I invest at first in the default investment of the {a}?",
                           "What is the smallest initial investment the default fund of the {a} accepts?",
                           "Tell me the minimum initial investment of the fund the {a} uses by default.",
                           "If I choose nothing in the {a}, what minimum investment does that fund require?"),
    "dividend_schedule": ("How often does the default fund of the {a} pay dividends?",
                          "What dividend schedule does the default investment of the {a} follow?",
                          "On what schedule does the fund the {a} invests in by default distribute dividends?",
                          "Tell me the dividend distribution schedule of the default fund of the {a}.",
                          "How frequently are dividends paid by the default investment of the {a}?",
                          "If I choose nothing in the {a}, how often does that fund pay dividends?"),
    "redemption_fee": ("What is the holding period of the redemption fee of the default fund of the {a}?",
                       "For how long does the default investment of the {a} charge a redemption fee?",
                       "How long must I hold the default fund of the {a} to avoid its redemption fee?",
                       "Tell me the redemption fee holding period of the fund the {a} invests in by default.",
                       "What holding period applies to the redemption fee of the default investment of the {a}?",
                       "If I choose nothing in the {a}, how long is that fund's redemption fee holding period?"),
    "risk_rating": ("What is the risk rating of the default investment of the {a}?",
                    "How risky, on the 1 to 5 scale, is the default fund of the {a}?",
                    "What risk rating does the fund the {a} invests in by default carry?",
                    "Tell me the risk rating of the default fund of the {a}.",
                    "How volatile is the default investment of the {a}, by its risk rating?",
                    "If I choose nothing in the {a}, what risk rating does that fund have?"),
    "benchmark": ("Which benchmark index does the default fund of the {a} track?",
                  "What index is the default investment of the {a} measured against?",
                  "What is the benchmark index of the fund the {a} invests in by default?",
                  "Tell me the benchmark of the default fund of the {a}.",
                  "Which index does the default investment of the {a} follow as its benchmark?",
                  "If I choose nothing in the {a}, which benchmark index does that fund track?"),
}
MANAGER_QUESTIONS = {
    "tenure": ("In what year did the portfolio manager of the {f} join the firm?",
               "When did the person who manages the {f} join the firm?",
               "What year did the manager of the {f} start at the firm?",
               "Tell me when the portfolio manager of the {f} joined the firm.",
               "Since what year has the manager of the {f} been with the firm?",
               "How long ago, by year joined, did the person running the {f} come to the firm?"),
    "education": ("Where did the portfolio manager of the {f} study?",
                  "Which university did the manager of the {f} attend?",
                  "At which school did the person who manages the {f} study?",
                  "Tell me where the portfolio manager of the {f} was educated.",
                  "What university did the manager of the {f} graduate from?",
                  "Where was the person running the {f} educated?"),
}


__all__ = ["HELDOUT_QUESTIONS", "NEW_FUNDS", "NEW_MANAGERS", "NEW_PLANS", "SearchHalf", "TRAIN_PHRASINGS",
           "generated_fund_names", "search_half"]
