"""Per-step dense rewards of the search agent (issue 11, "Per-step dense rewards from both services").

Hand cases for the search-step scorers and the shipped rubric, the step reward blend,
both ways step rewards enter training (the trajectory reward, and step-level credit
with hand-computed token advantages), a short in-process training run of the tiny
search agent with a real judge logging the ``steps/*`` metrics, and a judge failure
that stops the run with RewardError.
"""

from __future__ import annotations

import asyncio
import math
import pathlib
import shutil

import pytest
import torch

from calibrl.errors import ConfigError, RewardError, Unavailable
from calibrl.judge_server import programmatic
from calibrl.api.judge import ItemScore, JudgeItem
from calibrl.api.retrieval import Hit, RetrievalScore
from calibrl.trainer.advantages import AdvantageInputs, compute_advantages
from calibrl.trainer.rewards import RewardConfig, RewardModel
from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
from calibrl.trainer.kinds.search.step_rewards import step_reward_metrics, step_retrieval_signal
from calibrl.trainer.tasks import Task
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)
from calibrl.trainer.kinds.search.reward import score_search

REPO = pathlib.Path(__file__).resolve().parent.parent
STEP_RUBRIC = REPO / "configs" / "rubrics" / "search-steps.yaml"
# Rewards are sums of a few products of numbers in [0, 1]: float64 rounding stays below 1e-12.
SUM_TOL = 1e-12
# Token advantages are computed in float64 and returned as float32 (relative rounding 2^-24 ~ 6e-8).
ADV_TOL = 1e-6

TASK = Task("t", "search", "Who discovered penicillin?", gold_doc_ids=("g",), answers=("Alexander Fleming",))


def _item(output: str, retrieved: tuple[str, ...] = (), earlier: tuple[str, ...] = (),
          query: str = "Who discovered penicillin in London?") -> JudgeItem:
    context = ((programmatic.EARLIER_QUERIES_KEY, "\n".join(earlier)),) if earlier else ()
    return JudgeItem(query=query, output=output, retrieved_texts=retrieved, context=context)


def _score(scorer: str, items: list[JudgeItem], **params) -> list[float]:
    spec = programmatic.SCORERS[scorer]
    return spec.fn(items, {**spec.defaults, **params}, programmatic.ScorerContext())


# --------------------------------------------------------------------------- scorers


def test_revealed_entity_rewards_naming_what_the_last_observation_revealed():
    passage = ("The mould was studied at St Mary's Hospital. Alexander Fleming noticed it in 1928.",)
    scores = _score("revealed_entity", [
        _item("Alexander Fleming biography", passage),  # names a revealed entity
        _item("penicillin discovery London", passage),  # ignores what the observation revealed
        _item("penicillin discovery", ("nothing new here about penicillin in London.",)),  # nothing revealed
        _item("penicillin discovery London"),  # first step: keeps the question's entity (London)
        _item("penicillin discovery"),  # first step: drops London
    ])
    assert scores == [1.0, 0.0, 1.0, 1.0, 0.0]
    two = _item("penicillin Paris", query="Who in Paris or London discovered penicillin?")
    assert _score("revealed_entity", [two]) == [0.5]  # keeps one of the question's two entities


def test_repeated_query_compares_with_each_earlier_query_of_the_trajectory():
    earlier = ("penicillin discovery", "Alexander Fleming birthplace")
    assert programmatic.query_similarity("Fleming birthplace Alexander", "Alexander Fleming birthplace") == 1.0
    assert programmatic.query_similarity("penicillin discoverer", "penicillin discovery") == pytest.approx(1 / 3)
    scores = _score("repeated_query", [
        _item("Alexander Fleming birthplace", earlier=earlier),  # the second earlier query again
        _item("Fleming Nobel prize year", earlier=earlier),
        _item("penicillin discovery"),  # no earlier query
    ])
    assert scores == [0.0, 1.0, 1.0]
    # 2 shared of 4 words = 0.5: a repeat at threshold 0.5, not at 0.7.
    pair = [_item("penicillin discovery year London", earlier=("penicillin discovery",))]
    assert _score("repeated_query", pair, threshold=0.5) == [0.0]
    assert _score("repeated_query", pair) == [1.0]
    assert "threshold" in programmatic.check_params("repeated_query", {"threshold": 0.0})
    assert programmatic.check_params("revealed_entity", {"x": 1}).startswith("unknown parameter 'x'")


