"""The two-search domain (calibrl/demo/search_domain.py): splits, near misses, value sets."""

from __future__ import annotations

import collections
import pathlib

import pytest

from calibrl.demo import search_domain as sd
from calibrl.demo.domain import generate_domain
from calibrl.demo.error_analysis import aspect_of, best_constant_answers


@pytest.fixture(scope="module", params=[0, 6])
def domain(request: pytest.FixtureRequest):
    return generate_domain(request.param)


def _entities(domain, task) -> set[str]:
    """Every entity a question touches: its plan, the plan's family, its fund and the fund's family."""
    link = domain.search_links[task.gold_doc_ids[0]]
    return {link.plan.key, link.fund.key, "plans:" + link.plan.name.split()[0], "funds:" + link.fund.name.split()[0]}


def test_three_splits_share_no_bridge_or_answer_entity(domain) -> None:
    splits = {s: domain.multistep(s) for s in sd.SPLITS}
    assert {s: len(t) for s, t in splits.items()} == {
        "train": (sd.CLUSTERS - sd.TEST_CLUSTERS - sd.VALIDATION_CLUSTERS) * sd.FAMILY_SIZE * 4 * sd.TRAIN_PHRASINGS,
        "validation": sd.VALIDATION_CLUSTERS * sd.FAMILY_SIZE * 4, "heldout": sd.TEST_CLUSTERS * sd.FAMILY_SIZE * 4}
    touched = {s: set().union(*(_entities(domain, t) for t in tasks)) for s, tasks in splits.items()}
    assert not touched["train"] & touched["validation"]
    assert not touched["train"] & touched["heldout"]
    assert not touched["validation"] & touched["heldout"]
    docs = {s: {d for t in tasks for d in t.gold_doc_ids} for s, tasks in splits.items()}
    assert not docs["train"] & (docs["validation"] | docs["heldout"]) and not docs["validation"] & docs["heldout"]
    # the clusters the statistics know agree with the links
    for task in domain.multistep_tasks:
        assert domain.search_clusters[task.task_id] == domain.search_links[task.gold_doc_ids[0]].cluster


def test_the_best_constant_answer_scores_at_most_two_percent_per_aspect(domain) -> None:
    aspects = [a.key for a in sd.SEARCH_ASPECTS]
    train = domain.multistep("train")
    constants = best_constant_answers(train, aspects)
    assert set(constants) == set(aspects)
    for split in sd.SPLITS:
        by_aspect = collections.defaultdict(list)
        for task in domain.multistep(split):
            by_aspect[aspect_of(task.gold_doc_ids[-1], aspects)].append(task.answers[0] == constants[
                aspect_of(task.gold_doc_ids[-1], aspects)])
        for aspect, hits in by_aspect.items():
            assert sum(hits) / len(hits) <= 0.02, (split, aspect, sum(hits), len(hits))
    # every value is drawn from a set of at least 840 and never repeats across funds
    for aspect in sd.SEARCH_ASPECTS:
        search_funds = {e.key for e in domain.search_entities}
        values = [f.value for f in domain.facts if f.aspect.key == aspect.key and f.entity.key in search_funds]
        assert len(sd.search_values(aspect.key)) >= 840
        assert len(values) == len(set(values)) == sd.CLUSTERS * sd.FAMILY_SIZE
        assert set(values) <= set(sd.search_values(aspect.key))


def test_the_fund_name_is_only_in_the_bridge_document(domain) -> None:
    for task in domain.multistep_tasks[:200]:
        link = domain.search_links[task.gold_doc_ids[0]]
        assert link.plan.name in task.question and link.fund.name.split()[0] not in task.question
        bridge = next(p for p in domain.search_passages if p.doc_id == link.bridge_id)
        assert link.fund.name in bridge.text


def test_reference_searches_rank_first_and_near_misses_tie_the_siblings(domain, tmp_path: pathlib.Path) -> None:
    """With BM25 and one document per search, the full names find their passages; a query without
    the plan's industry word (or the fund's style word) returns one of the siblings, scored alike."""
    from calibrl.retrieval_server.sparse import BM25Searcher, build_bm25

    build_bm25([f"{p.title} {p.text}" for p in domain.passages], tmp_path, show_progress=False)
    ids = [p.doc_id for p in domain.passages]
    searcher = BM25Searcher(tmp_path)
    wanted = {step.query: step.doc_id for t in domain.multistep_tasks for step in t.steps}
    queries = sorted(wanted)
    found = searcher.search(queries, 1)
    assert {q: ids[hits[0][0]] for q, hits in zip(queries, found)} == wanted
    links = list(domain.search_links.values())
    families = collections.defaultdict(set)
    for link in links:
        families[link.cluster].add(link.bridge_id)
    careless = searcher.search([sd.first_query(link, careless=True) for link in links], sd.FAMILY_SIZE)
    hit_own = 0
    for link, hits in zip(links, careless):
        assert {ids[i] for i, _ in hits} == families[link.cluster]
        assert max(s for _, s in hits) - min(s for _, s in hits) < 1e-6 * max(s for _, s in hits)
        hit_own += ids[hits[0][0]] == link.bridge_id
    assert hit_own == sd.CLUSTERS  # a tie goes to one sibling per family: a third of the plans
    aspect = sd.SEARCH_ASPECTS[0]
    careless = searcher.search([sd.second_query(link.fund, aspect, careless=True) for link in links], sd.FAMILY_SIZE)
    suffix = "-" + aspect.key.replace("_", "-")
    for link, hits in zip(links, careless):
        siblings = {other.fund.key + suffix for other in links if other.cluster == link.cluster}
        assert {ids[i] for i, _ in hits} == siblings


def test_the_rewriter_half_does_not_see_the_search_half() -> None:
    domain = generate_domain(0)
    search_words = {w for e in domain.search_entities for w in e.name.split()} - {
        "Fund", "Retirement", "Plan"}
    rewriter_text = " ".join(f"{p.title} {p.text}" for p in domain.rewriter_passages())
    rewriter_text += " ".join(t.query for t in domain.rewrite_tasks)
    assert not {w for w in search_words if w in rewriter_text.split()}
