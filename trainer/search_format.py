"""The text formats of the two agents: pure string functions, no torch.

Rewriter: one generated line, the rewritten search query.

Search agent (the Search-R1 convention, docs/design.md "Search-agent format")::

    <prompt ... Question: q>  <think> reasoning </think> <search> query </search>
    <information>Doc 1(Title: ...) text ...</information> <think> reasoning </think>
    <search> ... </search> <information> ... </information> <think> ... </think>
    <answer> final answer </answer>

The opening ``<think>`` of every turn is written by the environment, never by the
policy: it ends the prompt and every observation (CalibAdv (5)), so a generated
turn starts inside the think block and ends at ``</search>`` or ``</answer>``
(:data:`TURN_STOP_STRINGS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Protocol

from calibrl.errors import InvalidArgument

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
TAGS = (THINK_OPEN, THINK_CLOSE, SEARCH_OPEN, SEARCH_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, INFO_OPEN, INFO_CLOSE)

# A search-agent turn ends when the policy closes an action.
TURN_STOP_STRINGS: tuple[str, ...] = (SEARCH_CLOSE, ANSWER_CLOSE)
# A rewrite is one line.
REWRITE_STOP_STRINGS: tuple[str, ...] = ("\n",)

# An observation is OBSERVATION_PREFIX + formatted documents + OBSERVATION_SUFFIX; the
# suffix re-opens the think block so the next turn starts inside it.
OBSERVATION_PREFIX = f"\n\n{INFO_OPEN}"
OBSERVATION_SUFFIX = f"{INFO_CLOSE}\n\n{THINK_OPEN}"

REWRITE_TEMPLATE = (
    "Rewrite the question below as a single search query that retrieves the passages "
    "needed to answer it. Keep every name, date and constraint of the question; write "
    "only the query, on one line.\n"
    "{context}"
    "Question: {query}\n"
    "Search query:"
)

SEARCH_TEMPLATE = (
    "Answer the question below. Each time you receive new information, first reason "
    f"inside {THINK_OPEN} and {THINK_CLOSE}. If you are missing knowledge, search for it "
    f"by writing {SEARCH_OPEN} query {SEARCH_CLOSE}; the top results are returned between "
    f"{INFO_OPEN} and {INFO_CLOSE}. You may search as often as you need. When you are "
    f"ready, write the final answer, a few words and no explanation, inside {ANSWER_OPEN} "
    f"and {ANSWER_CLOSE}, for example {ANSWER_OPEN} Ada Lovelace {ANSWER_CLOSE}.\n"
    "{context}"
    "Question: {query}\n"
)


# --------------------------------------------------------------------------- prompts


class Passage(Protocol):
    """A retrieved passage as an observation shows it (a ``retrieval_server.types.Hit``)."""

    @property
    def title(self) -> str: ...

    @property
    def text(self) -> str: ...



def format_context(context: Iterable[tuple[str, str]]) -> str:
    """``Task.context`` pairs as prompt lines ``"<first>: <second>"``, one per pair
    (empty string when there is no context)."""
    lines = [f"{str(first).strip()}: {str(second).strip()}" for first, second in context]
    return "".join(f"{line}\n" for line in lines)


def fill_template(template: str, query: str, context: Iterable[tuple[str, str]] = ()) -> str:
    """``template`` with ``{query}`` (required) and ``{context}`` (optional) filled in."""
    if "{query}" not in template:
        raise InvalidArgument("prompt_template", "must contain the placeholder {query}")
    try:
        return template.format(query=query, context=format_context(context))
    except (KeyError, IndexError, ValueError) as exc:
        raise InvalidArgument(
            "prompt_template", f"only {{query}} and {{context}} may be used as placeholders ({exc!r})"
        ) from None


def search_prompt_suffix() -> str:
    """What ends every search-agent prompt: the opening think tag."""
    return THINK_OPEN


# --------------------------------------------------------------------------- observations


def format_documents(hits: Iterable[Passage]) -> str:
    """Retrieved passages (objects with ``title`` and ``text``) in the Search-R1 form
    ``Doc 1(Title: t) text``, one per line, numbered from 1."""
    lines = []
    for number, hit in enumerate(hits, start=1):
        text = " ".join(str(getattr(hit, "text", "")).split())
        lines.append(f"Doc {number}(Title: {getattr(hit, 'title', '')}) {text}".rstrip())
    return "\n".join(lines)


def format_observation(hits: Iterable[Passage]) -> str:
    """The whole observation appended after a ``</search>``: the information block and
    the ``<think>`` that opens the next turn."""
    return OBSERVATION_PREFIX + format_documents(hits) + OBSERVATION_SUFFIX


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ParsedTurn:
    """One generated search-agent turn (the text after the environment's ``<think>``)."""

    think: str  # reasoning text, stripped
    action: str | None  # "search", "answer", or None when the turn closes no action
    query: str | None  # the search query when action == "search"
    answer: str | None  # the final answer when action == "answer"
    well_formed: bool  # "thought </think> <search|answer>...</...>" and nothing else


_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANY_TAG = re.compile(r"</?(?:think|search|answer|information)>")


def parse_turn(text: str) -> ParsedTurn:
    """Parse one generated turn. The first closed ``<search>`` or ``<answer>`` block is
    the action (an empty search query is no action); the think text is what comes
    before ``</think>`` (or before the action when ``</think>`` is missing)."""
    close = text.find(THINK_CLOSE)
    action_match = _ACTION.search(text, close + len(THINK_CLOSE) if close >= 0 else 0)
    if close >= 0:
        think = text[:close]
    elif action_match is not None:
        think = text[: action_match.start()]
    else:
        think = text
    action = query = answer = None
    if action_match is not None:
        content = action_match.group(2).strip()
        if action_match.group(1) == "search":
            if content:
                action, query = "search", content
        else:
            action, answer = "answer", content
    return ParsedTurn(
        think=think.strip(), action=action, query=query, answer=answer, well_formed=_turn_well_formed(text)
    )


def _turn_well_formed(text: str) -> bool:
    """``thought </think> ws <search>q</search>`` or ``... <answer>a</answer>``, with
    no stray tags and nothing after the action but white space."""
    return is_well_formed(THINK_OPEN + text, require_answer=False, min_searches=0) and _ACTION.search(text) is not None


@dataclass(frozen=True)
class FormatCheck:
    """Result of :func:`check_format`: whether a trajectory follows the grammar, and if not, why."""

    well_formed: bool
    searches: int  # closed <search> blocks read before the check stopped
    reason: str  # "" when well formed, else the first violation, e.g. "text outside any block"


def check_format(trajectory: str, *, require_answer: bool = True, min_searches: int = 1) -> FormatCheck:
    """Check a whole search-agent trajectory against the format grammar.

    This is the one validator that the reward (``F1 x format``), CalibAdv's
    silver-document rule and the diagnostics share (docs/design.md, CalibAdv
    rule 1). ``trajectory`` starts with the prompt's opening ``<think>`` and
    holds every generated turn and observation in order. Grammar (white space
    only between blocks; information blocks are opaque)::

        think (search information think)* answer

    with balanced tags, no tag nested inside think/search/answer, a non-empty
    search query, nothing after the answer, and at least ``min_searches``
    searches (the authors' format requires one). With ``require_answer=False``
    the trajectory may also end after a search or information block (a
    trajectory in progress). The environment never writes an invalid-action
    notice (a turn without an action ends the trajectory), so no such notice
    can appear.
    """
    position = 0
    searches = 0
    expected = "think"  # the next block the grammar allows
    ended_with = None

    def bad(reason: str) -> FormatCheck:
        return FormatCheck(False, searches, reason)

    while True:
        match = _ANY_TAG.search(trajectory, position)
        if match is None:
            break
        if trajectory[position : match.start()].strip():
            return bad("text outside any block")
        tag = match.group(0)
        name = tag.strip("</>")
        if tag.startswith("</"):
            return bad(f"closing tag {tag} with no open block")
        if ended_with == "answer":
            return bad("a block after the answer")
        allowed = {"think": ("think",), "action": ("search", "answer"), "information": ("information",)}[expected]
        if name not in allowed:
            return bad(f"<{name}> where {' or '.join(f'<{a}>' for a in allowed)} was expected")
        close_tag = f"</{name}>"
        end = trajectory.find(close_tag, match.end())
        if end < 0:
            return bad(f"<{name}> is never closed")
        if name != "information" and _ANY_TAG.search(trajectory, match.end(), end):
            return bad(f"a tag inside <{name}>")
        if name == "search":
            if not trajectory[match.end() : end].strip():
                return bad("an empty search query")
            searches += 1
        position = end + len(close_tag)
        ended_with = name
        expected = {"think": "action", "search": "information", "answer": "think", "information": "think"}[name]
    if trajectory[position:].strip():
        return bad("text outside any block")
    if require_answer and ended_with != "answer":
        return bad("no answer")
    if not require_answer and ended_with not in ("search", "information", "answer"):
        return bad("no action")
    if ended_with == "answer" and searches < min_searches:
        return bad(f"{searches} searches before the answer, fewer than {min_searches}")
    return FormatCheck(True, searches, "")


def is_well_formed(trajectory: str, *, require_answer: bool = True, min_searches: int = 1) -> bool:
    """Whether a whole search-agent trajectory follows the format (see :func:`check_format`)."""
    return check_format(trajectory, require_answer=require_answer, min_searches=min_searches).well_formed
