"""CalibAdv's signals: silver documents of a group and step scores of a rollout.

Plain Python per group of rollouts; :func:`search_step_scores` pads a batch's
scores into the ``(B, S)`` ``step_scores`` tensor of
:class:`calibrl.trainer.advantages.AdvantageInputs` (the ``calibadv`` estimator's batch
inputs, registered with it), and the estimator does the rest.

The rules are those of the authors' code (Wu et al., arXiv 2604.18235, verl
fork; docs/design.md, "Advantages and loss", CalibAdv rules 1-3), checked rule by rule:

1. **Reward** of a search rollout is ``F1 x format``: answer token F1 times 1
   when the trajectory is well formed (:func:`calibrl.trainer.search_format.check_format`),
   else 0.
2. **Silver documents** of a group: among the *well-formed* rollouts whose
   reward is at least ``f1_threshold`` (0.7), those with the highest reward;
   tied rollouts pool their documents. Malformed rollouts never contribute. No
   such rollout: no silver documents (every step then keeps its advantage).
   With ``use_gold`` and known gold ids, the gold documents serve instead (our
   option).
3. **Step score** ``s_k = (#silver docs of step k not retrieved by any earlier
   step of the rollout) / (#docs listed in step k)``, and 0 when step k
   repeats: its ``<think>`` text has word-level edit similarity above 0.5
   with some earlier step's, or it shares more than one document with some
   *single* earlier step (compared step by step, not with the union). A step
   without documents scores 0; a malformed rollout gets 0 for every step.

Choices the release leaves open, made here and tested:

* A silver document listed twice within one step counts once in the
  numerator (the denominator is the step's list length).
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
from calibrl.text import token_f1

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.trainer.config import CalibAdvAdvantage
    from calibrl.trainer.kinds.search.records import SearchRollout

__all__ = ["SearchStep", "search_step_found_gold", "search_step_scores", "select_silver_docs", "step_scores",
           "word_edit_similarity"]


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
    rewards: Sequence[float],
    steps: Sequence[Sequence[SearchStep]],
    gold_doc_ids: Sequence[str] | None = None,
    f1_threshold: float = 0.7,
    use_gold: bool = False,
    well_formed: Sequence[bool] | None = None,
) -> set[str]:
    """Silver documents of one group of rollouts (rule 2 of the module docstring).

    ``rewards[i]`` is rollout i's reward ``F1 x format`` in [0, 1], ``steps[i]``
    its search steps and ``well_formed[i]`` whether it follows the format (None:
    all do). Returns the union of the documents retrieved by every well-formed
    rollout at the highest reward among the well-formed rollouts, when that
    reward is >= ``f1_threshold``, else the empty set; with ``use_gold`` and
    non-empty ``gold_doc_ids``, returns those.
    """
    if len(rewards) != len(steps):
        raise InvalidArgument("steps", f"has {len(steps)} rollouts but rewards has {len(rewards)}")
    if well_formed is None:
        well_formed = [True] * len(rewards)
    if len(well_formed) != len(rewards):
        raise InvalidArgument("well_formed", f"has {len(well_formed)} flags but rewards has {len(rewards)}")
    if not 0.0 <= f1_threshold <= 1.0:
        raise InvalidArgument("f1_threshold", f"must be in [0, 1], got {f1_threshold}")
    for i, reward in enumerate(rewards):
        if not (isinstance(reward, (int, float)) and math.isfinite(reward) and 0.0 <= reward <= 1.0):
            raise InvalidArgument("rewards", f"rollout {i}: reward must be a number in [0, 1], got {reward!r}")
    if use_gold and gold_doc_ids:
        return set(gold_doc_ids)
    candidates = [i for i, ok in enumerate(well_formed) if ok and rewards[i] >= f1_threshold]
    if not candidates:
        return set()
    best = max(rewards[i] for i in candidates)
    silver: set[str] = set()
    for i in candidates:
        if rewards[i] == best:
            for step in steps[i]:
                silver.update(step.doc_ids)
    return silver


def _repeats_earlier(step: SearchStep, earlier: Sequence[SearchStep], similarity_threshold: float,
                     max_shared_docs: int) -> bool:
    """Rule 3's repeat test, against each earlier step separately."""
    docs = set(step.doc_ids)
    think = step.think.strip()
    for previous in earlier:
        if len(docs & set(previous.doc_ids)) > max_shared_docs:
            return True
        other = previous.think.strip()
        if (think or other) and word_edit_similarity(think, other) > similarity_threshold:
            return True
    return False


