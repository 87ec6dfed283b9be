"""The demo's built-in domain: a seeded knowledge base of fictional funds and accounts.

Everything the demo trains and evaluates on is generated here, deterministically
from one seed, with no download:

- a corpus (one passage per product x topic, plus general guides), written in the
  BEIR layout (``corpus.jsonl``, ``queries.jsonl``, ``qrels/test.tsv``);
- query-rewrite tasks whose user queries carry the three failure modes of the SME
  error taxonomy, named by what a verbatim copy of the query gets wrong: a nickname
  instead of the product's name (``missing_entity``), slang instead of the topic's
  terms (``missed_intent``), or both in a short vague query (``underspecified``),
  beside well-formed queries (``none``);
- two-search questions (an employer plan -> its default fund -> a fact of that fund)
  in the Search-R1 format, in three entity-disjoint splits (train / validation /
  test), over the search-only entities of :mod:`calibrl.demo.search_domain` (its own
  random stream and word lists, so the rewriter half below stays as it is whatever it
  draws);
- a simulated SME feedback sample (grades 1-5 and error tags) on rewrites of training
  queries, from which the judge distils its rubric: a panel of simulated experts
  (:mod:`calibrl.demo.experts`) grades each rewrite from its hidden quality, the
  catalogue search they run and their own habits, never from rules a judge uses;
- the glossary of key entities (names, tickers, nicknames) and topic terms.

Design, so that the effect of the reward can show with a tiny model in minutes:
nicknames and slang share no word (nor word stem) with any passage, so copying such
a query retrieves nothing relevant; an under-specified query reaches its passage at
rank 1 only when the rewrite names the product *and* the topic in the catalogue's
words. With a base rewriter that mostly copies, a binary hit@1 reward sees almost
every group score all 0 (hard query) or all 1 (well-formed query), while MRR@10 and
the rubric give credit for each half of the fix. Most tasks are under-specified
(:func:`_task_modes`); copying finds the gold passage for about a fifth to a quarter
of them. Held-out tasks use (product, topic) pairs that no training task, warm-start
example or SME review uses: what transfers is the nickname -> name and slang -> term
mapping, not the pair.
"""

from __future__ import annotations

import json
import pathlib
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.experts import PanelReview
    from calibrl.demo.search_domain import Link

# Error tags of the SME taxonomy (docs/design.md, "Rewards": missed intent, missing key entities,
# under-specification, plus the critical penalty for invented entities), spelled as
# the judge's distiller knows them (calibrl.judge_server.authoring.distill.RECIPES).
MISSED_INTENT = "missed_intent"
MISSING_KEY_ENTITIES = "missing_entity"
UNDERSPECIFIED = "underspecified"
INVENTED_ENTITY = "invented_entity"
ERROR_TAGS = (MISSED_INTENT, MISSING_KEY_ENTITIES, UNDERSPECIFIED, INVENTED_ENTITY)

FAILURE_MODES = ("none", MISSING_KEY_ENTITIES, MISSED_INTENT, UNDERSPECIFIED)
DOMAIN_NAME = "lumen-harbor-investments"


# --- the knowledge base ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entity:
    """A fund or an account type, with the colloquial aliases users call it by."""

    key: str
    kind: str  # "fund" | "account" | "manager"
    name: str  # canonical name: what a good rewrite must contain
    aliases: tuple[str, ...]
    ticker: str = ""


@dataclass(frozen=True)
class Aspect:
    """Something users ask about an entity: its canonical terms and colloquial phrasings."""

    key: str
    kind: str  # the entity kind it applies to
    title: str  # passage title suffix, e.g. "expense ratio and annual fee"
    terms: str  # canonical phrase a good rewrite adds, e.g. "expense ratio"
    formal: tuple[str, ...]  # query templates with {e}, using the canonical terms
    colloquial: tuple[str, ...]  # query templates with {e}, sharing no word with any passage

    @property
    def glossary(self) -> tuple[str, ...]:
        """Catalogue terms of this aspect, lower case (e.g. "expense ratio", "annual fee")."""
        return _ASPECT_GLOSSARY.get(self.key, (self.terms,))


FUNDS = (
    Entity("evergreen", "fund", "Evergreen Growth Fund", ("pine thing", "pine tree stuff"), "EVGRX"),
    Entity("harbor", "fund", "Harbor Bond Index Fund", ("anchor thing", "anchor stuff"), "HBIDX"),
    Entity("summit", "fund", "Summit Equity Income Fund", ("mountain thing", "peak stuff"), "SMEIX"),
    Entity("lakeshore", "fund", "Lakeshore Small Cap Fund", ("beach thing", "sandy stuff"), "LKSCX"),
    Entity("aurora", "fund", "Aurora Global Markets Fund", ("northern lights thing", "sky glow stuff"), "AUGMX"),
    Entity("granite", "fund", "Granite Value Fund", ("rock thing", "boulder stuff"), "GRVAX"),
    Entity("meridian", "fund", "Meridian Balanced Fund", ("compass thing", "noon stuff"), "MRBLX"),
    Entity("falcon", "fund", "Falcon Technology Fund", ("bird thing", "hawk stuff"), "FLTCX"),
    Entity("riverbend", "fund", "Riverbend Municipal Fund", ("creek thing", "canoe stuff"), "RVMUX"),
    Entity("oakridge", "fund", "Oakridge Dividend Fund", ("acorn thing", "squirrel stuff"), "OKDVX"),
    Entity("copperline", "fund", "Copperline Commodities Fund", ("penny thing", "shiny metal stuff"), "CPCMX"),
    Entity("tidewater", "fund", "Tidewater Treasury Fund", ("wave thing", "surf stuff"), "TDTRX"),
)

