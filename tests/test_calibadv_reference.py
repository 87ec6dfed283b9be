"""CalibAdv against a reference written from docs/design.md ("CalibAdv", rules 1-6).

The reference below is a plain-loop port of the rules as the authors' code
computes them: reward ``F1 x format``; silver documents from the best
well-formed rollouts; step scores with the pairwise repeat rule; soft penalty;
answer rebalance. It shares no code with ``calibrl.trainer.calibadv`` or
``calibrl.trainer.advantages`` (only the answer metric ``token_f1``, which is the
reward's definition, not CalibAdv's). Hand-made groups pin each rule,
including the three on which an earlier version disagreed with the authors;
a few hundred seeded random groups compare the whole pipeline
(``search_step_scores`` + ``compute_advantages("calibadv")``) with the
reference token by token.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
import torch

from calibrl.text import token_f1
from calibrl.api.retrieval import Hit, RetrievalScore
from calibrl.trainer.advantages import AdvantageInputs, compute_advantages
from calibrl.trainer.calibadv import SearchStep, search_step_scores, select_silver_docs, step_scores
from calibrl.trainer.config import CalibAdvAdvantage
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.tasks import Task
from calibrl.trainer.kinds.search.reward import score_search

GOLD_ANSWERS = ("paris france",)


# ---------------------------------------------------------------------------
# The reference: rules 1-6, one loop each
# ---------------------------------------------------------------------------


@dataclass
class RefRollout:
    steps: list[tuple[str, tuple[str, ...]]]  # (think text, doc ids) per search step
    answer: str | None
    well_formed: bool
    segment_tokens: list[int]  # tokens per generated segment; the last one is the answer segment


def ref_reward(rollout: RefRollout) -> float:
    """Rule 1: F1 x format."""
    f1 = token_f1(rollout.answer, GOLD_ANSWERS) if rollout.answer else 0.0
    return f1 * (1.0 if rollout.well_formed else 0.0)


def ref_silver(group: list[RefRollout], threshold: float = 0.7) -> set[str]:
    """Rule 2: the well-formed rollouts at the highest reward >= threshold pool their docs."""
    best = None
    for rollout in group:
        reward = ref_reward(rollout)
        if rollout.well_formed and reward >= threshold and (best is None or reward > best):
            best = reward
    silver: set[str] = set()
    for rollout in group:
        if rollout.well_formed and best is not None and ref_reward(rollout) == best:
            for _, docs in rollout.steps:
                silver.update(docs)
    return silver


def ref_edit_similarity(a: str, b: str) -> float:
    x, y = a.split(), b.split()
    if not x and not y:
        return 1.0
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(len(x) + 1):
        for j in range(len(y) + 1):
            if i == 0 or j == 0:
                table[i][j] = i + j
            else:
                table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (x[i - 1] != y[j - 1]))
    return 1.0 - table[len(x)][len(y)] / max(len(x), len(y))


def ref_step_scores(rollout: RefRollout, silver: set[str]) -> list[float]:
    """Rule 3, with the pairwise repeat test."""
    if not rollout.well_formed:
        return [0.0] * len(rollout.steps)
    scores = []
    for k, (think, docs) in enumerate(rollout.steps):
        earlier = rollout.steps[:k]
        repeat = False
        for earlier_think, earlier_docs in earlier:
            if len(set(docs) & set(earlier_docs)) > 1:
                repeat = True
            both_empty = not think.strip() and not earlier_think.strip()
            if not both_empty and ref_edit_similarity(think.strip(), earlier_think.strip()) > 0.5:
                repeat = True
        if repeat or not docs:
            scores.append(0.0)
            continue
        seen_before = {d for _, earlier_docs in earlier for d in earlier_docs}
        new_silver = {d for d in docs if d in silver and d not in seen_before}
        scores.append(len(new_silver) / len(docs))
    return scores


def ref_token_advantages(group: list[RefRollout], lambda_: float = 1.0) -> list[list[float]]:
    """Rules 4-6: base advantage, soft penalty, answer rebalance. One list of token advantages per rollout."""
    rewards = [ref_reward(r) for r in group]
    n = len(rewards)
    mean = sum(rewards) / n
    if n == 1 or all(r == rewards[0] for r in rewards):
        base = [0.0] * n
    else:
        std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5
        base = [(r - mean) / (std + 1e-6) for r in rewards]
    silver = ref_silver(group)
    tokens: list[list[float]] = []
    answer_slices = []
    for rollout, advantage in zip(group, base):
        scores = ref_step_scores(rollout, silver)
        row = []
        for k, count in enumerate(rollout.segment_tokens[:-1]):
            value = advantage * (1 - scores[k]) if advantage < 0 and k < len(scores) else advantage
            row += [value] * count
        answer_slices.append((len(row), len(row) + rollout.segment_tokens[-1]))
        row += [advantage] * rollout.segment_tokens[-1]
        tokens.append(row)
    positive = sum(v for row, (a, b) in zip(tokens, answer_slices) for v in row[a:b] if v > 0)
    negative = sum(-v for row, (a, b) in zip(tokens, answer_slices) for v in row[a:b] if v < 0)
    for row, (a, b) in zip(tokens, answer_slices):
        for t in range(a, b):
            if positive == 0 or negative == 0:
                row[t] = 0.0
            elif row[t] > 0:
                row[t] *= negative / (lambda_ * positive)
    return tokens


# ---------------------------------------------------------------------------
# The library, fed the same groups
# ---------------------------------------------------------------------------


def _record(think: str, docs: tuple[str, ...]) -> SearchStepRecord:
    hits = tuple(Hit(d, d, 1.0, i + 1) for i, d in enumerate(docs))
    score = RetrievalScore(hits=hits, hit=False, all_gold=False, recall=0.0, mrr=0.0, ndcg=0.0, first_gold_rank=0)
    return SearchStepRecord(think=think, query=think, result=score)


def library_token_advantages(groups: list[list[RefRollout]]) -> list[list[float]]:
    """search_step_scores + compute_advantages("calibadv") over a batch of groups; one row per rollout."""
    task = Task("t", "search", "q?", gold_doc_ids=(), answers=GOLD_ANSWERS)
    flat = [(g, r) for g, group in enumerate(groups) for r in group]
    width = max(sum(r.segment_tokens) for _, r in flat)
    completion = torch.zeros(len(flat), width, dtype=torch.bool)
    segment = torch.full((len(flat), width), -1, dtype=torch.long)
    rollouts = []
    for row, (_, rollout) in enumerate(flat):
        position = 0
        for k, count in enumerate(rollout.segment_tokens):
            completion[row, position : position + count] = True
            segment[row, position : position + count] = k
            position += count
        steps = tuple(_record(think, docs) for think, docs in rollout.steps)
        rollouts.append(SearchRollout(task, steps, rollout.answer, rollout.well_formed))
    last = torch.tensor([len(r.segment_tokens) - 1 for _, r in flat])[:, None]
    answer = completion & (segment == last)
    group_index = torch.tensor([g for g, _ in flat])
    rewards = torch.tensor([ref_reward(r) for _, r in flat], dtype=torch.float32)
    scores = search_step_scores(rollouts, group_index, segment, CalibAdvAdvantage())
    inputs = AdvantageInputs(rewards, group_index, completion, segment, answer, scores)
    token_adv, _ = compute_advantages("calibadv", inputs)
    return [token_adv[row, : sum(r.segment_tokens)].tolist() for row, (_, r) in enumerate(flat)]


def _assert_rows_close(library: list[list[float]], reference: list[list[float]]) -> None:
    # The library computes in float64 and returns float32 token advantages: each value carries one
    # float32 rounding (relative 2**-24 ~ 6e-8) of a number of magnitude <= ~1e3 (N / P can be large
    # when one small positive meets large negatives); 1e-6 relative + 1e-6 absolute covers that with room.
    assert len(library) == len(reference)
    for got, want in zip(library, reference):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


# ---------------------------------------------------------------------------
# Hand-made groups, one rule at a time
# ---------------------------------------------------------------------------


def test_rule1_a_malformed_trajectory_scores_zero_even_with_the_right_answer():
    right_but_malformed = RefRollout([("find city", ("a",))], "paris france", False, [2, 1])
    assert ref_reward(right_but_malformed) == 0.0
    from calibrl.trainer.rewards import RewardConfig, RewardModel

    class NoRetrieval:
        async def score(self, *args, **kwargs):
            raise AssertionError("search rewards use the step results of the rollout")

    model = RewardModel(RewardConfig(w_rubric=0.0), NoRetrieval(), None)
    task = Task("t", "search", "q?", answers=GOLD_ANSWERS)
    rollouts = [SearchRollout(task, (_record("find city", ("a",)),), "paris france", False),
                SearchRollout(task, (_record("find city", ("a",)),), "paris france", True)]
    malformed, well_formed = asyncio.run(score_search(model, rollouts))
    assert malformed.total == 0.0 and well_formed.total == 1.0
    raw_model = RewardModel(RewardConfig(w_rubric=0.0, answer_times_format=False), NoRetrieval(), None)
    raw = asyncio.run(score_search(raw_model, rollouts))
    assert raw[0].total == 1.0  # the option keeps the raw F1


def test_rule2_silver_docs_come_only_from_well_formed_rollouts():
    # The malformed rollout has the best raw F1 (1.0); the authors rank by F1 x format, so the
    # well-formed rollout at 0.8 supplies the silver docs.
    steps = [[SearchStep("a", ("m1", "m2"))], [SearchStep("b", ("w1", "w2"))], [SearchStep("c", ("z",))]]
    assert select_silver_docs([1.0, 0.8, 0.0], steps, well_formed=[False, True, True]) == {"w1", "w2"}
    # Even a malformed rollout's raw F1 above every well-formed one never contributes, and below
    # the threshold nothing is silver.
    assert select_silver_docs([1.0, 0.5, 0.0], steps, well_formed=[False, True, True]) == set()
    # Ties among well-formed rollouts pool their documents.
    assert select_silver_docs([0.9, 0.9, 0.9], steps, well_formed=[False, True, True]) == {"w1", "w2", "z"}


def test_rule2_through_the_trainer_uses_f1_times_format():
    group = [
        RefRollout([("alpha one", ("m1", "m2"))], "paris france", False, [1, 1]),  # F1 1 but malformed
        RefRollout([("beta two", ("w1", "x"))], "paris", True, [1, 1]),  # F1 2/3 < 0.7
        RefRollout([("gamma three", ("w1", "m1"))], "rome", True, [1, 1]),
    ]
    assert ref_silver(group) == set()  # an earlier version took {m1, m2} from the malformed rollout
    group[1].answer = "paris france"
    assert ref_silver(group) == {"w1", "x"}
    _assert_rows_close(library_token_advantages([group]), ref_token_advantages(group))


def test_rule3_repeats_are_judged_against_each_earlier_step_separately():
    steps = [
        SearchStep("who founded acme", ("s1", "x1")),
        SearchStep("where was she born", ("s2", "x2")),
        # Shares one doc with step 0 and one with step 1: two with their union, but never more than
        # one with a single earlier step, so it is not a repeat for the authors.
        SearchStep("what did the company make", ("x1", "x2", "s3")),
        # Shares two docs with step 2 alone: a repeat.
        SearchStep("list of company products", ("x1", "s3", "s4")),
    ]
    silver = {"s1", "s2", "s3", "s4"}
    assert step_scores(steps, silver, True) == pytest.approx([0.5, 0.5, 1 / 3, 0.0])
    rollout = RefRollout([(s.think, s.doc_ids) for s in steps], "paris", True, [1, 1, 1, 1, 1])
    assert ref_step_scores(rollout, silver) == pytest.approx([0.5, 0.5, 1 / 3, 0.0])


def test_rule3_think_repeat_empty_steps_and_malformed_rollouts():
    steps = [
        SearchStep("i need the founder of acme corp", ("s1",)),
        SearchStep("i need the founder of acme inc", ("s2",)),  # think similarity 6/7 > 0.5: repeat
        SearchStep("now the birthplace", ()),  # no documents: 0
        SearchStep("then the year", ("s1", "s3")),  # s1 was retrieved earlier: 1 new silver of 2
    ]
    assert step_scores(steps, {"s1", "s2", "s3"}, True) == pytest.approx([1.0, 0.0, 0.0, 0.5])
    assert step_scores(steps, {"s1", "s2", "s3"}, False) == [0.0, 0.0, 0.0, 0.0]


def test_rule4_and_5_soft_penalty_then_answer_rebalance_by_hand():
    # Rewards: 1.0 (well formed, answered right), 0.0 (well formed, wrong), 0.0 (malformed).
    group = [
        RefRollout([("find the city", ("s1", "x"))], "paris france", True, [2, 1]),
        RefRollout([("find the town", ("s1", "y")), ("where is it", ("z",))], "rome", True, [1, 1, 1]),
        RefRollout([("hmm", ("s1", "q"))], "paris france", False, [1, 1]),
    ]
    rows = ref_token_advantages(group)
    # mean 1/3, unbiased std sqrt(1/3): A = (2/sqrt(3), -1/sqrt(3), -1/sqrt(3)) up to the 1e-6 eps.
    std = (1 / 3) ** 0.5
    a_pos, a_neg = (2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)
    # Silver = {s1, x}: rollout 1's step 0 "find the town" vs nothing earlier: s = 1/2 (s1 silver, y not);
    # step 1: think similarity with "find the town" is 0, no shared docs, z not silver: s = 0.
    assert rows[1][:2] == pytest.approx([a_neg * 0.5, a_neg])
    # The malformed rollout keeps its full negative advantage on every step.
    assert rows[2][0] == pytest.approx(a_neg)
    # Answers: P = a_pos (one token), N = 2 |a_neg|: positives scaled by N / P -> a_pos becomes 2 |a_neg|.
    assert rows[0][2] == pytest.approx(2 * -a_neg)
    assert rows[1][2] == pytest.approx(a_neg) and rows[2][1] == pytest.approx(a_neg)
    # The positive rollout's intermediate tokens are untouched.
    assert rows[0][:2] == pytest.approx([a_pos, a_pos])
    _assert_rows_close(library_token_advantages([group]), rows)


def test_rule6_single_rollout_and_equal_rewards_give_exact_zeros():
    alone = [RefRollout([("a", ("d1",))], "paris france", True, [1, 2])]
    equal = [RefRollout([("a", ("d1",))], "rome", True, [1, 1]), RefRollout([], None, False, [2])]
    library = library_token_advantages([alone, equal])
    assert all(value == 0.0 for row in library for value in row)


# ---------------------------------------------------------------------------
# Random groups: the whole pipeline equals the reference
# ---------------------------------------------------------------------------


def _random_group(rng: random.Random) -> list[RefRollout]:
    thinks = ["find the city", "find the town", "where is it", "capital of france", "", "what river", "find city"]
    answers = [None, "", "paris", "paris france", "france", "rome", "the paris france"]
    docs = [f"d{i}" for i in range(7)]
    group = []
    for _ in range(rng.randint(1, 6)):
        steps = [(rng.choice(thinks), tuple(rng.sample(docs, rng.randint(0, 3)))) for _ in range(rng.randint(0, 3))]
        segment_tokens = [rng.randint(1, 3) for _ in range(len(steps) + 1)]
        group.append(RefRollout(steps, rng.choice(answers), rng.random() < 0.75, segment_tokens))
    return group


@pytest.mark.parametrize("seed", range(4))
def test_random_groups_match_the_reference(seed):
    rng = random.Random(seed)
    groups = [_random_group(rng) for _ in range(80)]
    library = library_token_advantages(groups)
    reference = [row for group in groups for row in ref_token_advantages(group)]
    _assert_rows_close(library, reference)
    # The random groups exercise every rule: silver sets, softened steps, repeats, malformed rollouts.
    assert sum(bool(ref_silver(g)) for g in groups) >= 10
    assert any(not r.well_formed for g in groups for r in g)
    assert any(0 < s < 1 for g in groups for r in g for s in ref_step_scores(r, ref_silver(g)))