def step_scores(
    steps: Sequence[SearchStep],
    silver_docs: set[str],
    well_formed: bool,
    similarity_threshold: float = 0.5,
    max_shared_docs: int = 1,
) -> list[float]:
    """Step score ``s_k`` in [0, 1] of each search step of one rollout (rule 3).

    ``s_k = (#silver docs of step k not retrieved by an earlier step) / (#docs
    in step k)``; 0 for a step that repeats an earlier one (think text
    similarity above ``similarity_threshold`` with some earlier step, or more
    than ``max_shared_docs`` documents shared with some single earlier step),
    for a step without documents, and for every step of a trajectory that is
    not ``well_formed``.
    """
    if not 0.0 <= similarity_threshold <= 1.0:
        raise InvalidArgument("similarity_threshold", f"must be in [0, 1], got {similarity_threshold}")
    if max_shared_docs < 0:
        raise InvalidArgument("max_shared_docs", f"must be >= 0, got {max_shared_docs}")
    if not well_formed:
        return [0.0] * len(steps)
    scores: list[float] = []
    seen: set[str] = set()
    for k, step in enumerate(steps):
        if not step.doc_ids or _repeats_earlier(step, steps[:k], similarity_threshold, max_shared_docs):
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
    (B, T). Silver documents are chosen per group from the well-formed rollouts
    ranked by F1 x format (``settings.f1_threshold``, ``settings.use_gold``); step k of a rollout is its generated segment k. Slots
    without a search step (the answer segment, unused turns) are NaN: the
    estimator reads only intermediate segments."""
    import torch

    slots = max(1, int(segment_index.max()) + 1)
    scores = torch.full((len(rollouts), slots), float("nan"), dtype=torch.float32)
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_index.tolist()):
        groups.setdefault(int(group), []).append(row)
    for rows in groups.values():
        steps = [[SearchStep(s.think, tuple(s.result.doc_ids)) for s in rollouts[r].steps] for r in rows]
        well_formed = [rollouts[r].well_formed for r in rows]
        # Rule 1: silver docs rank rollouts by F1 x format, whatever the training reward blends.
        rewards = [token_f1(rollouts[r].answer, rollouts[r].task.answers) if ok and rollouts[r].answer else 0.0
                   for r, ok in zip(rows, well_formed)]
        task = rollouts[rows[0]].task
        silver = select_silver_docs(rewards, steps, task.gold_doc_ids, settings.f1_threshold, settings.use_gold,
                                    well_formed=well_formed)
        for r, rollout_steps in zip(rows, steps):
            values = step_scores(rollout_steps, silver, rollouts[r].well_formed, settings.similarity_threshold)
            for k, value in enumerate(values[:slots]):
                scores[r, k] = value
    return scores


def search_step_found_gold(rollouts: Sequence["SearchRollout"], slots: int) -> "torch.Tensor":
    """(B, slots) float: 1 where search step k of rollout b retrieved one of its task's gold
    documents, 0 where it did not, NaN where the rollout has no step k or its task no gold
    labels (diagnostics of CalibAdv's interventions; no advantage reads it)."""
    import torch

    found = torch.full((len(rollouts), max(1, slots)), float("nan"), dtype=torch.float32)
    for row, rollout in enumerate(rollouts):
        gold = set(rollout.task.gold_doc_ids)
        if not gold:
            continue
        for k, step in enumerate(rollout.steps[: found.shape[1]]):
            found[row, k] = float(bool(gold & set(step.result.doc_ids)))
    return found