def test_the_shipped_step_rubric_is_served_next_to_the_rewriter_rubric(tmp_path):
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.judge import Judge
    from tests.test_trainer_support import RUBRIC_YAML

    (tmp_path / "rewriter.yaml").write_text(RUBRIC_YAML)
    shutil.copy(STEP_RUBRIC, tmp_path / "search-steps.yaml")
    judge = Judge.from_config(JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0), tmp_path)
    passage = ("Alexander Fleming noticed the mould in 1928.",)
    good, repeat = judge.score("search-steps", [
        _item("Alexander Fleming mould discovery year", passage),
        _item("Alexander Fleming mould discovery year", passage, earlier=("Alexander Fleming mould discovery year",)),
    ])
    # revealed entity 1 (0.4), specificity 1 (5 content words >= 4, none vague; 0.3), not repeated (0.3).
    assert good.by_name() == {"names_revealed_entity": 1.0, "specific": 1.0, "not_repeated": 1.0}
    assert good.total == pytest.approx(1.0, abs=SUM_TOL)
    assert repeat.by_name()["not_repeated"] == 0.0 and repeat.total == pytest.approx(0.7, abs=SUM_TOL)
    assert judge.score("rewriter-test", [_item("Alexander Fleming penicillin")])[0].total > 0


# --------------------------------------------------------------------------- the blend


def _hit(doc_id: str, rank: int) -> Hit:
    return Hit(doc_id, doc_id, 1.0 / rank, rank, f"Passage {doc_id} mentions Fleming.")


def _result(doc_ids, gold_rank: int, new=None, answers=None) -> RetrievalScore:
    hits = tuple(_hit(d, r + 1) for r, d in enumerate(doc_ids))
    is_gold = tuple(d == "g" for d in doc_ids)
    return RetrievalScore(
        hits=hits, hit=gold_rank > 0, all_gold=gold_rank > 0, recall=float(gold_rank > 0),
        mrr=1.0 / gold_rank if gold_rank else 0.0, ndcg=0.0, first_gold_rank=gold_rank,
        is_new=tuple(new if new is not None else [True] * len(hits)),
        contains_answer=tuple(answers if answers is not None else [False] * len(hits)), is_gold=is_gold,
    )


def test_step_retrieval_signal_is_half_new_relevant_half_reciprocal_rank():
    assert step_retrieval_signal(_result(["x", "g"], 2), TASK) == (0.5 + 0.25, True)
    assert step_retrieval_signal(_result(["x", "g"], 2, new=[True, False]), TASK) == (0.25, False)
    assert step_retrieval_signal(_result(["x", "y"], 0), TASK) == (0.0, False)
    # No gold documents: silver ones, those that contain a gold answer.
    silver = Task("s", "search", "Who discovered penicillin?", answers=("Alexander Fleming",))
    assert step_retrieval_signal(_result(["x", "y", "z"], 0, answers=[False, False, True]), silver) == (
        0.5 + 0.5 / 3, True)


class RecordingJudge:
    """A judge client that returns fixed totals per rubric and keeps the items it saw (the
    interface is the point: what the reward sends and how it blends what comes back)."""

    def __init__(self, totals: dict[str, float], fail: str = "") -> None:
        self.totals, self.fail, self.calls = totals, fail, []

    async def score(self, rubric_id, items):
        self.calls.append((rubric_id, list(items)))
        if rubric_id == self.fail:
            raise Unavailable("judge replica down")
        return [ItemScore((), self.totals[rubric_id], rubric_id) for _ in items]


def _trajectory(queries_and_results, answer="Alexander Fleming", well_formed=True) -> SearchRollout:
    steps = tuple(SearchStepRecord(think="", query=q, result=r) for q, r in queries_and_results)
    return SearchRollout(TASK, steps, answer, well_formed)


def _score_search(config: RewardConfig, judge, rollouts):
    return asyncio.run(score_search(RewardModel(config, retrieval=None, judge=judge), rollouts))


