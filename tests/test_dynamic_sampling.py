"""DAPO dynamic sampling: the group filter on hand-made rewards, its config checks, and
real training runs with it on the tiny world of tests/test_trainer_support.py (random
Llama policy, real MiniLM/FAISS/BM25 index, binary hit@1 reward: a random rewrite
rarely ranks the gold passage first, so most groups score all 0 and a few do not)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from calibrl.errors import ConfigError, RewardError
from calibrl.trainer.checkpoint import find_checkpoint, load_train_state
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.dynamic_sampling import ZERO_STD_ATOL, rewards_all_equal, select_groups, select_rows
from calibrl.trainer.loop import train
from tests.test_trainer_loop import FlakyRetrieval, _weights
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)

# ------------------------------------------------------------------ the group filter


def test_all_equal_is_the_zero_std_rule_of_the_advantage_metrics():
    from calibrl.trainer import advantages

    assert ZERO_STD_ATOL == advantages.ZERO_STD_ATOL
    assert rewards_all_equal([0.0, 0.0, 0.0]) and rewards_all_equal([0.7]) and rewards_all_equal([])
    assert not rewards_all_equal([0.0, 0.0, 1.0])
    assert not rewards_all_equal([0.5, 0.5 + 1e-6])  # std 7e-7: a real (small) signal
    assert rewards_all_equal([0.5, 0.5 + 1e-9])  # std 7e-10 <= 1e-8: frac_reward_zero_std counts it as zero


def test_filter_keeps_varied_groups_in_sampling_order_up_to_the_batch_size():
    groups = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 1], [0.3, 0.7, 0.3, 0.3]]
    selection = select_groups(groups, wanted=2)
    assert selection.kept == (1, 3) and selection.filled == () and selection.groups == (1, 3)
    # Exactly enough varied groups: all of them, nothing filled; the third varied one is dropped at wanted=3.
    assert select_groups(groups, wanted=4).kept == (1, 3, 4, 5)
    assert select_groups(groups, wanted=3).kept == (1, 3, 4)


def test_filter_fills_with_all_equal_groups_when_the_bound_is_reached():
    groups = [[0, 0, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    selection = select_groups(groups, wanted=3)
    assert selection.kept == (1,) and selection.filled == (0, 2) and selection.groups == (0, 1, 2)
    # Nothing varied at all: the batch is the first groups as sampled.
    none_varied = select_groups([[0, 0], [0, 0], [1, 1]], wanted=2)
    assert none_varied.kept == () and none_varied.filled == (0, 1)
    with pytest.raises(ValueError, match="wanted=0"):
        select_groups(groups, wanted=0)


def test_select_rows_keeps_every_field_of_the_chosen_rows():
    from calibrl.trainer.rollout import RolloutBatch, assemble_rows

    rows = [[([1, 2], False), ([3, 4], True)], [([1], False), ([5, 6, 7], True)], [([1, 2, 3], False), ([8], True)]]
    batch = RolloutBatch(**assemble_rows(rows, 0), group_index=torch.tensor([0, 0, 1]),
                         completion_texts=["a", "b", "c"], rollouts=["ra", "rb", "rc"], prompt_lengths=[2, 1, 3])
    picked = select_rows(batch, [2, 0])
    assert picked.completion_texts == ["c", "a"] and picked.rollouts == ["rc", "ra"]
    assert picked.prompt_lengths == [3, 2] and picked.group_index.tolist() == [1, 0]
    for name in ("input_ids", "attention_mask", "completion_mask", "segment_index", "answer_mask"):
        assert torch.equal(getattr(picked, name), getattr(batch, name)[[2, 0]]), name


# ------------------------------------------------------------------ config


def test_config_rejects_a_zero_round_bound_and_the_off_policy_combination(trainer_world, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.max_sampling_rounds=0: must be >= 1"):
        load_train_config(None, trainer_world.overrides(tmp_path, "rollout.max_sampling_rounds=0"))
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling=true with rollout.off_policy_steps=1.*"
                                          r"set rollout.off_policy_steps=0 or rollout.dynamic_sampling=false"):
        load_train_config(None, trainer_world.overrides(
            tmp_path, "rollout.dynamic_sampling=true", "rollout.off_policy_steps=1"))
    config = load_train_config(None, trainer_world.overrides(tmp_path, "rollout.dynamic_sampling=true"))
    assert config.rollout.dynamic_sampling and config.rollout.max_sampling_rounds == 4


# ------------------------------------------------------------------ training with it

GROUPS, GROUP_SIZE = 4, 4
DYNAMIC = ("rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3", "reward.binary_only=true",
           "reward.top_k=1",
           "steps=3", "checkpoint_every=0", "optimizer.schedule=cosine", "optimizer.warmup_steps=1",
           "gradient_accumulation_steps=2")


@pytest.fixture(scope="module")
def dynamic_run(trainer_world: TrainerWorld, tmp_path_factory):
    """Three uninterrupted steps with dynamic sampling on the binary reward."""
    out = tmp_path_factory.mktemp("dynamic")
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(out, *DYNAMIC, judge=False))
    return out, train(config, retrieval=retrieval, judge=None)


def test_dynamic_sampling_trains_one_full_batch_per_step_and_logs_the_filter(dynamic_run):
    out, result = dynamic_run
    assert result.stopped == "completed" and result.steps_done == 3
    records = read_log(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    rounds_seen = set()
    for record in records:
        rounds, kept = record["sampling/rounds"], record["sampling/kept_groups"]
        filled = record["sampling/filled_groups"]
        rounds_seen.add(rounds)
        assert 1 <= rounds <= 3
        # Every step trains exactly prompts_per_step groups: the varied ones kept plus the filling ones.
        assert kept + filled == GROUPS
        # Filling happens only when the bound was reached.
        assert filled == 0 or rounds == 3
        # Extra rollouts: everything sampled beyond the one batch trained on.
        assert record["sampling/extra_rollouts"] == (rounds - 1) * GROUPS * GROUP_SIZE
        # The trained batch holds the kept groups (rewards differ) and the filling ones (all equal): the
        # estimator's own count of all-equal groups must agree with the filter's.
        assert record["frac_reward_zero_std"] == filled / GROUPS
        assert record["grad_norm"] > 0 or kept == 0
    # The random policy leaves most groups of the binary reward all 0: the filter sampled again, up to
    # its bound, and still found groups with a signal.
    assert max(rounds_seen) == 3
    assert sum(r["sampling/kept_groups"] for r in records) > 0


def test_a_bound_of_one_round_trains_on_the_batch_as_sampled(trainer_world, tmp_path):
    """With max_sampling_rounds=1 the bound is reached at once: the kept and the filling
    groups are the whole first round, in sampling order, so the step is the one
    dynamic_sampling=false trains (same rollouts, same update)."""
    retrieval, _ = trainer_world.clients(judge=False)
    common = ("reward.binary_only=true", "reward.top_k=1", "steps=1", "max_grad_norm=0")
    plain = train(load_train_config(None, trainer_world.overrides(tmp_path / "plain", *common, judge=False)),
                  retrieval=retrieval, judge=None)
    bounded = train(load_train_config(None, trainer_world.overrides(
        tmp_path / "bounded", *common, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=1",
        judge=False)), retrieval=retrieval, judge=None)
    a, b = plain.history[0], bounded.history[0]
    assert (b["sampling/rounds"], b["sampling/extra_rollouts"]) == (1.0, 0.0)
    assert b["sampling/kept_groups"] + b["sampling/filled_groups"] == GROUPS
    assert b["frac_reward_zero_std"] == a["frac_reward_zero_std"] == b["sampling/filled_groups"] / GROUPS
    for name in ("reward", "loss", "grad_norm", "kl"):
        assert a[name] == b[name], name
    final_a, final_b = _weights(plain.last_checkpoint / "model"), _weights(bounded.last_checkpoint / "model")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_dynamic_sampling_resumes_bitwise_after_sigterm(trainer_world, dynamic_run, tmp_path):
    straight_out, _ = dynamic_run
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(tmp_path, *DYNAMIC, judge=False))

    def preempt(step, metrics):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(config, retrieval=retrieval, judge=None, on_step=preempt)
    assert first.stopped == "sigterm" and first.steps_done == 1
    second = train(config, retrieval=retrieval, judge=None, resume=tmp_path)
    assert second.steps_done == 3 and len(second.history) == 2
    straight, resumed = read_log(straight_out / "metrics.jsonl"), read_log(tmp_path / "metrics.jsonl")
    for a, b in zip(straight, resumed, strict=True):
        for name in ("loss", "grad_norm", "reward", "sampling/rounds", "sampling/kept_groups"):
            assert a[name] == b[name], name
    final_a = _weights(find_checkpoint(straight_out) / "model")
    final_b = _weights(find_checkpoint(tmp_path) / "model")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_a_reward_failure_while_filtering_stops_and_resume_samples_the_step_again(trainer_world, dynamic_run,
                                                                                   tmp_path):
    """The filter waits for the scores, so a reward failure surfaces while sampling: the
    checkpoint holds the state at the start of the step (no rollouts), and the resumed run
    samples every round of that step again with the same seeds."""
    straight_out, _ = dynamic_run
    straight = read_log(straight_out / "metrics.jsonl")
    retrieval, _ = trainer_world.clients(judge=False)
    # Two chunks per round: fail in the middle of step 2.
    calls_in_step_1 = 2 * int(straight[0]["sampling/rounds"])
    flaky = FlakyRetrieval(retrieval, fail_from=calls_in_step_1 + 1)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, *DYNAMIC, "reward.max_attempts=2", "reward.retry_backoff_s=0", judge=False))
    with pytest.raises(RewardError, match=r"step 2: .*retrieval replica down.*checkpoint written"):
        train(config, retrieval=flaky, judge=None)
    checkpoint = find_checkpoint(tmp_path)
    assert (checkpoint.name, load_train_state(checkpoint).reason) == ("step_000001", "reward_error")
    assert not (checkpoint / "pending_rank0.pt").exists()
    resumed = train(config, retrieval=retrieval, judge=None, resume=checkpoint)
    assert resumed.steps_done == 3
    again = read_log(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in again] == [r["loss"] for r in straight]
    assert [r["sampling/rounds"] for r in again] == [r["sampling/rounds"] for r in straight]


def test_without_dynamic_sampling_nothing_is_filtered_or_logged(trainer_world, tmp_path):
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, "reward.binary_only=true", "steps=1", judge=False))
    record = train(config, retrieval=retrieval, judge=None).history[0]
    assert not any(name.startswith("sampling/") for name in record)


@pytest.mark.slow
def test_torchrun_ranks_sample_the_same_rounds_and_fill_their_own_share(trainer_world, tmp_path):
    """Two processes under torchrun (gloo on CPU): each rank filters its own half of the
    groups, but all ranks sample the same number of rounds (the data order is one
    stream), so the logged mean of rounds is a whole number and each rank trains its
    share of prompts_per_step groups."""
    from tests.test_trainer_distributed import _torchrun_train

    records = _torchrun_train(trainer_world, tmp_path / "out", tmp_path / "dynamic.yaml",
                              "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3",
                              "reward.binary_only=true", "reward.top_k=1")
    assert [r["step"] for r in records] == [1, 2]
    per_rank_groups = GROUPS // 2
    for record in records:
        rounds = record["sampling/rounds"]
        assert rounds in (1.0, 2.0, 3.0)  # a mean over ranks that agree
        assert record["sampling/kept_groups"] + record["sampling/filled_groups"] == per_rank_groups
        assert record["sampling/extra_rollouts"] == (rounds - 1) * per_rank_groups * GROUP_SIZE
        assert record["frac_reward_zero_std"] == record["sampling/filled_groups"] / per_rank_groups
