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

Each task kind builds its rows with these helpers (:mod:`calibrl.trainer.kinds`): the
rewrite kind one sampled piece per row, the search agent one per turn with the
observations in between. A row's kind-specific record (what the reward reads) is any
object with the :class:`Rollout` protocol's ``task``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from calibrl.errors import InvalidArgument
from calibrl.trainer.handoff import Rollout, RolloutBatch
from calibrl.trainer.search_format import TAGS

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.tasks import Task


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


def check_rollout_args(tasks: Sequence["Task"], kind: str, group_size: int, temperature: float, top_p: float,
                       *, caller: str) -> None:
    """The arguments every kind's rollout checks: ``tasks`` non-empty and all of ``kind``, a group size
    >= 1, a temperature >= 0 and a top_p in (0, 1]; ``caller`` names the rollout function in the errors."""
    if not tasks:
        raise InvalidArgument("tasks", "is empty; a rollout needs at least one task")
    for i, task in enumerate(tasks):
        if task.kind != kind:
            raise InvalidArgument(f"tasks[{i}].kind", f"is {task.kind!r}; {caller} takes {kind!r} tasks")
    if not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgument("group_size", f"must be an integer >= 1, got {group_size!r}")
    if not temperature >= 0.0:
        raise InvalidArgument("temperature", f"must be >= 0, got {temperature!r}")
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p!r}")


def checked_completions(completions: list[list[int]], expected: int) -> list[list[int]]:
    """``completions``, checked to be ``expected`` non-empty token lists (an engine bug otherwise)."""
    if len(completions) != expected:
        raise RuntimeError(f"the generation engine returned {len(completions)} completions for {expected} prompts")
    for i, ids in enumerate(completions):
        if not ids:
            raise RuntimeError(f"the generation engine returned an empty completion for prompt {i}")
    return completions


def group_index(num_tasks: int, group_size: int) -> "torch.Tensor":
    """``(num_tasks * group_size,)`` long: each row's task index, ``group_size`` consecutive rows per task."""
    import torch

    return torch.arange(num_tasks, dtype=torch.long).repeat_interleave(group_size)
