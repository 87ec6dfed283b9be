"""Shared data of the tests/test_sme_*.py tests: sample items built from the synthetic
SME feedback of calibrl.testing, and a rubric distilled from that feedback."""

from __future__ import annotations

import pathlib

from calibrl.sme.items import SampleItem, write_items
from calibrl.judge_server.authoring.distill import DistillOptions, distill
from calibrl.judge_server.rubric import dump_rubric
from calibrl.testing import SYNTHETIC_GLOSSARY, synthetic_feedback


def feedback_items(n: int = 40, seed: int = 0) -> list[SampleItem]:
    """Items an agent produced (the synthetic feedback without its grades); every third misses retrieval."""
    items = []
    for index, record in enumerate(synthetic_feedback(n, seed)):
        hit = index % 3 != 2
        items.append(SampleItem(
            id=record.id, query=record.query, output=record.output,
            retrieved_doc_ids=record.retrieved_doc_ids if hit else record.retrieved_doc_ids[1:],
            retrieved_texts=record.retrieved_texts if hit else record.retrieved_texts[1:],
            gold_doc_ids=record.gold_doc_ids, signals=(("hit", 1.0 if hit else 0.0), ("mrr", 1.0 if hit else 0.0)),
            judge_total=round((index * 37 % 100) / 100, 2), context=(("domain", "funds"),),
        ))
    return items


def write_sample(path: pathlib.Path, n: int = 6) -> list[SampleItem]:
    items = feedback_items(n)
    write_items(path, items)
    return items


def write_rubric(folder: pathlib.Path) -> tuple[pathlib.Path, list]:
    """A programmatic rubric distilled from 160 synthetic records; returns (path, golden records)."""
    result = distill(synthetic_feedback(160, seed=1), DistillOptions(
        rubric_id="sme-test", golden_fraction=0.3, criteria_mode="programmatic", glossary=SYNTHETIC_GLOSSARY))
    path = folder / "sme-test.yaml"
    path.write_text(dump_rubric(result.rubric), encoding="utf-8")
    return path, result.golden