ACCOUNTS = (
    Entity("roth", "account", "Roth IRA", ("nest egg thing", "egg stash stuff")),
    Entity("traditional", "account", "Traditional IRA", ("piggy bank thing", "old piggy stuff")),
    Entity("horizon529", "account", "Horizon 529 College Plan", ("kiddo jar thing", "kids jar stuff")),
    Entity("brokerage", "account", "Everyday Brokerage Account", ("trading wallet thing", "wallet gizmo stuff")),
    Entity("hsa", "account", "Harvest Health Savings Account", ("doctor stash thing", "clinic pot stuff")),
    Entity("solo401k", "account", "Solo 401k Plan", ("gig pot thing", "freelancer pot stuff")),
)

MANAGERS = (
    Entity("okafor", "manager", "Adaeze Okafor", ()),
    Entity("lindqvist", "manager", "Henrik Lindqvist", ()),
    Entity("moreau", "manager", "Camille Moreau", ()),
    Entity("tanaka", "manager", "Kenji Tanaka", ()),
    Entity("alvarez", "manager", "Lucia Alvarez", ()),
    Entity("brennan", "manager", "Declan Brennan", ()),
)

# Colloquial phrasings are short, search-box style, and share no word (nor stem) with any
# passage; ``{e}`` is the entity mention (its canonical name or an alias).
FUND_ASPECTS = (
    Aspect(
        "expense_ratio", "fund", "expense ratio and annual fee", "expense ratio annual fee",
        ("What is the expense ratio of {e}?", "{e} expense ratio", "annual fee charged by {e}"),
        ("{e} skim?", "how much does {e} skim", "{e} cut info"),
    ),
    Aspect(
        "minimum_investment", "fund", "minimum initial investment", "minimum initial investment",
        ("What is the minimum initial investment for {e}?", "{e} minimum investment",
         "minimum initial investment required by {e}"),
        ("{e} buy-in?", "how much dough to get into {e}", "{e} buy-in info"),
    ),
    Aspect(
        "dividend_schedule", "fund", "dividend distribution schedule", "dividend distribution schedule",
        ("When does {e} pay dividends?", "{e} dividend distribution schedule", "dividend schedule of {e}"),
        ("{e} payday?", "when does {e} hand out goodies", "{e} payday info"),
    ),
    Aspect(
        "redemption_fee", "fund", "redemption fee and holding period", "redemption fee holding period",
        ("What is the redemption fee and holding period of {e}?", "{e} redemption fee",
         "holding period for {e} redemption fee"),
        ("{e} bailing quick?", "does {e} ding me for bailing fast", "{e} bailing info"),
    ),
    Aspect(
        "risk_rating", "fund", "risk rating and volatility", "risk rating volatility",
        ("What is the risk rating of {e}?", "{e} risk rating", "volatility and risk rating of {e}"),
        ("{e} bumpy?", "how bumpy is the ride with {e}", "{e} bumpiness info"),
    ),
    Aspect(
        "benchmark", "fund", "benchmark index", "benchmark index",
        ("What benchmark index does {e} track?", "{e} benchmark index", "benchmark of {e}"),
        ("{e} yardstick?", "what yardstick is {e} held up to", "{e} yardstick info"),
    ),
)

ACCOUNT_ASPECTS = (
    Aspect(
        "contribution_limit", "account", "annual contribution limit", "annual contribution limit",
        ("What is the annual contribution limit of {e}?", "{e} contribution limit",
         "annual contribution limit for {e}"),
        ("{e} max stash-in?", "how much can I shove into {e}", "{e} shove-in info"),
    ),
    Aspect(
        "early_withdrawal", "account", "early withdrawal penalty", "early withdrawal penalty",
        ("What is the early withdrawal penalty for {e}?", "{e} early withdrawal penalty",
         "penalty for early withdrawal from {e}"),
        ("{e} grab cash too soon?", "do I get burned pulling out of {e}", "{e} cash grab info"),
    ),
    Aspect(
        "maintenance_fee", "account", "account maintenance fee", "account maintenance fee",
        ("What is the account maintenance fee of {e}?", "{e} maintenance fee", "account maintenance fee for {e}"),
        ("{e} upkeep?", "do they nickel and dime me for {e}", "{e} upkeep info"),
    ),
    Aspect(
        "eligibility", "account", "eligibility requirements", "eligibility requirements",
        ("What are the eligibility requirements for {e}?", "{e} eligibility requirements", "who qualifies for {e}"),
        ("{e} who gets in?", "who is allowed to sign up for {e}", "{e} sign-up info"),
    ),
    Aspect(
        "transfer_process", "account", "rollover and transfer process", "rollover transfer process",
        ("How does a rollover or transfer into {e} work?", "{e} transfer process", "rollover into {e}"),
        ("{e} moving my pile?", "shifting my pile elsewhere into {e}", "{e} moving-over info"),
    ),
    Aspect(
        "default_investment", "account", "default investment", "default investment",
        ("What is the default investment of {e}?", "{e} default investment", "default investment option in {e}"),
        ("{e} autopilot pick?", "what does {e} buy if I do nothing", "{e} autopilot info"),
    ),
)

