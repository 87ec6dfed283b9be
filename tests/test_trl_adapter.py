"""TRL interop: calibrl's rewards as GRPOTrainer reward functions.

The reward functions are checked against RewardModel directly (in-process cores),
then a real trl.GRPOTrainer on a tiny random Llama built here takes a training
step against the real retrieval and judge servers on loopback (the runnable
example's main), and a reward failure stops training instead of scoring zeros.
"""

from __future__ import annotations

import importlib.util
import pathlib
import socket

import pytest

from calibrl.errors import InvalidArgument, RewardError, Unavailable
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric_dir
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import build_test_index
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.inprocess import InProcessJudgeClient, InProcessRetrievalClient
from calibrl.trainer.rewards import RewardConfig, RewardModel
from calibrl.trainer.kinds.rewrite import RewriteRollout, score_rewrites
from calibrl.trainer.tasks import Task
from calibrl.trainer.trl_adapter import (
    BLENDED_NAME,
    completion_text,
    make_reward_funcs,
    reward_funcs_for,
    rewrite_from_completion,
    tasks_to_dataset,
)

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "trl_reward_funcs.py"


def _example():
    spec = importlib.util.spec_from_file_location("trl_reward_funcs_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()

TASKS = [Task(task_id, "rewrite", query, gold) for task_id, query, gold in example.TASKS]
COMPLETIONS = [
    " Eiffel Tower iron lattice Paris 1889\nsome trailing text",
    "\n\n   nothing useful",
    " Magic Flute opera composer",
    "",
]


class Counting:
    """Counts calls to a real client; can make them fail (the point of the failure test)."""

    def __init__(self, inner, error=None):
        self.inner, self.error, self.calls = inner, error, 0

    async def score(self, *args):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return await self.inner.score(*args)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Index, rubric and tiny policy, built once for the module (as the example builds them)."""
    folder = tmp_path_factory.mktemp("trl")
    build_test_index(folder / "index")
    (folder / "rubrics").mkdir()
    (folder / "rubrics" / f"{example.RUBRIC_ID}.yaml").write_text(example.RUBRIC_YAML)
    return folder


@pytest.fixture(scope="module")
def cores(workdir):
    retriever = Retriever.load(workdir / "index", device="cpu")
    judge = Judge(load_rubric_dir(workdir / "rubrics"), JudgeConfig(allow_unvalidated=True,
                                                                     embedder="hashed-ngrams", cache_size=0))
    return retriever, judge


def _columns(tasks):
    rows = tasks_to_dataset(tasks, as_hf_dataset=False)
    return {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}, [row["prompt"] for row in rows]


def test_completion_parsing_and_dataset_rows():
    assert completion_text("plain") == "plain"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Eiffel "}, {"type": "image"}, {"type": "text", "text": "Tower"}]}]
    assert completion_text(conversation) == "Eiffel Tower"
    assert rewrite_from_completion("\n  \n first line \n second") == "first line"
    assert rewrite_from_completion("   ") == ""
    with pytest.raises(InvalidArgument, match="completions"):
        completion_text(3)

    task = Task("t1", "rewrite", "Who wrote Dune?", ("dune",), ("Frank Herbert",), (("domain", "books"),))
    (row,) = tasks_to_dataset([task], as_hf_dataset=False)
    assert row["prompt"].endswith("Question: Who wrote Dune?\nSearch query:") and "domain: books" in row["prompt"]
    assert (row["query"], row["gold_doc_ids"], row["context"]) == ("Who wrote Dune?", ["dune"], '{"domain": "books"}')
    assert tasks_to_dataset([task], "Q: {query} ->")[0]["prompt"] == "Q: Who wrote Dune? ->"
    with pytest.raises(InvalidArgument, match="rewrite tasks only"):
        tasks_to_dataset([Task("s", "search", "q", answers=("a",))])


def test_component_functions_equal_the_reward_model_and_score_each_batch_once(cores):
    retriever, judge = cores
    retrieval = Counting(InProcessRetrievalClient(retriever))
    judging = Counting(InProcessJudgeClient(judge))
    config = RewardConfig(rubric_id=example.RUBRIC_ID)
    columns, prompts = _columns(TASKS)
    reference = RewardModel(config, InProcessRetrievalClient(retriever), InProcessJudgeClient(judge))
    with BackgroundLoop() as loop:
        expected = loop.run(score_rewrites(reference, 
            [RewriteRollout(t, rewrite_from_completion(c)) for t, c in zip(TASKS, COMPLETIONS)]))

    with reward_funcs_for(RewardModel(config, retrieval, judging)) as funcs:
        assert funcs.names == ["retrieval", "rubric"] and funcs.weights == [0.7, 0.3]
        assert [f.__name__ for f in funcs] == ["retrieval", "rubric"]
        kwargs = dict(completion_ids=[[1]] * 4, trainer_state=None, log_extra=None, log_metric=None, **columns)
        per_component = [f(prompts=prompts, completions=COMPLETIONS, **kwargs) for f in funcs]
        assert retrieval.calls == 1 and judging.calls == 1  # one scoring of the batch for both components
        assert per_component[0] == [r.components["retrieval"] for r in expected]
        assert per_component[1] == pytest.approx([r.components["rubric"] for r in expected])
        blended = [0.7 * a + 0.3 * b for a, b in zip(*per_component)]
        assert blended == pytest.approx([r.total for r in expected])
        assert per_component[0][0] == 1.0 and per_component[0][3] == 0.0  # "" is an empty rewrite: scored 0

        # the next batch is scored again, even with identical texts
        funcs[0](prompts=prompts, completions=COMPLETIONS, **kwargs)
        assert retrieval.calls == 2 and funcs.scorer.batches_scored == 2

        # conversational completions give the same rewards
        conversation = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
        assert funcs[1](prompts=prompts, completions=conversation, **kwargs) == per_component[1]

    with reward_funcs_for(RewardModel(config, retrieval, judging), blended=True) as single:
        assert single.names == [BLENDED_NAME] and single.weights == [1.0]
        assert single[0](prompts=prompts, completions=COMPLETIONS, **columns) == pytest.approx(
            [r.total for r in expected])

    with reward_funcs_for(RewardModel(config, retrieval, judging)) as funcs:
        with pytest.raises(InvalidArgument, match="gold_doc_ids: missing from the reward function's dataset"):
            funcs[0](prompts=prompts, completions=COMPLETIONS, query=columns["query"])


def test_a_failing_service_raises_instead_of_returning_zeros(cores):
    retriever, judge = cores
    judging = Counting(InProcessJudgeClient(judge), error=Unavailable("judge replica draining"))
    config = RewardConfig(rubric_id=example.RUBRIC_ID, max_attempts=2, retry_backoff_s=0.0)
    columns, prompts = _columns(TASKS)
    with reward_funcs_for(RewardModel(config, InProcessRetrievalClient(retriever), judging)) as funcs:
        with pytest.raises(RewardError, match="after 2 attempts.*judge replica draining"):
            funcs[0](prompts=prompts, completions=COMPLETIONS, **columns)
        assert judging.calls == 2


def test_grpo_trainer_step_on_the_real_services(workdir, capsys):
    """The README's example: a real GRPOTrainer step, rewards from both services on loopback."""
    history = example.main(["--steps", "1", "--out-dir", str(workdir)])
    (row,) = history
    # TRL logs float32 means of the blended and of each component over the batch: three float32 sums of
    # <= 8 values in [0, 1] (float32_sum_error(8, 8) ~ 7e-6 each, one of them scaled by 0.7): abs 1e-5.
    assert row["reward"] == pytest.approx(0.7 * row["rewards/retrieval/mean"] + 0.3 * row["rewards/rubric/mean"],
                                          abs=1e-5)
    assert 0.0 < row["rewards/rubric/mean"] <= 1.0 and 0.0 <= row["rewards/retrieval/mean"] <= 1.0
    assert row["grad_norm"] > 0  # an update happened
    assert "step 1: reward" in capsys.readouterr().out


def test_grpo_trainer_stops_when_rewards_cannot_be_computed(workdir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    services = example.LocalServices(workdir)
    try:
        config = RewardConfig(rubric_id=example.RUBRIC_ID, max_attempts=1)
        with make_reward_funcs(services.retrieval_target, f"127.0.0.1:{dead_port}", config, max_attempts=2,
                               backoff_initial_s=0.01, backoff_max_s=0.02) as funcs:
            trainer = example.build_trainer(example.build_tiny_policy(workdir), funcs, tasks_to_dataset(TASKS),
                                            workdir, steps=1)
            with pytest.raises(RewardError, match="UNAVAILABLE after 2 attempts"):
                trainer.train()
            assert trainer.state.global_step == 0  # nothing was trained on
            assert not any("reward" in row for row in trainer.state.log_history)
    finally:
        services.close()
