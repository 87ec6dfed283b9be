"""The demo's simulated SMEs (calibrl/demo/experts.py): they grade from a hidden quality, the
search outcome and their own habits; they share no list, threshold or pattern with any judge;
nothing golden reaches a judge's training or warm start; kappa intervals (calibrl.stats)."""

from __future__ import annotations

import ast
import dataclasses
import math
import pathlib
import random
import re
import subprocess
import sys

import pytest

from calibrl.demo import experts as ex
from calibrl.demo.domain import (
    ACCOUNT_ASPECTS,
    ACCOUNTS,
    ASPECT_BY_KEY,
    ENTITY_BY_KEY,
    ERROR_TAGS,
    FUND_ASPECTS,
    FUNDS,
    generate_domain,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIMULATOR = ROOT / "calibrl" / "demo" / "experts.py"
# Everything that judges: the programmatic criteria, the LLM judge's prompts and training,
# distillation, validation (judge_server/), the demo's LLM judge, the shipped rubrics.
# the judge's text analysis (word lists, query similarity) lives in the core, calibrl/entities.py
JUDGE_SOURCES = sorted((ROOT / "judge_server").rglob("*.py")) + [ROOT / "calibrl" / "entities.py",
                                                                 ROOT / "calibrl" / "demo" / "judge_model.py"]
JUDGE_RUBRICS = sorted((ROOT / "configs" / "rubrics").glob("*.yaml"))


@pytest.fixture(scope="module")
def domain():
    return generate_domain(0)


# --- nothing shared with a judge ------------------------------------------------------------------------------------


def test_the_simulator_loads_nothing_of_the_judge() -> None:
    """Generating the domain (its SME reviews included) imports no judge module (nor the judge's
    text analysis, which lives in the core)."""
    code = ("import sys, tempfile\nfrom calibrl.demo.domain import generate_domain, write_domain\n"
            "write_domain(generate_domain(0), tempfile.mkdtemp())\n"
            "print(sorted(m for m in sys.modules if m.startswith('calibrl.judge_server') or m == 'calibrl.entities'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    imported = {alias.name if isinstance(node, ast.Import) else node.module or ""
                for node in ast.walk(ast.parse(SIMULATOR.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert not {m for m in imported if "judge" in m}, imported


def _flatten(value, strings: set, numbers: set, depth: int = 0) -> None:
    """Every string and number inside a constant (collections, dataclasses, mappings)."""
    if depth > 6:
        return
    if isinstance(value, str):
        strings.add(value)
    elif isinstance(value, bool):
        return
    elif isinstance(value, (int, float)):
        numbers.add(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(k, strings, numbers, depth + 1)
            _flatten(v, strings, numbers, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _flatten(v, strings, numbers, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _flatten(getattr(value, f.name), strings, numbers, depth + 1)


def _literals(path: pathlib.Path) -> tuple[set, set]:
    """String literals (docstrings aside) and numeric literals of a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings, numbers = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings:
            _flatten(node.value, strings, numbers)
    return strings, numbers


def _judge_constants() -> tuple[set, set]:
    """Every string and number a judge holds: its literals, its modules' constants (word lists
    built at import included), each string's words, and the shipped rubrics' values."""
    import importlib

    import yaml

    strings, numbers = set(), set()
    for path in JUDGE_SOURCES:
        s, n = _literals(path)
        strings |= s
        numbers |= n
        module = ("calibrl.demo.judge_model" if path.name == "judge_model.py" else
                  "calibrl.entities" if path == ROOT / "calibrl" / "entities.py" else
                  "calibrl.judge_server." + ".".join(path.relative_to(ROOT / "judge_server").with_suffix("").parts))
        if module.endswith("__init__"):
            continue
        loaded = importlib.import_module(module)
        for name, value in vars(loaded).items():
            if not name.startswith("__") and not callable(value) and not isinstance(value, type(sys)):
                _flatten(value, strings, numbers)
    for path in JUDGE_RUBRICS:
        _flatten(yaml.safe_load(path.read_text(encoding="utf-8")), strings, numbers)
    words = {w for s in strings for w in s.lower().split()}
    return strings | words, numbers


def _simulator_constants() -> tuple[set, set]:
    """The simulator's lists, tables, expert habits, search parameters and patterns."""
    strings, numbers = set(), set()
    for name, value in vars(ex).items():
        if name.isupper() or (name.startswith("_") and name[1:].isupper()):
            _flatten(value, strings, numbers)
    for name in ("SATURATION", "LENGTH_NORM"):
        _flatten(getattr(ex.CatalogueSearch, name), strings, numbers)
    tree = ast.parse(SIMULATOR.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # every regular expression the simulator uses
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                and node.args and isinstance(node.args[0], ast.Constant)):
            strings.add(node.args[0].value)
    return strings, numbers


# The SME error taxonomy is the feedback format itself: the experts write these tags and the
# distiller reads them (a tag names a kind of error; it is no rule for finding one).
SHARED_VOCABULARY = set(ERROR_TAGS)
# Generic numbers: identities (0.0: no offset, the noise's mean; 1.0: no scaling), rounding to
# nearest and BM25's idf smoothing (0.5, textbook formula constants, not thresholds) and the
# grade scale's top (5.0, where a grade starts).
GENERIC_NUMBERS = {0.0, 1.0, 0.5, 5.0}


def test_no_list_threshold_or_pattern_is_shared_with_any_judge() -> None:
    judge_strings, judge_numbers = _judge_constants()
    sim_strings, sim_numbers = _simulator_constants()
    assert sim_strings and sim_numbers and len(judge_strings) > 300  # the collectors found something
    assert {"stuff", "info"} <= judge_strings  # e.g. the judge's vague-word list, loaded and split
    assert not (sim_strings & judge_strings) - SHARED_VOCABULARY, sorted(sim_strings & judge_strings)
    # the simulator's grading knobs (defect costs, expert habits, search parameters) and every
    # fractional number written in its source (integers there are counts and sampling weights)
    knobs: set = set()
    search = (ex.CatalogueSearch.SATURATION, ex.CatalogueSearch.LENGTH_NORM)
    _flatten((ex.DEFECT_COST, ex.PANEL, search), set(), knobs)
    _, source_numbers = _literals(SIMULATOR)
    fractions = {n for n in source_numbers if isinstance(n, float)}
    assert len(knobs) >= 15
    shared = ((knobs | fractions) & judge_numbers) - GENERIC_NUMBERS
    assert not shared, sorted(shared)
    assert ex.PASS_GRADE == 4  # the feedback format's pass line (grades 4-5 pass), read by both sides


def test_grades_do_not_move_when_the_text_gains_the_judges_vague_words(monkeypatch) -> None:
    """The experts never read the text: appending the judge's vague words (which change no
    search result) to every rewritten text leaves every grade and tag as it was."""
    from calibrl.entities import VAGUE_TERMS

    domain = generate_domain(3)
    search = ex.CatalogueSearch(domain.rewriter_passages())
    vocabulary = {w for counts in search.counts for w in counts}
    padding = " ".join(sorted(w for w in VAGUE_TERMS if w not in vocabulary))
    assert len(padding.split()) >= 5
    real = ex._realise
    monkeypatch.setattr(ex, "_realise", lambda task, quality, rng: f"{real(task, quality, rng)} {padding}")
    padded = generate_domain(3)
    assert [r.rewrite for r in padded.sme_panel] != [r.rewrite for r in domain.sme_panel]
    assert [(r.grades, r.tags, r.gold_rank) for r in padded.sme_panel] == [
        (r.grades, r.tags, r.gold_rank) for r in domain.sme_panel]


# --- what the experts grade from ------------------------------------------------------------------------------------


def _has(text: str, phrase: str) -> bool:
    return re.search(r"(?<![a-z0-9])" + re.escape(phrase.lower()) + r"(?![a-z0-9])", text.lower()) is not None


def test_the_hidden_quality_is_what_the_generator_wrote(domain) -> None:
    tickers = {e.ticker for e in FUNDS}
    for review in domain.sme_panel:
        task = next(t for t in domain.rewrite_tasks if t.task_id == review.task_id)
        entity, aspect = ENTITY_BY_KEY[task.entity_key], ASPECT_BY_KEY[task.aspect_key]
        text, quality = review.rewrite, review.quality
        named = _has(text, entity.name) or bool(entity.ticker and _has(text, entity.ticker))
        others = [e for e in (*FUNDS, *ACCOUNTS) if e.key != entity.key and _has(text, e.name)]
        assert named == (quality.product == "by_name"), (text, quality)
        assert bool(others) == (quality.product == "another_product"), (text, quality)
        nickname = any(a in text.lower() for a in entity.aliases)
        assert nickname == (quality.product == "by_nickname"), (text, quality)
        made_up = [t for t in re.findall(r"\b[A-Z]{4}X\b", text) if t not in tickers]
        assert bool(made_up) == (quality.product == "made_up"), (text, quality)
        own_terms = any(_has(text, t) for t in aspect.glossary)
        assert own_terms == (quality.topic == "in_catalogue_terms"), (text, quality)
        if quality.topic == "another_topic":
            pool = FUND_ASPECTS if aspect.kind == "fund" else ACCOUNT_ASPECTS
            assert any(_has(text, t) for a in pool if a.key != aspect.key for t in a.glossary), text
    assert {r.quality.product for r in domain.sme_panel} == set(ex.PRODUCT_STATES)
    assert {r.quality.topic for r in domain.sme_panel} == set(ex.TOPIC_STATES)


def test_a_search_that_misses_costs_grade_points_whatever_the_text() -> None:
    clean = ex.RewriteQuality("by_name", "in_catalogue_terms")
    assert clean.defects() == ()
    for expert in ex.PANEL:
        found = [expert.review(clean, 1, random.Random(n))[0] for n in range(400)]
        missed = [expert.review(clean, None, random.Random(n))[0] for n in range(400)]
        # same noise draws: a miss never raises a grade and lowers the mean by about its cost
        assert all(m <= f for f, m in zip(found, missed))
        assert sum(found) / 400 - sum(missed) / 400 > expert.search_miss_cost / 2


def test_each_review_carries_its_assigned_experts_grade_and_the_experts_disagree(domain) -> None:
    by_id = {r.feedback_id: r for r in domain.sme_panel}
    for feedback in domain.sme_feedback:
        review = by_id[feedback.feedback_id]
        assert feedback.grade == review.grades[review.assigned]
        assert feedback.error_tags == review.tags[review.assigned]
        assert set(feedback.error_tags) <= set(ERROR_TAGS)
    counts = {e.name: sum(r.assigned == e.name for r in domain.sme_panel) for e in ex.PANEL}
    assert max(counts.values()) - min(counts.values()) <= 1  # a third each
    pass_fail = [{r.grades[e.name] >= ex.PASS_GRADE for e in ex.PANEL} for r in domain.sme_panel]
    assert 0 < sum(len(v) == 2 for v in pass_fail) < len(pass_fail) / 3  # some disagreement, not chaos
    for pair in ex.panel_agreement(domain.sme_panel, resamples=1000):
        assert 0.0 < pair.low <= pair.kappa <= pair.high < 1.0
        assert pair.n_items == len(domain.sme_panel) and pair.n_tasks < pair.n_items


def test_the_panel_file_reads_back(domain, tmp_path) -> None:
    from calibrl.demo.domain import write_domain

    files = write_domain(domain, tmp_path)
    assert ex.read_panel(files.sme_panel) == domain.sme_panel


# --- nothing golden reaches a judge's training or warm start ----------------------------------------------------------


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def test_no_golden_text_reaches_the_judges_warm_start_or_training(domain) -> None:
    from calibrl.demo.judge_model import domain_text_examples
    from calibrl.judge_server.authoring.distill import DistillOptions, distill, text_key
    from calibrl.judge_server.authoring.feedback import parse_record
    from calibrl.judge_server.authoring.train_judge import split_for_training

    records = [parse_record(r.record()) for r in domain.sme_feedback]
    result = distill(records, DistillOptions(rubric_id="demo", criteria_mode="llm",
                                             glossary=tuple(domain.glossary_terms())))
    golden = result.golden
    assert golden and not {text_key(r) for r in result.train} & {text_key(r) for r in golden}
    # training: train-judge's split, with and without the golden file
    listed_keys = frozenset(text_key(r) for r in golden)
    for listed in (frozenset(), listed_keys):
        train, held = split_for_training(records, 0.3, listed)
        assert train and not {text_key(r) for r in train} & {text_key(r) for r in golden}
    # warm start: no golden pair, no text equal to a golden rewrite
    texts = [_fold("".join(t for t, _ in e.pieces)) for e in domain_text_examples(domain, golden)]
    pairs = {_fold(f"User query: {r.query}\nAgent output: {r.output}") for r in golden}
    rewrites = {_fold(r.output) for r in golden}
    assert texts and not pairs & set(texts) and not rewrites & set(texts)
    # ... and the check can fail: without the golden set, the warm start would read golden pairs
    unguarded = domain_text_examples(domain, ())
    assert pairs & {_fold("".join(t for t, _ in e.pieces)) for e in unguarded}


# --- kappa intervals --------------------------------------------------------------------------------------------------


def _reference_kappa_interval(first, second, clusters, resamples, seed):
    """The obvious loop: the same cluster draws, kappa of each resample by the judge's metric."""
    import numpy as np

    from calibrl.judge_server.metrics import cohen_kappa

    members: dict = {}
    for i, label in enumerate(clusters):
        members.setdefault(label, []).append(i)
    groups = list(members.values())
    draws = np.random.default_rng(seed).integers(0, len(groups), size=(resamples, len(groups)))
    kappas = []
    for row in draws:
        units = [i for c in row for i in groups[c]]
        kappa = cohen_kappa([first[i] for i in units], [second[i] for i in units], [True, False])
        if kappa is not None:
            kappas.append(kappa)
    return np.percentile(kappas, [2.5, 97.5])


def test_kappa_interval_equals_the_plain_loop_and_the_judges_kappa() -> None:
    from calibrl.judge_server.metrics import cohen_kappa
    from calibrl.stats import kappa_interval

    rng = random.Random(7)
    first = [rng.random() < 0.45 for _ in range(90)]
    second = [a if rng.random() < 0.85 else not a for a in first]
    clusters = [i // 3 for i in range(90)]
    interval = kappa_interval(first, second, clusters=clusters, resamples=500, seed=3)
    # float64 sums of counts against the reference's Python floats: equal to the last few bits
    assert interval.estimate == pytest.approx(cohen_kappa(first, second, [True, False]), abs=1e-12)
    low, high = _reference_kappa_interval(first, second, clusters, 500, 3)
    assert interval.low == pytest.approx(low, abs=1e-12) and interval.high == pytest.approx(high, abs=1e-12)
    assert interval.low < interval.estimate < interval.high and interval.units == 90
    # clustering matters: the same items resampled one by one give a narrower interval
    alone = kappa_interval(first, second, resamples=500, seed=3)
    assert alone.estimate == interval.estimate and alone.high - alone.low != interval.high - interval.low


def test_kappa_interval_is_nan_where_kappa_is_undefined_and_checks_its_input() -> None:
    from calibrl.errors import InvalidArgument
    from calibrl.stats import kappa_interval

    same = kappa_interval([True] * 8, [True] * 8, resamples=200)
    assert math.isnan(same.estimate) and math.isnan(same.low) and math.isnan(same.high)
    with pytest.raises(InvalidArgument, match="second"):
        kappa_interval([True, False], [True])
    with pytest.raises(InvalidArgument, match="resamples"):
        kappa_interval([True, False], [True, False], resamples=10)