MANAGER_ASPECTS = (
    Aspect("tenure", "manager", "career and tenure", "joined firm year career", ("When did {e} join the firm?",), ()),
    Aspect("education", "manager", "education", "education degree university", ("Where did {e} study?",), ()),
)

_ASPECT_GLOSSARY = {
    "expense_ratio": ("expense ratio", "annual fee"),
    "minimum_investment": ("minimum initial investment", "minimum investment"),
    "dividend_schedule": ("dividend distribution schedule", "dividend schedule", "dividends"),
    "redemption_fee": ("redemption fee", "holding period"),
    "risk_rating": ("risk rating", "volatility"),
    "benchmark": ("benchmark index", "benchmark"),
    "contribution_limit": ("annual contribution limit", "contribution limit"),
    "early_withdrawal": ("early withdrawal penalty", "early withdrawal"),
    "maintenance_fee": ("account maintenance fee", "maintenance fee"),
    "eligibility": ("eligibility requirements", "eligibility"),
    "transfer_process": ("rollover", "transfer process"),
    "default_investment": ("default investment",),
}

_EXPENSE = ("0.04%", "0.07%", "0.12%", "0.18%", "0.25%", "0.33%", "0.41%", "0.52%", "0.64%", "0.75%", "0.88%", "0.95%")
_MINIMUM = ("$500", "$1,000", "$1,500", "$2,500", "$3,000", "$5,000", "$10,000", "$50,000")
_DIVIDEND = ("monthly", "quarterly", "semiannual", "annual")
_HOLDING = ("30 days", "60 days", "90 days", "180 days")
_RISK = ("1", "2", "3", "4", "5")
_BENCHMARKS = (
    "Calder Total Market Index", "Brightwater Aggregate Bond Index", "Norland Dividend Leaders Index",
    "Quillon Small Company Index", "Veradis World Equity Index", "Ashcombe Value Index",
    "Pellham Balanced Composite", "Strand Technology Index", "Coralline Tax Exempt Index",
    "Merrow Commodity Index", "Halvard Treasury Index", "Sable Growth Index",
)
_LIMITS = ("$7,000", "$7,500", "$8,300", "$18,000", "$23,000", "$69,000")
_PENALTIES = ("10% of the amount withdrawn", "20% of the amount withdrawn", "15% of the amount withdrawn",
              "25% of the amount withdrawn")
_MAINTENANCE = ("$0 per year", "$20 per year", "$25 per year", "$40 per year", "$50 per year")
_ELIGIBILITY = (
    "earned income below $150,000 for single filers", "adults with earned income",
    "a named beneficiary of all ages", "adult residents with a valid tax identification number",
    "enrolment in a high deductible health plan", "self employment income and no employees",
)
_TRANSFER = (
    "submit a transfer form and assets arrive within 5 business days",
    "request a direct rollover from the previous plan administrator",
    "complete a trustee to trustee transfer within 60 days",
    "move assets in kind with an asset transfer request",
)
_UNIVERSITIES = ("Calder University", "Norland Institute", "Veradis College", "Ashcombe School of Finance",
                 "Pellham University", "Strand Polytechnic")
_DEGREES = ("a master's degree in finance", "a doctorate in economics", "a bachelor's degree in mathematics")


_VALUE_POOLS = {
    "expense_ratio": _EXPENSE, "minimum_investment": _MINIMUM, "dividend_schedule": _DIVIDEND,
    "redemption_fee": _HOLDING, "risk_rating": _RISK, "benchmark": _BENCHMARKS, "contribution_limit": _LIMITS,
    "early_withdrawal": _PENALTIES, "maintenance_fee": _MAINTENANCE, "eligibility": _ELIGIBILITY,
    "transfer_process": _TRANSFER,
}


@dataclass(frozen=True)
class Passage:
    """One corpus passage (BEIR ``corpus.jsonl`` record)."""

    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Fact:
    """What the passage of (entity, aspect) says: the value a question may ask for."""

    entity: Entity
    aspect: Aspect
    value: str
    doc_id: str


@dataclass(frozen=True)
class RewriteTask:
    """A user query to rewrite so that the fixed index returns the gold passage."""

    task_id: str
    query: str
    gold_doc_ids: tuple[str, ...]
    answers: tuple[str, ...]
    failure_mode: str  # one of FAILURE_MODES: what a verbatim copy of the query gets wrong
    key_entities: tuple[str, ...]  # canonical names a good rewrite must contain
    intent: str  # the aspect's canonical terms
    entity_key: str
    aspect_key: str
    split: str  # "train" | "heldout"

    def record(self) -> dict:
        """The trainer's rewrite-task JSONL record; context strings go to the judge."""
        return {
            "id": self.task_id,
            "query": self.query,
            "gold_doc_ids": list(self.gold_doc_ids),
            "answers": list(self.answers),
            # The context reaches the judge and the policy's prompt: never the key entities
            # nor the failure mode, which would hand the policy the answer.
            "context": {"domain": DOMAIN_NAME},
        }


