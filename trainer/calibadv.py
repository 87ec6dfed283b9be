"""CalibAdv's signals: silver documents of a group and step scores of a rollout.

Plain Python per group of rollouts; :func:`search_step_scores` pads a batch's
scores into the ``(B, S)`` ``step_scores`` tensor of
:class:`trainer.advantages.AdvantageInputs` (the ``calibadv`` estimator's batch
inputs, registered with it), and the estimator does the rest.

Semantics follow the authors' release (Wu et al., arXiv 2604.18235, verl fork):

1. **Silver documents** of a group are the documents retrieved by the group's
   best rollouts: those at the group's maximum answer F1, provided it is at
   least ``f1_threshold`` (0.7). Every rollout tied at the maximum counts. When
   gold document ids are known and ``use_gold`` is set, they serve instead.
2. **Step score** ``s_k = (#silver docs first seen in step k) / (#docs in step k)``.
   A step that repeats an earlier one scores 0: its ``<think>`` text is more
   than 0.5 word-level edit similarity to an earlier step's, or more than one
   of its documents was already retrieved by an earlier step. A step with no
   documents scores 0. A rollout whose trajectory is not well formed gets 0 for
   every step, i.e. the full negative advantage on every segment (the authors
   score only well-formed trajectories).

Choices the release leaves open, made here and tested:

* "First seen" is per rollout: a silver document counts for the first step of
  that rollout that retrieves it; a document listed twice within one step
  counts once in the numerator (the denominator is the step's list length).
* Two steps whose ``<think>`` texts are both empty are not a repetition by
  think text (there is no text to compare); their documents are still compared.
* ``use_gold`` without gold ids (``None`` or empty) falls back to the rollouts'
  silver documents, so tasks without gold annotations still get a signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from calibrl.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from trainer.config import CalibAdvAdvantage
    from trainer.rewards import SearchRollout

__all__ = ["SearchStep", "search_step_scores", "select_silver_docs", "step_scores", "word_edit_similarity"]


@dataclass(frozen=True)
class SearchStep:
    """One ``<think>`` + ``<search>`` step of a rollout."""

    think: str  # text of the step's <think>...</think> (may be "")
    doc_ids: tuple[str, ...]  # ids of the documents its <search> retrieved, in rank order


def _levenshtein(a: Sequence[str], b: Sequence[str]) -> int:
    """Edit distance between two word sequences (unit insert/delete/substitute)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, word_a in enumerate(a, start=1):
        current = [i]
        for j, word_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word_a != word_b)))
        previous = current
    return previous[-1]


def word_edit_similarity(a: str, b: str) -> float:
    """``1 - word-level Levenshtein(a, b) / max(#words)``; 1.0 for two empty texts.

    Words are white-space separated tokens, compared exactly.
    """
    words_a, words_b = a.split(), b.split()
    longest = max(len(words_a), len(words_b))
    if longest == 0:
        return 1.0
    return 1.0 - _levenshtein(words_a, words_b) / longest


def select_silver_docs(
    answer_f1: Sequence[float],
    steps: Sequence[Sequence[SearchStep]],
    gold_doc_ids: Sequence[str] | None = None,
    f1_threshold: float = 0.7,
    use_gold: bool = False,
) -> set[str]:
    """Silver documents of one group of rollouts.

    ``answer_f1[i]`` is rollout i's answer F1 in [0, 1] and ``steps[i]`` its
    search steps. Returns the union of the documents retrieved by every rollout
    at the group's maximum F1 when that maximum is >= ``f1_threshold``, else the
    empty set; with ``use_gold`` and non-empty ``gold_doc_ids``, returns those.
    """
    if len(answer_f1) != len(steps):
        raise InvalidArgument("steps", f"has {len(steps)} rollouts but answer_f1 has {len(answer_f1)}")
    if not 0.0 <= f1_threshold <= 1.0:
        raise InvalidArgument("f1_threshold", f"must be in [0, 1], got {f1_threshold}")
    for i, f1 in enumerate(answer_f1):
        if not (isinstance(f1, (int, float)) and math.isfinite(f1) and 0.0 <= f1 <= 1.0):
            raise InvalidArgument("answer_f1", f"rollout {i}: F1 must be a number in [0, 1], got {f1!r}")
    if use_gold and gold_doc_ids:
        return set(gold_doc_ids)
    if not answer_f1:
        return set()
    best = max(answer_f1)
    if best < f1_threshold:
        return set()
    silver: set[str] = set()
    for f1, rollout_steps in zip(answer_f1, steps):
        if f1 == best:
            for step in rollout_steps:
                silver.update(step.doc_ids)
    return silver


