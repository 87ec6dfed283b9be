"""The blended reward over real cores (in-process clients) and real servers (gRPC clients)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from calibrl.config import load_config
from calibrl.errors import ConfigError, NotFound, RewardError, Unavailable
from calibrl.serving import ServingConfig
from calibrl.text import exact_match, token_f1
from calibrl.judge_server import server as judge_server
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric_dir
from calibrl.api.judge import JudgeItem
from calibrl.testing import start_test_server
from calibrl.api.retrieval import ScoreItem
from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
from calibrl.trainer.inprocess import InProcessJudgeClient, InProcessRetrievalClient
from tests.reward_fixtures import retriever, rubric_dir, tiny_index  # noqa: F401 (fixtures)
from calibrl.trainer.rewards import RewardConfig, RewardModel
from calibrl.trainer.kinds.rewrite import RewriteRollout
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.tasks import Task
from calibrl.trainer.kinds.rewrite import score_rewrites
from calibrl.trainer.kinds.search.reward import score_search

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

TASKS = [
    Task("t-eiffel", "rewrite", "Which iron tower was finished in Paris in 1889?", ("eiffel",), ("Eiffel Tower",),
         (("domain", "travel"),)),
    Task("t-flute", "rewrite", "Who composed The Magic Flute?", ("mozart",), ("Mozart",)),
    Task("t-leaf", "rewrite", "Why are plant leaves green?", ("chlorophyll", "photosynthesis")),
]
REWRITES = [
    (0, "Eiffel Tower wrought-iron lattice tower Paris 1889"),
    (0, "food"),
    (1, "composer of the opera The Magic Flute"),
    (1, "Rust memory safety"),
    (2, "green pigment chlorophyll in plant leaves absorbs light"),
    (2, "mountain"),
]


def _rollouts():
    return [RewriteRollout(TASKS[t], text) for t, text in REWRITES]


@pytest.fixture(scope="module")
def judge(rubric_dir):
    return Judge(load_rubric_dir(rubric_dir), JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams",
                                                          cache_size=0))


class Recording:
    """Wraps a real client: records each call's interval and can fail the first calls (fault injection
    is the point of these tests; the scores still come from the real core)."""

    def __init__(self, inner, fail_first=0, error=None, delay=0.0, corrupt=None):
        self.inner = inner
        self.fail_first = fail_first
        self.error = error or Unavailable("injected: replica restarting")
        self.delay = delay
        self.corrupt = corrupt
        self.calls: list[tuple[float, float, list]] = []

    async def _run(self, method, *args):
        start = time.perf_counter()
        await asyncio.sleep(self.delay)
        try:
            if len(self.calls) < self.fail_first:
                raise self.error
            result = await getattr(self.inner, method)(*args)
            return self.corrupt(result) if self.corrupt else result
        finally:
            self.calls.append((start, time.perf_counter(), list(args)))

    async def score(self, *args):
        return await self._run("score", *args)


def _model(retriever, judge, **overrides):
    config = RewardConfig(rubric_id="rewrite-test", retry_backoff_s=0.0, **overrides)
    return RewardModel(config, InProcessRetrievalClient(retriever), InProcessJudgeClient(judge) if judge else None)


async def test_rewrite_reward_is_the_documented_blend(retriever, judge):
    results = await score_rewrites(_model(retriever, judge), _rollouts())
    expected_retrieval = retriever.score([ScoreItem(text, TASKS[t].gold_doc_ids, TASKS[t].answers)
                                          for t, text in REWRITES], 5)
    expected_rubric = judge.score("rewrite-test", [JudgeItem(TASKS[t].query, text, context=TASKS[t].context)
                                                   for t, text in REWRITES])
    for result, ret, rub in zip(results, expected_retrieval, expected_rubric):
        assert result.components == {"retrieval": ret.recall, "rubric": pytest.approx(rub.total)}
        assert result.total == pytest.approx(0.7 * ret.recall + 0.3 * rub.total)
        assert result.retrieval.doc_ids == ret.doc_ids and result.rubric.total == pytest.approx(rub.total)
    totals = [r.total for r in results]
    # the good rewrite of each task beats the bad one, and the rewards are dense (not all 0 or 1)
    assert totals[0] > totals[1] and totals[2] > totals[3] and totals[4] > totals[5]
    assert len({round(t, 6) for t in totals}) >= 4
    assert await score_rewrites(_model(retriever, judge), []) == []


@pytest.mark.parametrize("signal", ["hit", "recall", "mrr", "ndcg"])
async def test_retrieval_signal_choice(retriever, judge, signal):
    results = await score_rewrites(_model(retriever, judge, retrieval_signal=signal, top_k=2), _rollouts())
    expected = retriever.score([ScoreItem(text, TASKS[t].gold_doc_ids) for t, text in REWRITES], 2)
    for result, ret in zip(results, expected):
        value = float(ret.hit) if signal == "hit" else getattr(ret, signal)
        assert result.components["retrieval"] == pytest.approx(value)


async def test_binary_only_is_hit_at_k_without_a_judge(retriever):
    model = _model(retriever, None, binary_only=True, w_rubric=0.3, top_k=1)
    results = await score_rewrites(model, _rollouts())
    expected = retriever.score([ScoreItem(text, TASKS[t].gold_doc_ids) for t, text in REWRITES], 1)
    assert [r.total for r in results] == [float(e.hit) for e in expected]
    assert all(r.components.keys() == {"retrieval"} and r.rubric is None for r in results)
    assert {r.total for r in results} == {0.0, 1.0}


async def test_retrieval_and_judge_calls_run_concurrently(retriever, judge):
    retrieval = Recording(InProcessRetrievalClient(retriever), delay=0.3)
    judging = Recording(InProcessJudgeClient(judge), delay=0.3)
    model = RewardModel(RewardConfig(rubric_id="rewrite-test"), retrieval, judging)
    await score_rewrites(model, _rollouts())
    ((r_start, r_end, r_args),), ((j_start, j_end, j_args),) = retrieval.calls, judging.calls
    assert r_start < j_end and j_start < r_end, "the two calls did not overlap"
    assert len(r_args[0]) == len(REWRITES) and len(j_args[1]) == len(REWRITES)  # one call each for the batch
    assert j_args[1][0].context == (("domain", "travel"),) and j_args[1][0].retrieved_texts == ()


async def test_rubric_can_see_the_retrieved_passages(retriever, judge):
    retrieval = Recording(InProcessRetrievalClient(retriever))
    judging = Recording(InProcessJudgeClient(judge))
    model = RewardModel(RewardConfig(rubric_id="rewrite-test", rubric_sees_retrieval=True, top_k=3),
                        retrieval, judging)
    results = await score_rewrites(model, _rollouts())
    ((_, r_end, _),), ((j_start, _, j_args),) = retrieval.calls, judging.calls
    assert j_start >= r_end
    first = j_args[1][0]
    assert first.retrieved_doc_ids == tuple(results[0].retrieval.doc_ids)
    assert first.retrieved_texts[0].startswith("The Eiffel Tower")


async def test_empty_rewrites_score_zero_and_long_ones_are_cut(retriever, judge):
    retrieval = Recording(InProcessRetrievalClient(retriever))
    model = RewardModel(RewardConfig(rubric_id="rewrite-test", max_output_chars=60), retrieval,
                        InProcessJudgeClient(judge))
    rollouts = [RewriteRollout(TASKS[0], "   "), RewriteRollout(TASKS[1], "Magic Flute composer " + "la " * 500)]
    empty, long = await score_rewrites(model, rollouts)
    assert empty.total == 0.0 and empty.components == {"retrieval": 0.0, "rubric": 0.0} and empty.retrieval is None
    ((_, _, args),) = retrieval.calls
    assert [item.query for item in args[0]] == ["Magic Flute composer " + ("la " * 500)[:39].strip()]
    assert long.components["retrieval"] == 1.0


async def test_transient_failures_retry_the_whole_batch(retriever, judge):
    retrieval = Recording(InProcessRetrievalClient(retriever), fail_first=1)
    judging = Recording(InProcessJudgeClient(judge))
    model = RewardModel(RewardConfig(rubric_id="rewrite-test", retry_backoff_s=0.0), retrieval, judging)
    results = await score_rewrites(model, _rollouts())
    assert len(retrieval.calls) == 2 and len(judging.calls) == 2  # both services called again, for the batch
    assert results == await score_rewrites(_model(retriever, judge), _rollouts())


@pytest.mark.parametrize(
    "wrap, match, calls",
    [
        (dict(fail_first=99), "failed after 3 attempts; last error: Unavailable: injected", 3),
        (dict(fail_first=99, error=NotFound("rubric 'x' not found")), "cannot be computed: NotFound", 1),
        (dict(corrupt=lambda scores: scores[:-1]), "judge returned 5 scores for 6 items", 3),
        (dict(corrupt=lambda scores: [type(s)(s.criteria, math.nan) for s in scores]), "rubric total nan", 3),
    ],
)
async def test_a_reward_that_cannot_be_computed_raises_never_zero(retriever, judge, wrap, match, calls):
    judging = Recording(InProcessJudgeClient(judge), **wrap)
    model = RewardModel(RewardConfig(rubric_id="rewrite-test", retry_backoff_s=0.0), InProcessRetrievalClient(retriever),
                        judging)
    with pytest.raises(RewardError, match=match) as info:
        await score_rewrites(model, _rollouts())
    assert len(judging.calls) == calls
    assert info.value.__cause__ is not None


async def test_nan_retrieval_signal_raises(retriever, judge):
    from dataclasses import replace

    retrieval = Recording(InProcessRetrievalClient(retriever), corrupt=lambda s: [replace(x, ndcg=math.inf) for x in s])
    model = RewardModel(RewardConfig(rubric_id="rewrite-test", retry_backoff_s=0.0, max_attempts=2), retrieval,
                        InProcessJudgeClient(judge))
    with pytest.raises(RewardError, match="ndcg=inf"):
        await score_rewrites(model, _rollouts())
    assert len(retrieval.calls) == 2


async def _search_rollouts(retriever):
    task = Task("s1", "search", "Who composed The Magic Flute?", ("mozart",), ("Wolfgang Amadeus Mozart",))

    def steps(*queries):
        seen: list[str] = []
        records = []
        for query in queries:
            (result,) = retriever.score([ScoreItem(query, task.gold_doc_ids, task.answers, tuple(seen))], 3,
                                        include_text=True)
            seen.extend(result.doc_ids)
            records.append(SearchStepRecord("thinking", query, result))
        return tuple(records)

    return task, [
        SearchRollout(task, steps("Magic Flute opera composer"), "Mozart", True),
        SearchRollout(task, steps("Bach Brandenburg", "Magic Flute"), "Wolfgang Amadeus Mozart", True),
        SearchRollout(task, steps("Eiffel Tower"), "Gustave Eiffel", True),
        SearchRollout(task, (), None, False),
    ]


async def test_search_reward_defaults_to_answer_f1(retriever):
    task, rollouts = await _search_rollouts(retriever)
    model = RewardModel(RewardConfig(w_rubric=0.0), InProcessRetrievalClient(retriever), None)
    results = await score_search(model, rollouts)
    expected = [token_f1(r.answer, task.answers) if r.answer else 0.0 for r in rollouts]
    assert [r.total for r in results] == pytest.approx(expected)
    assert expected[0] == pytest.approx(0.5) and expected[1] == 1.0 and expected[3] == 0.0
    assert all(r.components.keys() == {"answer", "retrieval"} for r in results)
    assert results[1].components["retrieval"] == pytest.approx(
        (rollouts[1].steps[0].result.recall + rollouts[1].steps[1].result.recall) / 2)
    assert results[3].components["retrieval"] == 0.0


async def test_search_reward_blend_and_binary(retriever, judge):
    task, rollouts = await _search_rollouts(retriever)
    judging = Recording(InProcessJudgeClient(judge))
    config = RewardConfig(rubric_id="rewrite-test", w_answer=0.5, search_w_retrieval=0.3, search_w_rubric=0.2,
                          answer_metric="em", retrieval_signal="mrr")
    results = await score_search(RewardModel(config, InProcessRetrievalClient(retriever), judging), rollouts)
    ((_, _, args),) = judging.calls
    assert [item.output for item in args[1]] == ["Mozart", "Wolfgang Amadeus Mozart", "Gustave Eiffel"]
    assert args[1][1].retrieved_doc_ids[0] == rollouts[1].steps[0].result.doc_ids[0]
    for rollout, result in zip(rollouts, results):
        em = exact_match(rollout.answer, task.answers) if rollout.answer else 0.0
        mrr = [s.result.mrr for s in rollout.steps]
        rubric = result.rubric.total if result.rubric else 0.0
        assert result.total == pytest.approx(0.5 * em + 0.3 * (sum(mrr) / len(mrr) if mrr else 0.0) + 0.2 * rubric)
    assert results[3].rubric is None and results[0].rubric is not None

    binary = await score_search(RewardModel(RewardConfig(binary_only=True), InProcessRetrievalClient(retriever), None
                               ), rollouts)
    assert [r.total for r in binary] == [0.0, 1.0, 0.0, 0.0]


def test_config_is_checked_with_actionable_messages(tmp_path):
    with pytest.raises(ConfigError, match="reward.rubric_id is empty but reward.w_rubric=0.3"):
        RewardConfig().validate()
    with pytest.raises(ConfigError, match="w_retrieval=-0.1: must be a finite number >= 0"):
        RewardConfig(rubric_id="r", w_retrieval=-0.1).validate()
    with pytest.raises(ConfigError, match="both 0"):
        RewardConfig(w_retrieval=0, w_rubric=0).validate()
    with pytest.raises(ConfigError, match="top_k=0"):
        RewardConfig(rubric_id="r", top_k=0).validate()
    with pytest.raises(ConfigError, match="need a judge client"):
        RewardModel(RewardConfig(rubric_id="r"), object(), None)
    RewardConfig(binary_only=True).validate()  # the ablation needs no rubric

    path = tmp_path / "reward.yaml"
    path.write_text("w_retrieval: 0.6\nw_rubric: 0.4\nrubric_id: rewrite-test\nmode: bm25\n")
    config = load_config(RewardConfig, path, ["retrieval_signal=ndcg", "top_k=3"])
    assert (config.w_retrieval, config.mode, config.retrieval_signal, config.top_k) == (0.6, "bm25", "ndcg", 3)
    with pytest.raises(ConfigError, match="not one of"):
        load_config(RewardConfig, path, ["retrieval_signal=precision"])


async def test_over_grpc_same_rewards_and_a_dead_judge_raises(tiny_index, retriever, judge, rubric_dir):
    retrieval_running = await start_test_server(tiny_index, retriever=retriever)
    judge_running = await judge_server.start(
        JudgeServerConfig(rubrics=str(rubric_dir), judge=judge.config, serving=ServingConfig(port=0)), judge=judge)
    retrieval = GrpcRetrievalClient(retrieval_running.address)
    judging = GrpcJudgeClient(f"127.0.0.1:{judge_running.port}", max_attempts=2, backoff_initial_s=0.01,
                              backoff_max_s=0.02)
    try:
        config = RewardConfig(rubric_id="rewrite-test", retry_backoff_s=0.0, max_attempts=2)
        remote = await score_rewrites(RewardModel(config, retrieval, judging), _rollouts())
        local = await score_rewrites(_model(retriever, judge), _rollouts())
        assert [r.total for r in remote] == pytest.approx([r.total for r in local])
        assert [r.retrieval.doc_ids for r in remote] == [r.retrieval.doc_ids for r in local]

        await judge_running.stop(grace=0.5)
        with pytest.raises(RewardError, match="after 2 attempts.*Unavailable"):
            await score_rewrites(RewardModel(config, retrieval, judging), _rollouts())
    finally:
        await retrieval.close()
        await judging.close()
        await retrieval_running.stop(grace=1.0)
        await judge_running.stop(grace=0.5)