@dataclass(frozen=True)
class SearchStep:
    """One search of a reference trajectory: the query and the passage it should find."""

    query: str
    doc_id: str
    think: str


@dataclass(frozen=True)
class MultiStepTask:
    """A question that needs two searches (bridge entity first, then the fact)."""

    task_id: str
    question: str
    answers: tuple[str, ...]
    gold_doc_ids: tuple[str, ...]
    steps: tuple[SearchStep, ...]  # reference trajectory (warm start only; never shown to the trainer)
    split: str
    # The careless second search: the question's own entity and the fact's terms, instead of the
    # bridge entity the first search revealed (it never finds the answer document).
    shortcut_query: str = ""

    def record(self) -> dict:
        """The trainer's search-task JSONL record."""
        return {
            "id": self.task_id,
            "question": self.question,
            "answers": list(self.answers),
            "gold_doc_ids": list(self.gold_doc_ids),
        }


@dataclass(frozen=True)
class SMEFeedback:
    """One simulated SME review of a rewrite: a 1-5 grade and the errors seen."""

    feedback_id: str
    query: str
    rewrite: str
    grade: int
    error_tags: tuple[str, ...]
    comment: str
    key_entities: tuple[str, ...]
    intent: str

    def record(self) -> dict:
        return {
            "id": self.feedback_id,
            "query": self.query,
            "output": self.rewrite,
            "grade": self.grade,
            "error_tags": list(self.error_tags),
            "notes": self.comment,
            "context": {"domain": DOMAIN_NAME},
        }


@dataclass
class Domain:
    """The whole generated domain."""

    seed: int
    passages: list[Passage]
    facts: list[Fact]
    rewrite_tasks: list[RewriteTask]
    multistep_tasks: list[MultiStepTask]
    sme_feedback: list[SMEFeedback]
    entities: list[Entity] = field(default_factory=list)  # the rewriter half's (the glossary's)
    aspects: list[Aspect] = field(default_factory=list)
    search_entities: list[Entity] = field(default_factory=list)  # funds, plans, managers of the search half only
    search_passages: list[Passage] = field(default_factory=list)  # their passages (also in ``passages``, at the end)
    # the search half's plans: bridge document id -> calibrl.demo.search_domain.Link (its plan, default fund, cluster)
    search_links: dict[str, "Link"] = field(default_factory=dict)
    search_clusters: dict[str, int] = field(default_factory=dict)  # two-search task id -> its cluster
    # The simulated SME panel's reviews behind ``sme_feedback`` (calibrl.demo.experts.PanelReview): every
    # expert's grade and the rewrite's hidden quality. No judge reads them.
    sme_panel: list["PanelReview"] = field(default_factory=list)

    def rewriter_passages(self) -> list[Passage]:
        """The passages of the rewriter half (its products and topics, the guides): what the
        judge's language model reads, the same whatever the search half holds."""
        search_ids = {p.doc_id for p in self.search_passages}
        return [p for p in self.passages if p.doc_id not in search_ids]

    def tasks(self, split: str) -> list[RewriteTask]:
        return [t for t in self.rewrite_tasks if t.split == split]

    def multistep(self, split: str) -> list[MultiStepTask]:
        return [t for t in self.multistep_tasks if t.split == split]

    def glossary_terms(self) -> list[str]:
        """The catalogue's names, tickers and aspect terms: the judge's domain glossary."""
        terms = [e.name for e in self.entities] + [e.ticker for e in self.entities if e.ticker]
        terms += [t for a in self.aspects for t in a.glossary]
        return list(dict.fromkeys(terms))

    def glossary(self) -> dict:
        """Key entities (canonical name, kind, ticker, aliases) and aspects (terms, phrasings)."""
        return {
            "domain": DOMAIN_NAME,
            "entities": [
                {"name": e.name, "kind": e.kind, "ticker": e.ticker, "aliases": list(e.aliases)}
                for e in self.entities
            ],
            "aspects": [
                {"key": a.key, "applies_to": a.kind, "terms": a.terms, "colloquial": [
                    t.replace("{e}", "...") for t in a.colloquial]}
                for a in self.aspects
            ],
        }


# --- generation -----------------------------------------------------------------------------------------------------


def _doc_id(entity: Entity, aspect: Aspect) -> str:
    return f"{entity.key}-{aspect.key.replace('_', '-')}"


def _fund_text(fund: Entity, aspect: Aspect, value: str) -> str:
    name = f"{fund.name} ({fund.ticker})"
    return {
        "expense_ratio": f"{name} has an expense ratio of {value}. This annual fee is charged on fund assets "
                         "and pays for portfolio management and administration.",
        "minimum_investment": f"The minimum initial investment for {name} is {value}. Additional purchases "
                              "after the initial investment have no minimum.",
        "dividend_schedule": f"{name} follows a {value} dividend distribution schedule. Dividends may be "
                             "reinvested in additional shares.",
        "redemption_fee": f"{name} charges a redemption fee of 1% on shares redeemed within a holding period "
                          f"of {value}.",
        "risk_rating": f"{name} has a risk rating of {value} on a scale of 1 (conservative) to 5 (aggressive), "
                       "based on its historical volatility.",
        "benchmark": f"{name} tracks the {value}, its benchmark index.",
    }[aspect.key]