def _repeats_earlier(step: SearchStep, earlier: Sequence[SearchStep], seen: set[str], similarity_threshold: float,
                     max_repeated_docs: int) -> bool:
    if len(set(step.doc_ids) & seen) > max_repeated_docs:
        return True
    think = step.think.strip()
    for previous in earlier:
        other = previous.think.strip()
        if not think and not other:
            continue
        if word_edit_similarity(think, other) > similarity_threshold:
            return True
    return False


def step_scores(
    steps: Sequence[SearchStep],
    silver_docs: set[str],
    well_formed: bool,
    similarity_threshold: float = 0.5,
    max_repeated_docs: int = 1,
) -> list[float]:
    """Step score ``s_k`` in [0, 1] of each search step of one rollout.

    ``s_k = (#silver docs first seen in step k) / (#docs in step k)``; 0 for a
    step that repeats an earlier one (think text similarity above
    ``similarity_threshold``, or more than ``max_repeated_docs`` of its
    documents already retrieved), for a step without documents, and for every
    step of a trajectory that is not ``well_formed``.
    """
    if not 0.0 <= similarity_threshold <= 1.0:
        raise InvalidArgument("similarity_threshold", f"must be in [0, 1], got {similarity_threshold}")
    if max_repeated_docs < 0:
        raise InvalidArgument("max_repeated_docs", f"must be >= 0, got {max_repeated_docs}")
    if not well_formed:
        return [0.0] * len(steps)
    scores: list[float] = []
    seen: set[str] = set()
    for k, step in enumerate(steps):
        if not step.doc_ids or _repeats_earlier(step, steps[:k], seen, similarity_threshold, max_repeated_docs):
            scores.append(0.0)
        else:
            first_seen_silver = {doc for doc in step.doc_ids if doc in silver_docs and doc not in seen}
            scores.append(len(first_seen_silver) / len(step.doc_ids))
        seen.update(step.doc_ids)
    return scores


# --------------------------------------------------------------------------- a batch's step scores


def search_step_scores(rollouts: Sequence["SearchRollout"], group_index: "torch.Tensor", segment_index: "torch.Tensor",
                       settings: "CalibAdvAdvantage") -> "torch.Tensor":
    """CalibAdv step scores ``(B, S)`` of a batch of search rollouts.

    rollouts: B SearchRollouts; group_index: (B,) their groups; segment_index:
    (B, T). Silver documents are chosen per group (``settings.f1_threshold``,
    ``settings.use_gold``); step k of a rollout is its generated segment k. Slots
    without a search step (the answer segment, unused turns) are NaN: the
    estimator reads only intermediate segments."""
    import torch

    from calibrl.text import token_f1

    slots = max(1, int(segment_index.max()) + 1)
    scores = torch.full((len(rollouts), slots), float("nan"), dtype=torch.float32)
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_index.tolist()):
        groups.setdefault(int(group), []).append(row)
    for rows in groups.values():
        steps = [[SearchStep(s.think, tuple(s.result.doc_ids)) for s in rollouts[r].steps] for r in rows]
        f1 = [token_f1(rollouts[r].answer, rollouts[r].task.answers) if rollouts[r].answer else 0.0 for r in rows]
        task = rollouts[rows[0]].task
        silver = select_silver_docs(f1, steps, task.gold_doc_ids, settings.f1_threshold, settings.use_gold)
        for r, rollout_steps in zip(rows, steps):
            values = step_scores(rollout_steps, silver, rollouts[r].well_formed, settings.similarity_threshold)
            for k, value in enumerate(values[:slots]):
                scores[r, k] = value
    return scores
