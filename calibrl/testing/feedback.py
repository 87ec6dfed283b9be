"""Synthetic, deterministic SME feedback: expert-graded rewrites of fund questions with
the typical error modes (missing entity, missed intent, under-specification, invented
entity, compliance leak, plus an unknown tag), and the glossary of that domain."""

from __future__ import annotations

import random

from calibrl.judge_server.authoring.feedback import FeedbackRecord

_FUNDS = [
    ("VTSAX", "Vanguard Total Stock Market Index Fund"),
    ("VFIAX", "Vanguard 500 Index Fund"),
    ("VBTLX", "Vanguard Total Bond Market Index Fund"),
    ("VTIAX", "Vanguard Total International Stock Index Fund"),
    ("VGSLX", "Vanguard Real Estate Index Fund"),
    ("VWIAX", "Vanguard Wellesley Income Fund"),
    ("VIMAX", "Vanguard Mid-Cap Index Fund"),
    ("VSMAX", "Vanguard Small-Cap Index Fund"),
]
_TOPICS = [
    ("expense ratio", "charges an annual expense ratio of {x}% of assets"),
    ("minimum initial investment", "requires a minimum initial investment of ${x},000"),
    ("dividend schedule", "pays dividends every {x} months"),
    ("turnover rate", "reported a portfolio turnover rate of {x}%"),
    ("capital gains distribution", "made a capital gains distribution of ${x} per share"),
    ("top holdings", "lists its top holdings, the largest {x} positions by weight"),
]
_UNRELATED_INTENTS = [
    "How do I reset my online password?",
    "Where is the nearest branch office open on weekends?",
    "How do I change the mailing address on my profile?",
    "What are the customer service phone hours?",
]

SYNTHETIC_GLOSSARY: tuple[str, ...] = tuple(
    sorted({t for t, _ in _FUNDS} | {n for _, n in _FUNDS} | {t for t, _ in _TOPICS}))


def synthetic_feedback(n: int = 120, seed: int = 0) -> list[FeedbackRecord]:
    """``n`` deterministic SME-graded query rewrites (see module doc)."""
    rng = random.Random(seed)
    records = []
    kinds = (["clean"] * 45 + ["missing_entity"] * 14 + ["missed_intent"] * 12 + ["underspecified"] * 12
             + ["invented_entity"] * 8 + ["compliance_leak"] * 5 + ["wrong_time_period"] * 4)
    for index in range(n):
        ticker, name = rng.choice(_FUNDS)
        topic, fact = rng.choice(_TOPICS)
        kind = rng.choice(kinds)
        query = rng.choice([f"{ticker} {topic}", f"{ticker.lower()} {topic}?", f"whats the {topic} for {ticker}",
                            f"{topic} of {ticker} pls"])
        docs = [f"The {name} ({ticker}) {fact.format(x=rng.randint(2, 9))}.",
                f"{name} overview: an index fund offered by Vanguard with low costs.",
                f"{rng.choice(_FUNDS)[1]} {rng.choice(_TOPICS)[1].format(x=rng.randint(2, 9))}."]
        tags: list[str] = []
        notes = ""
        if kind == "clean":
            output = rng.choice([f"What is the {topic} of the {name} ({ticker})?",
                                 f"{name} ({ticker}) {topic}",
                                 f"{topic} of {ticker}, the {name}"])
            grade = rng.choice([4, 5, 5])
        elif kind == "missing_entity":
            output = rng.choice([f"What is the {topic} of this fund?", f"fund {topic}"])
            grade, tags, notes = rng.choice([2, 3]), ["missing_entity"], "dropped the fund ticker"
        elif kind == "missed_intent":
            output = rng.choice(_UNRELATED_INTENTS)
            grade, tags, notes = rng.choice([1, 2]), ["missed_intent", "missing_entity"], "not what the user asked"
        elif kind == "underspecified":
            output = rng.choice(["fund info", "info about this", "some details please"])
            grade, tags, notes = rng.choice([2, 3]), ["underspecified", "missing_entity"], "too vague to search"
        elif kind == "invented_entity":
            other = rng.choice([t for t, _ in _FUNDS if t != ticker] + ["VXQZX", "Fidelity Contrafund"])
            output = f"What is the {topic} of the {name} ({ticker}) compared with {other} and Morningstar ratings?"
            grade, tags, notes = 2, ["invented_entity"], "added a fund the user never mentioned"
        elif kind == "compliance_leak":
            account = f"{rng.randint(10_000_000, 99_999_999)}"
            query = f"my account {account} {ticker} {topic}"
            output = f"What is the {topic} of {ticker} for account {account}?"
            grade, tags, notes = 1, ["compliance_leak"], "account number sent to the index"
        else:
            output = f"What was the {topic} of the {name} ({ticker}) over the last decade?"
            grade, tags, notes = 3, ["wrong_time_period"], "user asked about now, not history"
        records.append(FeedbackRecord(
            query=query, output=output, grade=grade, error_tags=tuple(sorted(tags)),
            retrieved_doc_ids=(f"{ticker}-{topic.replace(' ', '-')}", f"{ticker}-overview", "other"),
            retrieved_texts=tuple(docs), gold_doc_ids=(f"{ticker}-{topic.replace(' ', '-')}",), notes=notes,
            id=f"syn-{seed}-{index:04d}",
        ))
    return records
