"""BM25 over title + text with bm25s, English stop words and Snowball stemming (PyStemmer).

Queries are tokenised exactly like the corpus (same pattern, stop words and
stemmer); query terms the corpus never used are dropped. A passage that matches
no query term (score 0) is not retrieved, so a BM25 hit list can be shorter than k.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Sequence

import numpy as np

BM25_DIR = "bm25"
STOPWORDS = "en"
STEMMER_LANGUAGE = "english"

_local = threading.local()


def _stemmer():  # PyStemmer objects must not be shared between threads
    stemmer = getattr(_local, "stemmer", None)
    if stemmer is None:
        import Stemmer

        stemmer = _local.stemmer = Stemmer.Stemmer(STEMMER_LANGUAGE)
    return stemmer


def tokenize(texts: Sequence[str], show_progress: bool = False) -> list[list[str]]:
    """Lower-cased, stop-word-free, stemmed tokens of each text."""
    import bm25s

    return bm25s.tokenize(
        list(texts), stopwords=STOPWORDS, stemmer=_stemmer(), return_ids=False, show_progress=show_progress
    )


def build_bm25(texts: Sequence[str], out_dir: pathlib.Path, *, k1: float = 1.5, b: float = 0.75,
               show_progress: bool = True) -> None:
    """Index ``texts`` (one per passage, in index order) and save under ``out_dir``."""
    import bm25s

    tokenized = bm25s.tokenize(list(texts), stopwords=STOPWORDS, stemmer=_stemmer(), show_progress=show_progress)
    model = bm25s.BM25(k1=k1, b=b)
    model.index(tokenized, show_progress=show_progress)
    model.save(str(out_dir), show_progress=False)


class BM25Searcher:
    """A saved bm25s index; ``search`` returns (index, score) pairs with score > 0."""

    def __init__(self, index_dir: pathlib.Path) -> None:
        import bm25s

        self.model = bm25s.BM25.load(str(index_dir), show_progress=False)
        self.doc_count = int(self.model.scores["num_docs"])

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        """Each query's scores are computed on their own (bm25s sums its term columns per
        query), then the top k of a block of queries is selected at once."""
        rows = [self.model.get_scores_from_ids(self.model.get_tokens_ids(tokens)) for tokens in tokenize(queries)]
        block = max(1, SELECT_BLOCK_CELLS // max(1, self.doc_count))
        results: list[list[tuple[int, float]]] = []
        for start in range(0, len(rows), block):
            results.extend(top_positive_rows(np.stack(rows[start : start + block]), k))
        return results


SELECT_BLOCK_CELLS = 1 << 22  # queries x passages selected at once (16 MiB of float32 scores)


def top_positive(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The best ``k`` (index, score) pairs with score > 0; ties go to the lower index."""
    positive = np.flatnonzero(scores > 0)
    if positive.size > k:
        # keep what reaches the k-th largest score; ties at that score are settled by the sort
        threshold = np.partition(scores[positive], positive.size - k)[positive.size - k]
        positive = positive[scores[positive] >= threshold]
    order = np.lexsort((positive, -scores[positive]))[:k]
    chosen = positive[order]
    return [(int(i), float(scores[i])) for i in chosen]


def top_positive_rows(scores: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """:func:`top_positive` of each row of ``scores`` (queries, passages), the k-th largest
    score of every row found by one partition; the same pairs, in the same order."""
    count = scores.shape[1]
    if k >= count:
        thresholds = np.zeros(len(scores), dtype=scores.dtype)
    else:  # a row's k-th largest score; with k or fewer positive scores it is <= 0 and every positive one stays
        thresholds = -np.partition(-scores, k - 1, axis=1)[:, k - 1]
    rows, columns = np.nonzero((scores > 0) & (scores >= thresholds[:, None]))
    values = scores[rows, columns]
    order = np.lexsort((columns, -values, rows))  # by row, then best score, then lower index
    rows, columns, values = rows[order], columns[order].tolist(), values[order].tolist()
    bounds = np.searchsorted(rows, np.arange(len(scores) + 1)).tolist()
    return [list(zip(columns[bounds[i] : min(bounds[i + 1], bounds[i] + k)],
                     values[bounds[i] : min(bounds[i + 1], bounds[i] + k)])) for i in range(len(scores))]