def test_step_reward_blends_retrieval_and_rubric_and_enters_the_trajectory_reward():
    judge = RecordingJudge({"search-steps": 0.4})
    rollout = _trajectory([("penicillin discoverer", _result(["x", "y"], 0)),
                           ("penicillin discoverer", _result(["g", "x"], 1))])
    config = RewardConfig(w_rubric=0.0, w_steps=0.5, max_attempts=1)
    [breakdown] = _score_search(config, judge, [rollout])
    rewards = [s.reward for s in breakdown.steps]
    assert rewards == pytest.approx([0.7 * 0.0 + 0.3 * 0.4, 0.7 * 1.0 + 0.3 * 0.4], abs=SUM_TOL)
    assert [s.repeated for s in breakdown.steps] == [False, True]
    assert [s.found_new for s in breakdown.steps] == [False, True]
    # Trajectory reward: w_answer x F1 x format + w_steps x mean step reward.
    # ("retrieval" is the mean step recall, logged with weight search_w_retrieval = 0.)
    assert breakdown.components == pytest.approx({"answer": 1.0, "retrieval": 0.5, "steps": sum(rewards) / 2})
    assert breakdown.total == pytest.approx(1.0 + 0.5 * sum(rewards) / 2, abs=SUM_TOL)
    # The judge saw one item per step, built as documented; one call for the batch.
    [(rubric_id, items)] = judge.calls
    assert rubric_id == "search-steps"
    first, second = items
    assert (first.query, first.output, first.retrieved_texts, first.context) == (
        TASK.query, "penicillin discoverer", (), ())
    assert second.retrieved_texts == tuple(h.text for h in rollout.steps[0].result.hits)
    assert dict(second.context) == {"earlier_queries": "penicillin discoverer"}
    assert step_reward_metrics([breakdown]) == pytest.approx({
        "steps/reward/mean": sum(rewards) / 2, "steps/searches_per_trajectory": 2.0,
        "steps/repeated_share": 0.5, "steps/new_gold_share": 0.5})


def test_step_rewards_off_by_default_and_a_malformed_trajectory_keeps_its_step_rewards():
    rollout = _trajectory([("penicillin", _result(["g"], 1))], well_formed=False)
    [plain] = _score_search(RewardConfig(w_rubric=0.0), None, [rollout])
    assert plain.steps == () and not plain.steps_scored and "steps" not in plain.components
    assert step_reward_metrics([plain]) == {}
    judge = RecordingJudge({"search-steps": 1.0})
    [scored] = _score_search(RewardConfig(w_rubric=0.0, score_steps=True), judge, [rollout])
    assert scored.total == 0.0  # F1 x format; score_steps alone leaves the trajectory reward alone
    assert scored.steps[0].reward == pytest.approx(0.7 * 1.0 + 0.3 * 1.0, abs=SUM_TOL)
    [retrieval_only] = _score_search(RewardConfig(w_rubric=0.0, score_steps=True, step_w_rubric=0.0), None, [rollout])
    assert retrieval_only.steps[0].reward == pytest.approx(0.7, abs=SUM_TOL)


def test_step_reward_config_is_validated(trainer_world, tmp_path):
    with pytest.raises(ConfigError, match="step_w_retrieval and reward.step_w_rubric are both 0"):
        RewardConfig(w_rubric=0.0, w_steps=1.0, step_w_retrieval=0.0, step_w_rubric=0.0).validate()
    with pytest.raises(ConfigError, match="reward.w_steps=-1"):
        RewardConfig(w_rubric=0.0, w_steps=-1.0).validate()
    with pytest.raises(ConfigError, match="step_rubric_id is empty"):
        RewardConfig(w_rubric=0.0, w_steps=1.0, step_rubric_id=" ").validate()
    with pytest.raises(ConfigError, match="step_w_rubric=0.3 with step rewards on"):
        RewardModel(RewardConfig(w_rubric=0.0, w_steps=1.0), retrieval=None, judge=None)
    from calibrl.trainer.config import load_train_config

    with pytest.raises(ConfigError, match="advantage.step_credit=true needs multi-step tasks with step rewards"):
        load_train_config(None, trainer_world.overrides(
            tmp_path, f"tasks.path={trainer_world.search_tasks}", "advantage.type=grpo", "advantage.step_credit=true",
            judge=False))