def _account_text(account: Entity, aspect: Aspect, value: str) -> str:
    name = account.name
    return {
        "contribution_limit": f"The annual contribution limit for the {name} is {value}. Contributions above "
                              "the annual contribution limit are returned to the owner.",
        "early_withdrawal": f"A withdrawal taken on the {name} under age 59 incurs an early withdrawal penalty of "
                            f"{value}, in addition to regular income taxes.",
        "maintenance_fee": f"The {name} has an account maintenance fee of {value}, waived for balances above "
                           "$10,000.",
        "eligibility": f"Eligibility requirements for the {name}: {value}.",
        "transfer_process": f"Rollover and transfer process for the {name}: {value}.",
        "default_investment": f"Unless the owner chooses otherwise, contributions to the {name} are invested "
                              f"by default in the {value}.",
    }[aspect.key]


def _manager_text(manager: Entity, aspect: Aspect, value: str) -> str:
    return {
        "tenure": f"{manager.name} joined the firm in {value} and has managed portfolios at the firm since.",
        "education": f"{manager.name} studied at {value}.",
    }[aspect.key]


_GENERAL_PASSAGES = (
    ("guide-fees", "Fee schedule overview",
     "Funds charge an expense ratio as an annual fee on assets. Some funds also charge a redemption fee within "
     "a holding period, and some accounts charge an account maintenance fee."),
    ("guide-risk", "Understanding risk ratings",
     "A fund carries a risk rating of 1 (conservative) to 5 (aggressive), based on the historical "
     "volatility of its returns."),
    ("guide-dividends", "Dividend reinvestment program",
     "Dividend distributions follow a fund's dividend distribution schedule and may be reinvested in "
     "additional shares at no charge."),
    ("guide-benchmarks", "Benchmark indexes explained",
     "A benchmark index is the market index whose returns a fund tracks."),
    ("guide-contributions", "Contribution limits overview",
     "Retirement and education accounts have an annual contribution limit set by regulation; contributions "
     "above the limit are returned."),
    ("guide-withdrawals", "Early withdrawal penalties explained",
     "Withdrawals taken on retirement accounts under age 59 usually incur an early withdrawal penalty plus "
     "regular income taxes."),
    ("guide-rollovers", "Rollover and transfer guide",
     "A rollover or transfer process transfers assets of another institution; a direct rollover avoids taxes."),
    ("guide-eligibility", "Eligibility basics",
     "Eligibility requirements depend on the account: income limits, age, or enrolment in a health plan."),
    ("guide-minimums", "Investment minimums",
     "A fund sets a minimum initial investment; additional purchases have no minimum."),
    ("guide-defaults", "Default investments",
     "If the owner gives no instruction, contributions are invested by default in the account's default "
     "investment."),
)


# The generator once split 60 two-search questions here with the main stream; drawing the same
# keeps the rewriter half (rewrite tasks, SME feedback) byte-identical now that the search half
# (calibrl.demo.search_domain) draws from its own stream.
_LEGACY_SPLIT_DRAW = 60


def generate_domain(seed: int = 0, heldout_fraction: float = 0.25) -> Domain:
    """Generate the whole domain from ``seed`` (same seed, same domain, byte for byte).
    ``heldout_fraction``: of the rewrite (product, topic) pairs. The two-search questions
    and their split come from :func:`calibrl.demo.search_domain.search_half`."""
    from calibrl.demo.search_domain import search_half

    rng = random.Random(seed)
    passages, facts = _facts_and_passages(rng)
    rewrite_tasks = _rewrite_tasks(facts, heldout_fraction, rng)
    rng.shuffle(list(range(_LEGACY_SPLIT_DRAW)))
    sme, panel = _sme_feedback([t for t in rewrite_tasks if t.split == "train"], list(passages), rng)
    search = search_half(seed)
    return Domain(
        seed=seed,
        passages=passages + search.passages,
        facts=facts + search.facts,
        rewrite_tasks=rewrite_tasks,
        multistep_tasks=search.tasks,
        sme_feedback=sme,
        sme_panel=panel,
        entities=[*FUNDS, *ACCOUNTS, *MANAGERS],
        aspects=[*FUND_ASPECTS, *ACCOUNT_ASPECTS, *MANAGER_ASPECTS],
        search_entities=search.entities,
        search_passages=search.passages,
        search_links=search.links,
        search_clusters=search.clusters,
    )


