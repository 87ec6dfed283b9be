"""The agents' text formats: prompts, observations, turn parsing, well-formedness."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from calibrl.errors import InvalidArgument
from calibrl.trainer.search_format import (
    OBSERVATION_PREFIX,
    OBSERVATION_SUFFIX,
    REWRITE_TEMPLATE,
    SEARCH_TEMPLATE,
    THINK_OPEN,
    TURN_STOP_STRINGS,
    fill_template,
    format_documents,
    format_observation,
    FormatCheck,
    check_format,
    is_well_formed,
    parse_turn,
    search_prompt_suffix,
)


@dataclass
class _Doc:
    title: str
    text: str


def test_search_prompt_ends_with_think_and_names_every_tag():
    prompt = fill_template(SEARCH_TEMPLATE, "Who wrote Dune?") + search_prompt_suffix()
    assert prompt.endswith("Question: Who wrote Dune?\n<think>")
    for tag in ("<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>"):
        assert tag in SEARCH_TEMPLATE
    assert set(TURN_STOP_STRINGS) == {"</search>", "</answer>"}


def test_templates_fill_query_and_context_lines():
    text = fill_template(REWRITE_TEMPLATE, "capital of france", (("domain", "geography"), ("locale", "fr")))
    assert "domain: geography\nlocale: fr\nQuestion: capital of france\n" in text
    assert text.endswith("Search query:")
    assert "{context}" not in fill_template(REWRITE_TEMPLATE, "q")


def test_templates_are_validated():
    with pytest.raises(InvalidArgument, match="prompt_template.*{query}"):
        fill_template("no placeholder here", "q")
    with pytest.raises(InvalidArgument, match="prompt_template"):
        fill_template("{query} {unknown}", "q")


def test_documents_are_numbered_search_r1_style():
    docs = [_Doc("Dune", "Dune is a 1965\n novel   by Frank Herbert."), _Doc("Paris", "Capital of France.")]
    assert format_documents(docs) == (
        "Doc 1(Title: Dune) Dune is a 1965 novel by Frank Herbert.\nDoc 2(Title: Paris) Capital of France."
    )
    observation = format_observation(docs)
    assert observation.startswith(OBSERVATION_PREFIX) and observation.startswith("\n\n<information>Doc 1(Title: Dune)")
    assert observation.endswith(OBSERVATION_SUFFIX) and observation.endswith("</information>\n\n<think>")
    assert format_observation([]) == "\n\n<information></information>\n\n<think>"


def test_parse_search_turn():
    turn = parse_turn(" I need the author. </think>\n<search> author of Dune </search>")
    assert (turn.think, turn.action, turn.query, turn.answer, turn.well_formed) == (
        "I need the author.", "search", "author of Dune", None, True
    )


def test_parse_answer_turn():
    turn = parse_turn("It is Herbert.</think><answer> Frank Herbert </answer>\n")
    assert (turn.think, turn.action, turn.query, turn.answer, turn.well_formed) == (
        "It is Herbert.", "answer", None, "Frank Herbert", True
    )


@pytest.mark.parametrize(
    "text, action, think",
    [
        ("no tags at all, just rambling", None, "no tags at all, just rambling"),
        ("thinking </think> and then nothing", None, "thinking"),
        ("unclosed </think> <search> half a query", None, "unclosed"),
        ("empty query </think> <search>   </search>", None, "empty query"),
        ("forgot to close think <search> q </search>", "search", "forgot to close think"),
    ],
)
def test_parse_malformed_turns(text, action, think):
    turn = parse_turn(text)
    assert turn.action == action
    assert turn.think == think
    assert not turn.well_formed


def test_first_action_wins_and_stray_text_is_malformed():
    turn = parse_turn("t </think> <answer> a </answer> trailing words")
    assert turn.action == "answer" and turn.answer == "a" and not turn.well_formed
    turn = parse_turn("t </think> <search> q1 </search><search> q2 </search>")
    assert turn.query == "q1" and not turn.well_formed


_GOOD = (
    "<think> need author </think> <search> Dune author </search>"
    "\n\n<information>Doc 1(Title: Dune) <b>Dune</b> by Herbert</information>\n\n"
    "<think> found </think>\n<answer> Frank Herbert </answer>"
)


@pytest.mark.parametrize(
    "trajectory, expected",
    [
        (_GOOD, True),
        # CalibAdv rule 1: at least one search before the answer
        ("<think> know it </think><answer> Paris </answer>", False),
        ("<think> know it </think><answer></answer>", False),
        # no answer
        ("<think> need author </think> <search> Dune author </search>", False),
        # text outside any block
        ("<think> a </think> so <answer> b </answer>", False),
        # anything after the answer
        ("<think> a </think><answer> b </answer><think> more </think>", False),
        ("<think> a </think><answer> b </answer> trailing", False),
        # a search must be followed by information, then think
        ("<think> a </think><search> q </search><think> b </think><answer> c </answer>", False),
        ("<think> a </think><search> q </search><information>x</information><answer> c </answer>", False),
        # empty search
        ("<think> a </think><search> </search><information>x</information><think> b </think><answer> c </answer>", False),
        # nested / stray tags inside a block
        ("<think> a <search> q </search> </think><answer> c </answer>", False),
        ("<think> a </think></think><answer> c </answer>", False),
        # unclosed block
        ("<think> a </think><answer> c", False),
        # must start with think
        ("<answer> c </answer>", False),
    ],
)
def test_is_well_formed(trajectory, expected):
    assert is_well_formed(trajectory) is expected


def test_min_searches_and_reasons():
    direct = "<think> know it </think><answer> Paris </answer>"
    assert is_well_formed(direct, min_searches=0)
    assert check_format(direct) == FormatCheck(False, 0, "0 searches before the answer, fewer than 1")
    assert check_format(_GOOD) == FormatCheck(True, 1, "")
    assert not check_format(_GOOD, min_searches=2).well_formed
    assert check_format("<think> a </think> so <answer> b </answer>").reason == "text outside any block"
    assert check_format("<think> a </think><answer> c").reason == "<answer> is never closed"
    assert check_format("<think> a </think><search> q </search>").reason == "no answer"


def test_in_progress_trajectories():
    assert is_well_formed("<think> a </think><search> q </search>", require_answer=False)
    assert is_well_formed(
        "<think> a </think><search> q </search>" + format_observation([_Doc("t", "x")])[: -len(THINK_OPEN)],
        require_answer=False,
    )
    assert not is_well_formed("<think> a </think>", require_answer=False)
