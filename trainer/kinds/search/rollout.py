"""The search agent's rollout: ``group_size`` multi-turn Search-R1 trajectories per task.

A turn ends at ``</search>`` or ``</answer>``, at EOS, or at ``max_new_tokens_per_turn``. A
turn that closes ``<search>`` gets an observation (unless it is the last allowed turn); a turn
that answers, or closes no action, ends the rollout. ``max_turns`` counts generated turns, the
answer turn included. Errors of the retrieval client propagate: a rollout is never built on a
failed search. The token layout (trained turns, untrained observations) is
:mod:`calibrl.trainer.rollout`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, TypedDict

from calibrl.api.retrieval import Hit, ScoreItem
from calibrl.errors import InvalidArgument
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.policy import pad_token_id
from calibrl.trainer.rollout import (
    Piece,
    RolloutBatch,
    assemble_rows,
    check_rollout_args,
    checked_completions,
    decode_completion,
    encode_prompt,
    group_index,
)
from calibrl.trainer.search_format import (
    OBSERVATION_PREFIX,
    OBSERVATION_SUFFIX,
    SEARCH_TEMPLATE,
    THINK_OPEN,
    TURN_STOP_STRINGS,
    fill_template,
    format_documents,
    is_well_formed,
    parse_turn,
    search_prompt_suffix,
)
from calibrl.trainer.task_kinds import RunAsync
from calibrl.trainer.tasks import Task

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.engines import GenerationEngine


def observation_tokens(tokenizer: "PreTrainedTokenizerBase", hits: Sequence["Hit"],
                       max_obs_tokens: int) -> tuple[list[int], str]:
    """Token ids and text of the observation appended after a search: the
    formatted documents (cut to ``max_obs_tokens`` tokens) inside the information
    block, then the ``<think>`` that opens the next turn."""
    documents = format_documents(hits)
    document_ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    if len(document_ids) > max_obs_tokens:
        documents = tokenizer.decode(document_ids[:max_obs_tokens], skip_special_tokens=True)
    text = OBSERVATION_PREFIX + documents + OBSERVATION_SUFFIX
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


@dataclass
class _SearchState:
    """One search-agent rollout in progress."""

    task: "Task"
    pieces: list[Piece]
    trajectory: str = THINK_OPEN  # text from the prompt's <think> on
    steps: list[SearchStepRecord] = field(default_factory=list)
    seen_doc_ids: list[str] = field(default_factory=list)
    answer: str | None = None
    done: bool = False

    def context(self) -> list[int]:
        return [token for ids, _ in self.pieces for token in ids]


def search_prompt_ids(tokenizer: "PreTrainedTokenizerBase", task: "Task", *, prompt_template: str = SEARCH_TEMPLATE,
                  chat_template: bool | None = None) -> list[int]:
    """Token ids of a search-agent prompt; it ends with ``<think>``."""
    return encode_prompt(
        tokenizer,
        fill_template(prompt_template, task.query, task.context),
        suffix=search_prompt_suffix(),
        chat_template=chat_template,
    )


def rollout_search(
    engine: "GenerationEngine",
    tokenizer: "PreTrainedTokenizerBase",
    tasks: Sequence["Task"],
    *,
    group_size: int,
    retrieval: "RetrievalClient",
    run_async: "RunAsync",
    max_turns: int = 4,
    top_k: int = 3,
    max_new_tokens_per_turn: int = 64,
    max_obs_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    prompt_template: str = SEARCH_TEMPLATE,
    chat_template: bool | None = None,
    max_query_chars: int = 1024,
) -> RolloutBatch:
    """``group_size`` multi-turn Search-R1 trajectories per task.

    Each turn, every live rollout generates once (one engine call for all of
    them); the searches of the turn go to ``retrieval.score`` in one batch
    (``run_async`` runs the coroutine from this synchronous code), with the
    task's gold ids and answers and the documents the rollout has already seen,
    ``include_text=True``. The results are appended as non-trained observation
    tokens and recorded as ``SearchStepRecord(think, query, result)``. Queries are
    cut to ``max_query_chars`` characters before they are sent."""
    check_rollout_args(tasks, "search", group_size, temperature, top_p, caller="rollout_search")
    for name, value in (("max_turns", max_turns), ("top_k", top_k), ("max_new_tokens_per_turn", max_new_tokens_per_turn),
                        ("max_obs_tokens", max_obs_tokens), ("max_query_chars", max_query_chars)):
        if not isinstance(value, int) or value < 1:
            raise InvalidArgument(name, f"must be an integer >= 1, got {value!r}")

    prompts = [search_prompt_ids(tokenizer, task, prompt_template=prompt_template, chat_template=chat_template)
               for task in tasks]
    _check_context_budget(engine, tokenizer, max(len(p) for p in prompts), max_turns=max_turns,
                          max_new_tokens_per_turn=max_new_tokens_per_turn, max_obs_tokens=max_obs_tokens)
    states = [
        _SearchState(task=task, pieces=[(prompt, False)])
        for task, prompt in zip(tasks, prompts)
        for _ in range(group_size)
    ]

    for turn in range(max_turns):
        live = [state for state in states if not state.done]
        if not live:
            break
        sampling = _TurnSampling(max_new_tokens=max_new_tokens_per_turn, temperature=temperature, top_p=top_p,
                                 stop_strings=TURN_STOP_STRINGS, seed=None if seed is None else seed + turn)
        searching = _generate_turn(engine, tokenizer, live, sampling, last_turn=turn == max_turns - 1,
                                   max_query_chars=max_query_chars)
        if searching:
            _observe(retrieval, run_async, tokenizer, searching, top_k, max_obs_tokens)
    return _search_batch(tokenizer, states, len(tasks), group_size)


class _TurnSampling(TypedDict):
    """The engine's sampling arguments for one search-agent turn."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stop_strings: tuple[str, ...]
    seed: int | None


