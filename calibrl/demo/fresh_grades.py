"""The living-rubric demo's simulated experts: fresh grades of a training run's queued rollouts.

An expert of this panel checks one thing the judge never reads: whether the rewrite finds the
passage the user needed when the expert searches the catalogue with it, with their own keyword
search (:class:`calibrl.demo.experts.CatalogueSearch`, Okapi BM25 over titles and texts). The
grade follows the gold passage's rank:

    rank 1 -> 5,   rank 2 -> 4,   rank 3 to 6 -> 3,   lower, or not found -> 1

No word list, count, size or pattern of the text enters a grade, and nothing here is imported
from the judge (``calibrl.judge_server``) or shared with a rubric: the judge's weakness in the demo
(a criterion that pays for piling content words) is invisible to these experts except through
what it does to the search. ``tests/test_living_rubric.py`` checks that this module imports no
judge code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from calibrl.demo.experts import CatalogueSearch

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.domain import Passage
    from calibrl.sme.items import SampleItem

NOT_FOUND_TAG = "missed_intent"  # the feedback tag of a rewrite whose passage the expert could not find


def grade_of_rank(rank: int | None) -> int:
    """The expert's 1-5 grade of a rewrite whose gold passage came at ``rank`` (None: not found)."""
    if rank == 1:
        return 5
    if rank == 2:
        return 4
    if rank is not None and rank <= 6:
        return 3
    return 1


class FreshGrader:
    """Grades queued rollouts (``calibrl.sme.items.SampleItem``) as feedback records."""

    def __init__(self, passages: Sequence["Passage"], reviewer: str = "expert") -> None:
        self.search = CatalogueSearch(passages)
        self.reviewer = reviewer

    def grade(self, item: "SampleItem") -> tuple[int, tuple[str, ...]]:
        """(grade, error tags) of one item: the best rank of any of its gold passages."""
        ranks = [r for r in (self.search.gold_rank(item.output, d) for d in item.gold_doc_ids) if r is not None]
        grade = grade_of_rank(min(ranks) if ranks else None)
        return grade, (NOT_FOUND_TAG,) if grade == 1 else ()

    def feedback(self, items: Sequence["SampleItem"]) -> list:
        """One feedback record per item, with the id the review page would give it (``<item id>@<reviewer>``)."""
        from calibrl.judge_server.authoring.feedback import FeedbackRecord  # the records' file layout, not the judge

        records = []
        for item in items:
            grade, tags = self.grade(item)
            records.append(FeedbackRecord(item.query, item.output, grade=grade, error_tags=tags,
                                          id=f"{item.id}@{self.reviewer}"))
        return records


__all__ = ["FreshGrader", "grade_of_rank"]