def _facts_and_passages(rng: random.Random) -> tuple[list[Passage], list[Fact]]:
    """The rewriter half's knowledge base: one passage per (entity, aspect), the managers'
    passages and the general guides; the facts behind them (drawn from ``rng`` in this order)."""
    passages: list[Passage] = []
    facts: list[Fact] = []
    fund_values = {
        "expense_ratio": rng.sample(_EXPENSE, len(FUNDS)),
        "minimum_investment": [rng.choice(_MINIMUM) for _ in FUNDS],
        "dividend_schedule": [rng.choice(_DIVIDEND) for _ in FUNDS],
        "redemption_fee": [rng.choice(_HOLDING) for _ in FUNDS],
        "risk_rating": [rng.choice(_RISK) for _ in FUNDS],
        "benchmark": rng.sample(_BENCHMARKS, len(FUNDS)),
    }
    for i, fund in enumerate(FUNDS):
        for aspect in FUND_ASPECTS:
            value = fund_values[aspect.key][i]
            doc_id = _doc_id(fund, aspect)
            passages.append(Passage(doc_id, f"{fund.name}: {aspect.title}", _fund_text(fund, aspect, value)))
            facts.append(Fact(fund, aspect, value, doc_id))
    default_funds = rng.sample(FUNDS, len(ACCOUNTS))
    account_values = {
        "contribution_limit": [rng.choice(_LIMITS) for _ in ACCOUNTS],
        "early_withdrawal": [rng.choice(_PENALTIES) for _ in ACCOUNTS],
        "maintenance_fee": [rng.choice(_MAINTENANCE) for _ in ACCOUNTS],
        "eligibility": rng.sample(_ELIGIBILITY, len(ACCOUNTS)),
        "transfer_process": [rng.choice(_TRANSFER) for _ in ACCOUNTS],
        "default_investment": [f.name for f in default_funds],
    }
    for i, account in enumerate(ACCOUNTS):
        for aspect in ACCOUNT_ASPECTS:
            value = account_values[aspect.key][i]
            doc_id = _doc_id(account, aspect)
            passages.append(Passage(doc_id, f"{account.name}: {aspect.title}", _account_text(account, aspect, value)))
            facts.append(Fact(account, aspect, value, doc_id))
    fund_managers = [MANAGERS[i % len(MANAGERS)] for i in rng.sample(range(len(FUNDS)), len(FUNDS))]
    for fund, manager in zip(FUNDS, fund_managers):
        doc_id = f"{fund.key}-manager"
        passages.append(Passage(doc_id, f"{fund.name}: portfolio manager",
                                f"{fund.name} ({fund.ticker}) is managed by portfolio manager {manager.name}."))
    manager_values = {
        "tenure": [str(rng.randint(1994, 2019)) for _ in MANAGERS],
        "education": [f"{rng.choice(_UNIVERSITIES)}, earning {rng.choice(_DEGREES)}" for _ in MANAGERS],
    }
    for i, manager in enumerate(MANAGERS):
        for aspect in MANAGER_ASPECTS:
            value = manager_values[aspect.key][i]
            doc_id = _doc_id(manager, aspect)
            passages.append(Passage(doc_id, f"{manager.name}: {aspect.title}", _manager_text(manager, aspect, value)))
            facts.append(Fact(manager, aspect, value, doc_id))
    passages.extend(Passage(doc_id, title, text) for doc_id, title, text in _GENERAL_PASSAGES)
    return passages, facts


def _rewrite_tasks(facts: list[Fact], heldout_fraction: float, rng: random.Random) -> list[RewriteTask]:
    """The rewrite tasks of the fund and account facts: held-out (entity, aspect) pairs never
    appear in training data."""
    rewrite_facts = [f for f in facts if f.entity.kind in ("fund", "account")]
    pairs = [(f.entity.key, f.aspect.key) for f in rewrite_facts]
    heldout_pairs = _heldout_pairs(pairs, heldout_fraction, rng)
    rewrite_tasks: list[RewriteTask] = []
    for fact in rewrite_facts:
        split = "heldout" if (fact.entity.key, fact.aspect.key) in heldout_pairs else "train"
        for n, mode in enumerate(_task_modes(rng)):
            query = user_query(fact.entity, fact.aspect, mode, rng)
            rewrite_tasks.append(RewriteTask(
                task_id=f"rw-{fact.doc_id}-{n}-{mode.replace('_', '-')}",
                query=query,
                gold_doc_ids=(fact.doc_id,),
                answers=(_answer_of(fact),),
                failure_mode=mode,
                key_entities=(fact.entity.name,),
                intent=fact.aspect.terms,
                entity_key=fact.entity.key,
                aspect_key=fact.aspect.key,
                split=split,
            ))
    return rewrite_tasks


def _heldout_pairs(pairs: list[tuple[str, str]], fraction: float, rng: random.Random) -> set[tuple[str, str]]:
    """Hold out a fraction of the pairs such that every entity and every aspect still
    has training pairs (so the mapping can be learned and then transferred)."""
    order = list(pairs)
    rng.shuffle(order)
    target = int(round(fraction * len(pairs)))
    heldout: set[tuple[str, str]] = set()
    for entity, aspect in order:
        if len(heldout) >= target:
            break
        entity_left = sum(1 for e, a in pairs if e == entity and (e, a) not in heldout)
        aspect_left = sum(1 for e, a in pairs if a == aspect and (e, a) not in heldout)
        if entity_left > 2 and aspect_left > 2:
            heldout.add((entity, aspect))
    return heldout


def _task_modes(rng: random.Random) -> list[str]:
    """The failure modes of the tasks of one (entity, aspect) pair: two underspecified
    queries, one that misses either the entity or the intent, and a well-formed one
    for seven pairs in ten. Copying then finds the gold passage for about a quarter of
    the tasks (the talk's base rewriter: 28%)."""
    modes = [UNDERSPECIFIED, UNDERSPECIFIED, UNDERSPECIFIED]
    if rng.random() < 0.5:
        modes.append(rng.choice((MISSING_KEY_ENTITIES, MISSED_INTENT)))
    if rng.random() < 0.7:
        modes.append("none")
    return modes


