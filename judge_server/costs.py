"""What scoring an item costs the judge server, estimated before it is queued.

The estimate is seconds of server time on a 2-core CPU, per item, from the item's
sizes and the rubric's criteria. The constants were measured with one torch thread
on a shared 2-core host (load average 5-7, so they err on the slow side), by::

    python benchmarks/bench_tenants.py --only calibrate

- every programmatic scorer together (entity coverage, specificity, invented
  entities, format, ... and the hashed-ngrams embedder): ``PER_ITEM_S`` plus
  ``PER_TEXT_CHAR_S`` per character of query and output, ``PER_SOURCE_CHAR_S`` per
  character of retrieved text, retrieved id and context (only scanned once);
- the MiniLM sentence embedder (intent similarity embeds the query and the output,
  each alone): ``MINILM_PER_TEXT_S`` plus ``MINILM_PER_CHAR_S`` per character, up to
  ``MINILM_MAX_CHARS`` (the model truncates at 256 tokens). These are the retrieval
  service's constants for the same encoder on the same texts
  (``calibrl.retrieval_server.limits.DENSE_PER_QUERY_S`` and ``DENSE_PER_CHAR_S``): the
  judge's own earlier figures (11.6 ms for 24 characters, 75.6 ms for 1,808) put the
  largest accepted judge request at 1.8-2.2 s against its 1 s estimate
  (``bench_tenants.py --only worst``, load average ~11), where retrieval's largest
  measured 0.7-1.2 s in the same run.

A text that recurs within one request (a group's query, asked once per generation) is
embedded once when the embedder's text cache is on (``judge.embedder_cache_size`` > 0):
the encoder dedupes the texts of a batch and the cache answers the repeats of later
units, so ``item_costs(..., distinct_texts=True)`` charges MiniLM for each distinct text
once, at its first item. (A repeat that runs on the short lane while its first item's
unit is still encoding is embedded a second time; the estimate leaves that out.)

LLM criteria (transformers, vLLM) are not in this estimate: their cost depends on the
model; ``judge.llm_cost_per_item_s`` adds a flat figure per item and criterion.
"""

from __future__ import annotations

from typing import Sequence

from calibrl.api.judge import JudgeItem

PER_ITEM_S = 0.0001
PER_TEXT_CHAR_S = 1.4e-6  # 16,000 chars of query + output: 21.8 ms
PER_SOURCE_CHAR_S = 0.13e-6  # 50 retrieved texts x 8,000 chars: 52 ms
MINILM_PER_TEXT_S = 0.015  # as retrieval_server.limits.DENSE_PER_QUERY_S (same encoder)
MINILM_PER_CHAR_S = 85e-6  # as retrieval_server.limits.DENSE_PER_CHAR_S; flat past MINILM_MAX_CHARS (truncated)
MINILM_MAX_CHARS = 1800


def item_cost_s(item: JudgeItem, *, minilm: bool, llm_criteria: int = 0, llm_cost_per_item_s: float = 0.0,
                embedded: set[str] | None = None) -> float:
    """Estimated seconds to score ``item`` (see the module doc). ``embedded``: texts an
    earlier item of the request already pays MiniLM for (not charged again; this item's
    texts are added to it)."""
    texts = len(item.query) + len(item.output)
    sources = (sum(map(len, item.retrieved_texts)) + sum(map(len, item.retrieved_doc_ids))
               + sum(len(key) + len(value) for key, value in item.context))
    cost = PER_ITEM_S + PER_TEXT_CHAR_S * texts + PER_SOURCE_CHAR_S * sources
    if minilm:
        for text in (item.query, item.output):
            if embedded is not None:
                if text in embedded:
                    continue
                embedded.add(text)
            cost += MINILM_PER_TEXT_S + MINILM_PER_CHAR_S * min(len(text), MINILM_MAX_CHARS)
    return cost + llm_criteria * llm_cost_per_item_s


def item_costs(items: Sequence[JudgeItem], *, minilm: bool, llm_criteria: int = 0,
               llm_cost_per_item_s: float = 0.0, distinct_texts: bool = False) -> list[float]:
    """Estimated seconds per item of one request; with ``distinct_texts`` (the embedder's
    text cache is on) MiniLM is charged once per distinct text, at its first item."""
    embedded: set[str] | None = set() if distinct_texts else None
    return [item_cost_s(item, minilm=minilm, llm_criteria=llm_criteria, llm_cost_per_item_s=llm_cost_per_item_s,
                        embedded=embedded)
            for item in items]