def _generate_turn(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", live: list[_SearchState],
                   sampling: _TurnSampling,
                   *, last_turn: bool, max_query_chars: int) -> list[tuple[_SearchState, str, str]]:
    """One generation for every live rollout (one engine call); returns the
    ``(state, think, query)`` of those that searched and have a turn left to use it."""
    completions = checked_completions(engine.generate([state.context() for state in live], **sampling), len(live))
    searching = []
    for state, completion in zip(live, completions):
        text = decode_completion(tokenizer, completion)
        state.pieces.append((completion, True))
        state.trajectory += text
        parsed = parse_turn(text)
        if parsed.action == "answer":
            state.answer, state.done = parsed.answer, True
        elif parsed.action == "search" and not last_turn:
            searching.append((state, parsed.think, parsed.query[:max_query_chars].strip()))
        else:
            state.done = True  # no action, or a search with no turn left to use it
    return searching


def _observe(retrieval: "RetrievalClient", run_async: "RunAsync",
             tokenizer: "PreTrainedTokenizerBase",
             searching: list[tuple[_SearchState, str, str]], top_k: int, max_obs_tokens: int) -> None:
    """Send the turn's searches to the retrieval client in one batch and append each
    result as a non-trained observation and a step record."""
    items = [
        ScoreItem(
            query=query,
            gold_doc_ids=tuple(state.task.gold_doc_ids),
            gold_answers=tuple(state.task.answers),
            seen_doc_ids=tuple(state.seen_doc_ids),
        )
        for state, _, query in searching
    ]
    results = run_async(retrieval.score(items, top_k, include_text=True))
    if len(results) != len(items):
        raise RuntimeError(f"the retrieval client returned {len(results)} scores for {len(items)} searches")
    for (state, think, query), result in zip(searching, results):
        ids, text = observation_tokens(tokenizer, result.hits, max_obs_tokens)
        state.pieces.append((ids, False))
        state.trajectory += text
        state.steps.append(SearchStepRecord(think=think, query=query, result=result))
        for doc_id in result.doc_ids:
            if doc_id not in state.seen_doc_ids:
                state.seen_doc_ids.append(doc_id)


def _search_batch(tokenizer: "PreTrainedTokenizerBase", states: list[_SearchState], num_tasks: int,
                  group_size: int) -> RolloutBatch:
    """The finished search rollouts as one RolloutBatch."""
    tensors = assemble_rows([state.pieces for state in states], pad_token_id(tokenizer))
    rollouts = [
        SearchRollout(
            task=state.task,
            steps=tuple(state.steps),
            answer=state.answer,
            well_formed=state.answer is not None and is_well_formed(state.trajectory),
        )
        for state in states
    ]
    return RolloutBatch(
        **tensors,
        group_index=group_index(num_tasks, group_size),
        completion_texts=[state.trajectory for state in states],
        rollouts=rollouts,
        prompt_lengths=[len(state.pieces[0][0]) for state in states],
    )


def _check_context_budget(engine: "GenerationEngine", tokenizer: "PreTrainedTokenizerBase", longest_prompt: int, *, max_turns: int,
                          max_new_tokens_per_turn: int, max_obs_tokens: int) -> None:
    """Fail before sampling when the longest possible trajectory cannot fit the
    engine's context (engines that do not know their context skip this)."""
    limit = getattr(engine, "max_context_tokens", None)
    if not limit:
        return
    wrapper = len(tokenizer(OBSERVATION_PREFIX + OBSERVATION_SUFFIX, add_special_tokens=False)["input_ids"])
    worst = longest_prompt + max_turns * max_new_tokens_per_turn + (max_turns - 1) * (max_obs_tokens + wrapper + 8)
    if worst > limit:
        raise InvalidArgument(
            "max_turns",
            f"a trajectory can reach {worst} tokens (prompt {longest_prompt} + max_turns {max_turns} x "
            f"max_new_tokens_per_turn {max_new_tokens_per_turn} + {max_turns - 1} observations of up to "
            f"max_obs_tokens {max_obs_tokens}), over the model's context of {limit}; lower one of them",
        )


__all__ = ["observation_tokens", "rollout_search", "search_prompt_ids"]
