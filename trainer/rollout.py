"""Rollouts: G samples per task from a generation engine, assembled into one
right-padded token batch with the masks the loss and the advantage estimators need.

Every row of a :class:`RolloutBatch` is a sequence of pieces, each either trained
(sampled by the policy) or not (the prompt, retrieved observations)::

    [prompt ... <think>] [turn 0: ... </search>] [\\n\\n<information>...</information>\\n\\n<think>]
    [turn 1: ... </answer>] [padding]

- ``completion_mask`` is True exactly on sampled tokens: the prompt, every
  observation (including the ``<think>`` it ends with) and padding are False, so
  observation tokens never enter the loss;
- ``segment_index`` numbers the sampled pieces 0..S-1 (turn k of a search agent is
  segment k; a rewrite is segment 0) and is -1 elsewhere;
- ``answer_mask`` marks the last sampled piece of each row (CalibAdv's answer
  segment).

The engine only sees token ids (``calibrl.trainer.engines``): the same code builds the
batch whatever engine sampled it. Rows are ordered task by task, ``group_size``
consecutive rows per task (``group_index``).

Search-agent turns: a turn ends at ``</search>`` or ``</answer>``, at EOS, or at
``max_new_tokens_per_turn``. A turn that closes ``<search>`` gets an observation
(unless it is the last allowed turn); a turn that answers, or closes no action,
ends the rollout. ``max_turns`` counts generated turns, the answer turn included.
Errors of the retrieval client propagate: a rollout is never built on a
failed search.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence, TypedDict

from calibrl.errors import InvalidArgument
from calibrl.api.retrieval import ScoreItem
from calibrl.trainer.policy import pad_token_id
from calibrl.trainer.search_format import (
    OBSERVATION_PREFIX,
    OBSERVATION_SUFFIX,
    REWRITE_STOP_STRINGS,
    REWRITE_TEMPLATE,
    SEARCH_TEMPLATE,
    TAGS,
    THINK_OPEN,
    TURN_STOP_STRINGS,
    fill_template,
    format_documents,
    is_well_formed,
    parse_turn,
    search_prompt_suffix,
)

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase
    import torch

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.api.retrieval import Hit
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.task_kinds import RunAsync
    from calibrl.trainer.tasks import Task


@dataclass
class RolloutBatch:
    """G rollouts per task as one token batch (shapes: B rows, L tokens)."""

    input_ids: "torch.Tensor"  # (B, L) prompt + completion (+ observations), right-padded
    attention_mask: "torch.Tensor"  # (B, L)
    completion_mask: "torch.Tensor"  # (B, L) bool: sampled tokens (prompt, observations, padding False)
    segment_index: "torch.Tensor"  # (B, L) long: sampled segment 0..S-1 of each trained token, -1 elsewhere
    answer_mask: "torch.Tensor"  # (B, L) bool: tokens of each row's last sampled segment
    group_index: "torch.Tensor"  # (B,) long: task index; group_size consecutive rows per task
    completion_texts: list[str]  # what followed the prompt (search: from the prompt's <think>, observations included)
    rollouts: list  # RewriteRollout or SearchRollout per row, same order
    old_logp: "torch.Tensor | None" = None  # (B, L), filled by the loop
    prompt_lengths: list[int] = field(default_factory=list)  # prompt tokens of each row

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: "torch.device | str") -> "RolloutBatch":
        """A copy with every tensor on ``device``."""
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            completion_mask=self.completion_mask.to(device),
            segment_index=self.segment_index.to(device),
            answer_mask=self.answer_mask.to(device),
            group_index=self.group_index.to(device),
            old_logp=None if self.old_logp is None else self.old_logp.to(device),
        )


# --------------------------------------------------------------------------- token assembly


Piece = tuple[Sequence[int], bool]  # (token ids, sampled by the policy)


def assemble_rows(rows: Sequence[Sequence[Piece]], pad_id: int) -> dict[str, "torch.Tensor"]:
    """Right-pad rows of pieces into ``input_ids``, ``attention_mask``,
    ``completion_mask``, ``segment_index`` and ``answer_mask`` (see the module
    docstring). Each sampled piece is one segment, numbered in order per row."""
    import torch

    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    completion_mask = torch.zeros(shape, dtype=torch.bool)
    segment_index = torch.full(shape, -1, dtype=torch.long)
    answer_mask = torch.zeros(shape, dtype=torch.bool)
    for r, row in enumerate(rows):
        position = 0
        segment = -1
        last_span = None
        for ids, sampled in row:
            end = position + len(ids)
            input_ids[r, position:end] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[r, position:end] = 1
            if sampled and len(ids):
                segment += 1
                completion_mask[r, position:end] = True
                segment_index[r, position:end] = segment
                last_span = (position, end)
            position = end
        if last_span is not None:
            answer_mask[r, last_span[0] : last_span[1]] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "segment_index": segment_index,
        "answer_mask": answer_mask,
    }


def encode_prompt(tokenizer: "PreTrainedTokenizerBase", text: str, *, suffix: str = "",
                  chat_template: bool | None = None) -> list[int]:
    """Token ids of a prompt. With a chat template (``chat_template`` None = use the
    tokenizer's when it has one) ``text`` is the user turn and ``suffix`` follows
    the assistant header; otherwise ``text + suffix`` with the tokenizer's usual
    special tokens (e.g. BOS)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    if use_chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("chat_template", "the tokenizer has no chat template; pass chat_template=False")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(rendered + suffix, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text + suffix, add_special_tokens=True)["input_ids"])


