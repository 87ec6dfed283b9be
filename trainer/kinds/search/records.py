"""The search agent's rollout records: a trajectory and its search steps, as the rollout
recorded them (the retrieval signals of each step are computed while it runs)."""

from __future__ import annotations

from dataclasses import dataclass

from calibrl.api.retrieval import RetrievalScore
from calibrl.trainer.tasks import Task


@dataclass(frozen=True)
class SearchStepRecord:
    """One ``<search>`` of a trajectory: the thought before it, the query and what it retrieved."""

    think: str
    query: str
    result: RetrievalScore  # computed during the rollout


@dataclass(frozen=True)
class SearchRollout:
    """One multi-step Search-R1 trajectory of ``task``."""

    task: Task
    steps: tuple[SearchStepRecord, ...]
    answer: str | None  # None when the trajectory gave no <answer>
    well_formed: bool  # the trajectory follows the format grammar (search_format.is_well_formed)


__all__ = ["SearchRollout", "SearchStepRecord"]