def test_a_failing_step_judge_is_retried_then_raises_reward_error_never_zero():
    judge = RecordingJudge({"search-steps": 0.5}, fail="search-steps")
    config = RewardConfig(w_rubric=0.0, w_steps=1.0, max_attempts=2, retry_backoff_s=0.0)
    with pytest.raises(RewardError, match="failed after 2 attempts.*judge replica down"):
        _score_search(config, judge, [_trajectory([("penicillin", _result(["g"], 1))])])
    assert len(judge.calls) == 2


# --------------------------------------------------------------------------- step-level credit


def _layout(segments_per_row: list[list[int]], length: int):
    """completion_mask, segment_index, answer_mask of rows whose tokens belong to the given segments."""
    segment_index = torch.full((len(segments_per_row), length), -1, dtype=torch.long)
    for row, segments in enumerate(segments_per_row):
        segment_index[row, : len(segments)] = torch.tensor(segments)
    mask = segment_index >= 0
    last = segment_index.max(dim=1, keepdim=True).values
    return mask, segment_index, mask & (segment_index == last)


def test_step_credit_gives_each_step_its_advantage_against_the_groups_same_index_steps():
    # One group of three search trajectories: rows 0 and 1 searched twice (segments 0, 1) then answered
    # (segment 2); row 2 searched once (segment 0) and answered (segment 1). Two tokens per segment.
    mask, segment_index, answer = _layout([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2], [0, 0, 1, 1]], 6)
    rewards = torch.tensor([1.0, 0.0, 0.5])
    nan = float("nan")
    step_rewards = torch.tensor([[0.9, 0.8, nan], [0.3, 0.2, nan], [0.6, nan, nan]])
    inputs = AdvantageInputs(rewards, torch.zeros(3, dtype=torch.long), mask, segment_index, answer,
                             step_rewards=step_rewards)
    token_adv, metrics = compute_advantages("grpo", inputs, scale="none", step_credit=True)
    # Trajectory advantages (answer tokens): R - mean = 0.5, -0.5, 0.
    # Step 0 over all three rows: mean 0.6 -> 0.3, -0.3, 0.0; step 1 over rows 0, 1: mean 0.5 -> 0.3, -0.3.
    expected = torch.tensor([
        [0.3, 0.3, 0.3, 0.3, 0.5, 0.5],
        [-0.3, -0.3, -0.3, -0.3, -0.5, -0.5],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    assert torch.allclose(token_adv, expected, atol=ADV_TOL, rtol=0)
    assert metrics["advantage/frac_tokens_step_credit"] == pytest.approx(10 / 16)
    # scale="group": each same-index set divided by its own unbiased std (+ eps), the answer by the rewards'.
    scaled, _ = compute_advantages("grpo", inputs, scale="group", step_credit=True, eps=0.0)
    step0_std = torch.tensor([0.9, 0.3, 0.6]).std().item()
    step1_std = torch.tensor([0.8, 0.2]).std().item()
    assert scaled[0, 0].item() == pytest.approx(0.3 / step0_std, abs=ADV_TOL)
    assert scaled[1, 2].item() == pytest.approx(-0.3 / step1_std, abs=ADV_TOL)
    assert scaled[0, 4].item() == pytest.approx(0.5 / 0.5, abs=ADV_TOL)
    # Without step credit every token keeps the trajectory advantage.
    plain, _ = compute_advantages("grpo", inputs, scale="none")
    assert torch.allclose(plain, torch.tensor([0.5, -0.5, 0.0])[:, None] * mask, atol=ADV_TOL, rtol=0)


def _step_credit_reference(rewards, groups, step_rewards, segments, scale, eps):
    """Plain loops over rollouts, steps and tokens: the rule of docs/design.md, written apart
    from the vectorised estimator."""
    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):
        return math.sqrt(sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0

    known = [x for row in step_rewards for x in row if not math.isnan(x)]
    out = []
    for b, row in enumerate(segments):
        members = [i for i in range(len(rewards)) if groups[i] == groups[b]]
        group_rewards = [rewards[i] for i in members]
        trajectory = rewards[b] - mean(group_rewards)
        if scale == "group":
            trajectory /= std(group_rewards) + eps
        elif scale == "batch":
            trajectory /= std(rewards) + eps
        last = max(row) if row else -1
        tokens = []
        for segment in row:
            value = trajectory
            if segment < last and segment < len(step_rewards[b]) and not math.isnan(step_rewards[b][segment]):
                same = [step_rewards[i][segment] for i in members if not math.isnan(step_rewards[i][segment])]
                value = step_rewards[b][segment] - mean(same)
                if value != 0 and scale == "group":
                    value /= std(same) + eps
                elif value != 0 and scale == "batch":
                    value /= std(known) + eps
            tokens.append(value)
        out.append(tokens)
    return out


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_step_credit_matches_a_plain_loop_reference_on_random_groups(scale):
    rng = __import__("random").Random(11)
    for _ in range(60):
        num_groups, group_size, slots = rng.randint(1, 3), rng.randint(1, 4), 4
        rows = num_groups * group_size
        groups = [g for g in range(num_groups) for _ in range(group_size)]
        rewards = [rng.choice([0.0, 0.25, 1.0, rng.random()]) for _ in range(rows)]
        segments, step_rows = [], []
        for _ in range(rows):
            searches = rng.randint(0, slots - 1)
            segments.append([k for k in range(searches + 1) for _ in range(rng.randint(1, 3))])
            step_rows.append([rng.choice([0.1, 0.5, rng.random()]) if k < searches else math.nan for k in range(slots)])
        length = max(len(r) for r in segments)
        segment_index = torch.full((rows, length), -1, dtype=torch.long)
        for b, row in enumerate(segments):
            segment_index[b, : len(row)] = torch.tensor(row)
        mask = segment_index >= 0
        answer = mask & (segment_index == segment_index.max(dim=1, keepdim=True).values)
        inputs = AdvantageInputs(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), mask,
                                 segment_index, answer, step_rewards=torch.tensor(step_rows, dtype=torch.float64))
        token_adv, _ = compute_advantages("grpo", inputs, scale=scale, step_credit=True)
        expected = _step_credit_reference(rewards, groups, step_rows, segments, scale, 1e-4)
        for b, row in enumerate(expected):
            # float64 throughout; the two sum in different orders: error far below 1e-9.
            assert token_adv[b, : len(row)].tolist() == pytest.approx(row, abs=1e-9), (b, row)
            assert bool((token_adv[b, len(row):] == 0).all())


def test_step_credit_needs_step_rewards_and_calibadv_ignores_them():
    mask, segment_index, answer = _layout([[0, 1], [0, 1]], 2)
    inputs = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), mask, segment_index, answer)
    from calibrl.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="step_rewards"):
        compute_advantages("grpo", inputs, step_credit=True)
    with pytest.raises(InvalidArgument, match="step_rewards"):
        AdvantageInputs(inputs.rewards, inputs.group_index, mask, segment_index, answer,
                        step_rewards=torch.tensor([[math.inf], [0.0]]))
    scores = torch.tensor([[0.5], [0.0]])
    with_steps = AdvantageInputs(inputs.rewards, inputs.group_index, mask, segment_index, answer,
                                 step_scores=scores, step_rewards=torch.tensor([[0.9], [0.1]]))
    without = AdvantageInputs(inputs.rewards, inputs.group_index, mask, segment_index, answer, step_scores=scores)
    assert torch.equal(compute_advantages("calibadv", with_steps)[0], compute_advantages("calibadv", without)[0])