def decode_completion(tokenizer: "PreTrainedTokenizerBase", token_ids: Sequence[int]) -> str:
    """Text of sampled tokens without EOS/padding-like special tokens (format tags
    registered as special tokens are kept)."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    kept = [
        t for t in token_ids if t not in special or tokenizer.convert_ids_to_tokens(int(t)) in TAGS
    ]
    return tokenizer.decode(kept, skip_special_tokens=False)


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


def _check_common(tasks: Sequence["Task"], kind: str, group_size: int, temperature: float, top_p: float) -> None:
    if not tasks:
        raise InvalidArgument("tasks", "is empty; a rollout needs at least one task")
    for i, task in enumerate(tasks):
        if task.kind != kind:
            raise InvalidArgument(f"tasks[{i}].kind", f"is {task.kind!r}; rollout_{kind}{'s' if kind == 'rewrite' else ''} takes {kind!r} tasks")
    if not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgument("group_size", f"must be an integer >= 1, got {group_size!r}")
    if not temperature >= 0.0:
        raise InvalidArgument("temperature", f"must be >= 0, got {temperature!r}")
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p!r}")


def _checked_completions(completions: list[list[int]], expected: int) -> list[list[int]]:
    if len(completions) != expected:
        raise RuntimeError(f"the generation engine returned {len(completions)} completions for {expected} prompts")
    for i, ids in enumerate(completions):
        if not ids:
            raise RuntimeError(f"the generation engine returned an empty completion for prompt {i}")
    return completions


def _group_index(num_tasks: int, group_size: int) -> "torch.Tensor":
    import torch

    return torch.arange(num_tasks, dtype=torch.long).repeat_interleave(group_size)


# --------------------------------------------------------------------------- rewriter


def parse_rewrite(text: str) -> str:
    """The rewrite in a completion: its first line, stripped."""
    return text.split("\n", 1)[0].strip()


def rollout_rewrites(
    engine: "GenerationEngine",
    tokenizer: "PreTrainedTokenizerBase",
    tasks: Sequence["Task"],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    prompt_template: str = REWRITE_TEMPLATE,
    seed: int | None = None,
    stop_strings: Sequence[str] = REWRITE_STOP_STRINGS,
    chat_template: bool | None = None,
) -> RolloutBatch:
    """``group_size`` one-step rewrites per task. The rewrite is the first line of
    the completion (it may be empty: the reward scores that, it is not an error)."""
    from calibrl.trainer.rewards import RewriteRollout

    _check_common(tasks, "rewrite", group_size, temperature, top_p)
    prompts = [
        encode_prompt(tokenizer, fill_template(prompt_template, task.query, task.context), chat_template=chat_template)
        for task in tasks
    ]
    requests = [prompt for prompt in prompts for _ in range(group_size)]
    completions = _checked_completions(
        engine.generate(
            requests,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_strings=tuple(stop_strings),
            seed=seed,
        ),
        len(requests),
    )
    rows, texts, rollouts = [], [], []
    for row, (prompt, completion) in enumerate(zip(requests, completions)):
        task = tasks[row // group_size]
        text = decode_completion(tokenizer, completion)
        rows.append([(prompt, False), (completion, True)])
        texts.append(text)
        rollouts.append(RewriteRollout(task=task, rewrite=parse_rewrite(text)))
    tensors = assemble_rows(rows, pad_token_id(tokenizer))
    return RolloutBatch(
        **tensors,
        group_index=_group_index(len(tasks), group_size),
        completion_texts=texts,
        rollouts=rollouts,
        prompt_lengths=[len(p) for p in requests],
    )


# --------------------------------------------------------------------------- search agent


@dataclass
class _SearchState:
    """One search-agent rollout in progress."""

    task: "Task"
    pieces: list[Piece]
    trajectory: str = THINK_OPEN  # text from the prompt's <think> on
    steps: list = field(default_factory=list)  # SearchStepRecord
    seen_doc_ids: list[str] = field(default_factory=list)
    answer: str | None = None
    done: bool = False

    def context(self) -> list[int]:
        return [token for ids, _ in self.pieces for token in ids]


def search_prompt(tokenizer: "PreTrainedTokenizerBase", task: "Task", *, prompt_template: str = SEARCH_TEMPLATE,
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
    _check_common(tasks, "search", group_size, temperature, top_p)
    for name, value in (("max_turns", max_turns), ("top_k", top_k), ("max_new_tokens_per_turn", max_new_tokens_per_turn),
                        ("max_obs_tokens", max_obs_tokens), ("max_query_chars", max_query_chars)):
        if not isinstance(value, int) or value < 1:
            raise InvalidArgument(name, f"must be an integer >= 1, got {value!r}")

    prompts = [search_prompt(tokenizer, task, prompt_template=prompt_template, chat_template=chat_template)
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
    completions = _checked_completions(engine.generate([state.context() for state in live], **sampling), len(live))
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
    from calibrl.trainer.rewards import SearchStepRecord

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
    from calibrl.trainer.rewards import SearchRollout

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
        group_index=_group_index(num_tasks, group_size),
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