def _answer_of(fact: Fact) -> str:
    return fact.value


def answer_of(aspect_key: str, value: str) -> str:
    """The short answer a question about a fact with ``value`` expects (a manager's
    education: the university only)."""
    return value.split(",")[0] if aspect_key == "education" else value


def passage_text(entity: Entity, aspect: Aspect, value: str) -> str:
    """The corpus text of the passage of (entity, aspect) stating ``value``."""
    if entity.kind == "fund":
        return _fund_text(entity, aspect, value)
    if entity.kind == "account":
        return _account_text(entity, aspect, value)
    return _manager_text(entity, aspect, value)


def value_choices(aspect_key: str) -> tuple[str, ...]:
    """Every value a fact of the aspect may take (the generator draws from these)."""
    if aspect_key == "tenure":
        return tuple(str(year) for year in range(1994, 2020))
    if aspect_key == "education":
        return tuple(f"{u}, earning {d}" for u in _UNIVERSITIES for d in _DEGREES)
    if aspect_key == "default_investment":
        from calibrl.demo.search_domain import generated_fund_names

        return tuple(f.name for f in FUNDS) + generated_fund_names()
    return _VALUE_POOLS[aspect_key]


def _mention(entity: Entity, canonical: bool, rng: random.Random) -> str:
    if canonical:
        if entity.ticker and rng.random() < 0.15:
            return f"{entity.name} ({entity.ticker})"
        return entity.name
    return rng.choice(entity.aliases)


def user_query(entity: Entity, aspect: Aspect, mode: str, rng: random.Random) -> str:
    canonical_entity = mode in ("none", MISSED_INTENT)
    formal_aspect = mode in ("none", MISSING_KEY_ENTITIES)
    template = rng.choice(aspect.formal if formal_aspect else aspect.colloquial)
    query = template.format(e=_mention(entity, canonical_entity, rng))
    query = re.sub(r"\s+", " ", query).strip()
    return query[0].upper() + query[1:]


# --- simulated SME feedback -----------------------------------------------------------------------------------------

_ENTITY_BY_KEY = {e.key: e for e in (*FUNDS, *ACCOUNTS, *MANAGERS)}
_ASPECT_BY_KEY = {a.key: a for a in (*FUND_ASPECTS, *ACCOUNT_ASPECTS, *MANAGER_ASPECTS)}


ENTITY_BY_KEY = _ENTITY_BY_KEY  # public names for calibrl.demo.experts
ASPECT_BY_KEY = _ASPECT_BY_KEY


def _sme_feedback(train_tasks: list[RewriteTask], passages: list[Passage], rng: random.Random,
                  count: int = 300) -> tuple[list[SMEFeedback], list["PanelReview"]]:
    """Reviews of rewrites of training queries by the simulated SME panel
    (:mod:`calibrl.demo.experts`): each review carries the grade and error tags of the
    expert it was assigned to; the panel's reviews (every expert's grade, the rewrite's
    hidden quality) come second."""
    from calibrl.demo.experts import review_sample

    panel = review_sample(train_tasks, passages, rng, count)
    by_id = {t.task_id: t for t in train_tasks}
    records = [SMEFeedback(
        feedback_id=r.feedback_id,
        query=r.query,
        rewrite=r.rewrite,
        grade=r.grades[r.assigned],
        error_tags=r.tags[r.assigned],
        comment=_comment(r.tags[r.assigned]),
        key_entities=by_id[r.task_id].key_entities,
        intent=by_id[r.task_id].intent,
    ) for r in panel]
    return records, panel


# Rewrites the SMEs reviewed: what base rewriters produce, from verbatim copies to expert rewrites.
_CANDIDATE_MOVES = ("copy", "replace_alias", "add_entity", "add_intent", "expert", "name_and_terms", "drop_tail",
                    "wrong_entity", "made_up_ticker")
_CANDIDATE_WEIGHTS = (40, 8, 8, 8, 20, 8, 4, 2, 2)