# --------------------------------------------------------------------------- training runs


def _judge_with_step_rubric(world: TrainerWorld, tmp_path: pathlib.Path):
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.judge import Judge
    from calibrl.trainer.inprocess import InProcessJudgeClient

    rubrics = tmp_path / "rubrics"
    shutil.copytree(world.rubric_dir, rubrics)
    shutil.copy(STEP_RUBRIC, rubrics / "search-steps.yaml")
    config = JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0)
    return InProcessJudgeClient(Judge.from_config(config, rubrics))


# What the searching policy was taught to emit after the prompt's ``<think>``, per question.
TAUGHT_QUERIES = {"Who discovered penicillin?": "penicillin", "In which city is the Eiffel Tower?": "Eiffel",
                  "Who wrote The Magic Flute?": "Flute", "Which organ makes insulin?": "insulin"}


@pytest.fixture(scope="module")
def searching_policy(trainer_world: TrainerWorld, tmp_path_factory) -> pathlib.Path:
    """The world's tiny random policy, taught by a short supervised fit (60 AdamW steps on
    four prompts) to answer each search prompt with ``</think><search> WORD </search>``,
    so its sampled rollouts really search (a random policy almost never closes a tag)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calibrl.trainer.kinds.search.rollout import search_prompt_ids

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(trainer_world.policy_dir)
    model = AutoModelForCausalLM.from_pretrained(trainer_world.policy_dir)
    rows = []
    for question, word in TAUGHT_QUERIES.items():
        prompt = search_prompt_ids(tokenizer, Task("x", "search", question))
        rows.append((prompt, tokenizer(f"</think><search> {word} </search>", add_special_tokens=False)["input_ids"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = torch.zeros(())
        for prompt, completion in rows:
            ids = torch.tensor([prompt + completion])
            labels = ids.clone()
            labels[0, : len(prompt)] = -100
            loss = loss + model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = tmp_path_factory.mktemp("searching-policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


SEARCH_RUN = ("rollout.prompts_per_step=2", "rollout.max_new_tokens=24", "rollout.max_turns=3",
              "rollout.max_obs_tokens=24", "steps=1", "reward.w_rubric=0", "reward.max_attempts=2",
              "reward.retry_backoff_s=0")


@pytest.mark.parametrize("way", ["trajectory_reward", "step_credit"])
def test_search_agent_trains_with_step_rewards_and_a_real_judge(trainer_world, searching_policy, tmp_path, way):
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.loop import train

    retrieval, _ = trainer_world.clients(judge=False)
    judge = _judge_with_step_rubric(trainer_world, tmp_path)
    extra = ["reward.w_steps=0.5"] if way == "trajectory_reward" else ["reward.score_steps=true",
                                                                        "advantage.type=grpo",
                                                                        "advantage.step_credit=true"]
    config = load_train_config(None, trainer_world.overrides(
        tmp_path / "run", f"tasks.path={trainer_world.search_tasks}", *SEARCH_RUN, *extra,
        f"policy.path={searching_policy}"))
    result = train(config, retrieval=retrieval, judge=judge)
    record = result.history[0]
    names = {"steps/reward/mean", "steps/searches_per_trajectory", "steps/repeated_share", "steps/new_gold_share"}
    assert names <= set(record)
    for name in names - {"steps/searches_per_trajectory"}:
        assert 0.0 <= record[name] <= 1.0, (name, record[name])
    # max_turns=3: at most 2 searches; the taught policy searches in most of its 8 rollouts.
    assert 0.5 <= record["steps/searches_per_trajectory"] <= 2.0
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
    assert record["steps/new_gold_share"] > 0  # the taught queries find their gold passages
    if way == "trajectory_reward":
        # reward = mean over rows of w_answer x F1 x format + w_steps x mean step reward (float32 totals:
        # rounding below 1e-6).
        assert record["rewards/steps/mean"] > 0
        assert record["reward"] == pytest.approx(record["rewards/answer/mean"] + 0.5 * record["rewards/steps/mean"],
                                                 abs=1e-6)
    else:
        assert 0.0 < record["advantage/frac_tokens_step_credit"] < 1.0  # search tokens credited, answers not


def test_a_judge_failure_during_a_step_rewarded_run_raises_reward_error(trainer_world, searching_policy, tmp_path):
    from calibrl.trainer.config import load_train_config
    from calibrl.trainer.loop import train

    class DownJudge:
        def __init__(self) -> None:
            self.calls = 0

        async def score(self, rubric_id, items):
            self.calls += 1
            raise Unavailable("judge replica down")

    retrieval, _ = trainer_world.clients(judge=False)
    judge = DownJudge()
    config = load_train_config(None, trainer_world.overrides(
        tmp_path / "run", f"tasks.path={trainer_world.search_tasks}", *SEARCH_RUN, "reward.w_steps=0.5",
        "rollout.max_turns=2", f"policy.path={searching_policy}"))
    with pytest.raises(RewardError, match="judge replica down"):
        train(config, retrieval=retrieval, judge=judge)
    # Two generation chunks (one task each), each tried reward.max_attempts=2 times; then the run stops.
    assert judge.calls == 4