def candidate_rewrite(task: RewriteTask, move: str, rng: random.Random) -> str:
    """One rewrite of ``task.query`` made by ``move`` (see _CANDIDATE_MOVES)."""
    entity = _ENTITY_BY_KEY[task.entity_key]
    aspect = _ASPECT_BY_KEY[task.aspect_key]
    query = task.query.rstrip("?").strip()
    alias = next((a for a in entity.aliases if a in query.lower()), None)
    if move == "copy":
        return task.query
    if move == "replace_alias":
        return _replace(query, alias, entity.name) if alias else f"{query} {entity.name}"
    if move == "add_entity":
        return f"{query} {entity.name}"
    if move == "add_intent":
        return f"{query} {aspect.terms}"
    if move == "expert":
        base = _replace(query, alias, entity.name) if alias else query
        return f"{base} {aspect.terms}" if not any(t in base.lower() for t in aspect.glossary) else base
    if move == "name_and_terms":
        return f"{entity.name} {aspect.terms}"
    if move == "drop_tail":
        words = query.split()
        return " ".join(words[: max(1, len(words) // 2)])
    if move == "wrong_entity":
        pool = FUNDS if entity.kind == "fund" else ACCOUNTS
        other = rng.choice([e for e in pool if e.key != entity.key])
        return f"{other.name} {aspect.terms}"
    if move == "hint_word":
        words = [w for w in entity.name.split() if w.lower() not in _GENERIC_NAME_WORDS] + aspect.terms.split()
        return f"{query} {rng.choice(words)}"
    if move == "random_term":
        return f"{query} {rng.choice(_ALL_TERM_WORDS)}"
    if move == "made_up_ticker":
        made_up = "".join(rng.choice("BCDFGHJKLMNPQRSTVWZ") for _ in range(4)) + "X"
        return f"{made_up} {aspect.terms}"
    raise ValueError(f"unknown rewrite move {move!r}")


_GENERIC_NAME_WORDS = frozenset({"fund", "account", "plan", "ira", "index"})
_ALL_TERM_WORDS = sorted(
    {w for e in (*FUNDS, *ACCOUNTS) for w in e.name.split() if w.lower() not in _GENERIC_NAME_WORDS}
    | {w for a in (*FUND_ASPECTS, *ACCOUNT_ASPECTS) for w in a.terms.split()}
)


def _replace(text: str, old: str, new: str) -> str:
    start = text.lower().index(old)
    return text[:start] + new + text[start + len(old):]


def _comment(tags: tuple[str, ...]) -> str:
    if not tags:
        return "Good: names the product and asks the right thing."
    words = {
        MISSED_INTENT: "does not say what the user wants to know",
        MISSING_KEY_ENTITIES: "drops the product name",
        UNDERSPECIFIED: "too vague to find the right page",
        INVENTED_ENTITY: "names the wrong product",
    }
    return "; ".join(words[t] for t in tags).capitalize() + "."


# --- files ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DomainFiles:
    """Where :func:`write_domain` put each file."""

    root: pathlib.Path
    corpus: pathlib.Path
    queries: pathlib.Path
    qrels: pathlib.Path
    train_tasks: pathlib.Path
    heldout_tasks: pathlib.Path
    multistep_train: pathlib.Path
    multistep_heldout: pathlib.Path  # the test split
    sme_feedback: pathlib.Path
    glossary: pathlib.Path
    sme_panel: pathlib.Path  # every expert's grade and each rewrite's hidden quality (no judge reads it)
    multistep_validation: pathlib.Path | None = None  # where search design knobs are chosen


def domain_files(root: str | pathlib.Path) -> DomainFiles:
    """Where :func:`write_domain` puts (or put) each file under ``root``."""
    root = pathlib.Path(root)
    return DomainFiles(
        root=root,
        corpus=root / "corpus.jsonl",
        queries=root / "queries.jsonl",
        qrels=root / "qrels" / "test.tsv",
        train_tasks=root / "tasks_train.jsonl",
        heldout_tasks=root / "tasks_heldout.jsonl",
        multistep_train=root / "multistep_train.jsonl",
        multistep_heldout=root / "multistep_heldout.jsonl",
        sme_feedback=root / "sme_feedback.jsonl",
        glossary=root / "glossary.json",
        sme_panel=root / "sme_panel.jsonl",
        multistep_validation=root / "multistep_validation.jsonl",
    )


def write_domain(domain: Domain, root: str | pathlib.Path) -> DomainFiles:
    """Write the domain as the files a user would bring: BEIR corpus, task JSONL, SME JSONL."""
    files = domain_files(root)
    (files.root / "qrels").mkdir(parents=True, exist_ok=True)
    _write_jsonl(files.corpus, ({"_id": p.doc_id, "title": p.title, "text": p.text} for p in domain.passages))
    _write_jsonl(files.queries, ({"_id": t.task_id, "text": t.query} for t in domain.rewrite_tasks))
    with files.qrels.open("w", encoding="utf-8") as out:
        out.write("query-id\tcorpus-id\tscore\n")
        for task in domain.rewrite_tasks:
            for doc_id in task.gold_doc_ids:
                out.write(f"{task.task_id}\t{doc_id}\t1\n")
    _write_jsonl(files.train_tasks, (t.record() for t in domain.tasks("train")))
    _write_jsonl(files.heldout_tasks, (t.record() for t in domain.tasks("heldout")))
    _write_jsonl(files.multistep_train, (t.record() for t in domain.multistep("train")))
    _write_jsonl(files.multistep_heldout, (t.record() for t in domain.multistep("heldout")))
    _write_jsonl(files.multistep_validation, (t.record() for t in domain.multistep("validation")))
    _write_jsonl(files.sme_feedback, (r.record() for r in domain.sme_feedback))
    _write_jsonl(files.sme_panel, (r.record() for r in domain.sme_panel))
    files.glossary.write_text(json.dumps(domain.glossary(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return files


def _write_jsonl(path: pathlib.Path, records: Iterable[dict]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


__all__ = [
    "Aspect", "Domain", "DomainFiles", "Entity", "ERROR_TAGS", "FAILURE_MODES", "MultiStepTask", "Passage",
    "RewriteTask", "SMEFeedback", "SearchStep", "answer_of", "domain_files", "generate_domain", "passage_text",
    "value_choices", "write_domain",
]
