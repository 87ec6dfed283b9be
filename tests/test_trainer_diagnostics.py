"""Step metrics, health warnings, the run log, the data order and the micro-batch
arithmetic of the loop: plain functions, checked against obvious loop versions."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from calibrl.trainer import diagnostics as diag
from calibrl.trainer.distributed import DistContext, TaskOrder, reduce_metrics, shard
from calibrl.trainer.advantages import reward_metrics
from calibrl.trainer.sampling import concat_batches
from calibrl.trainer.update import micro_batch_weight as _micro_batch_weight
from calibrl.trainer.update import micro_batches as _micro_batches


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

def test_reward_metrics_match_a_loop_version():
    """frac_reward_zero_std is TRL's: the fraction of GROUPS with all-equal rewards
    (unequal group sizes tell it apart from a fraction of rollouts)."""
    rng = random.Random(0)
    groups = [0] * 8 + [i // 4 + 1 for i in range(20)]  # one group of 8, five of 4
    rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in groups]
    rewards[:8] = [1.0] * 8  # the large group has zero variance for sure
    rewards[8:12] = [0.5] * 4  # and one small group
    metrics = reward_metrics(torch.tensor(rewards), torch.tensor(groups))
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    zero = sum(1 for g in set(groups) if len({r for r, gg in zip(rewards, groups) if gg == g}) == 1)
    assert metrics["reward"] == pytest.approx(mean)
    assert metrics["reward_std"] == pytest.approx(std)
    assert zero >= 2 and metrics["frac_reward_zero_std"] == pytest.approx(zero / 6)
    assert metrics["frac_reward_zero_std"] != pytest.approx((8 + 4 * (zero - 1)) / len(rewards))  # not per rollout


def test_component_and_completion_metrics():
    metrics = diag.component_metrics([{"retrieval": 1.0, "rubric": 0.5}, {"retrieval": 0.0, "rubric": 0.7}])
    assert metrics["rewards/retrieval/mean"] == 0.5 and metrics["rewards/rubric/mean"] == pytest.approx(0.6)
    assert metrics["rewards/retrieval/std"] == pytest.approx(math.sqrt(0.5))
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    lengths = diag.completion_metrics(mask, truncated=[False, True, False])
    assert (lengths["completions/mean_length"], lengths["completions/min_length"],
            lengths["completions/max_length"]) == (pytest.approx(7 / 3), 1.0, 4.0)
    assert lengths["completions/clipped_ratio"] == pytest.approx(1 / 3)


def test_health_warnings_fire_only_outside_the_bands():
    bands = diag.HealthConfig(max_frac_reward_zero_std=0.5, min_reward_std=0.05, kl_target=0.1)
    healthy = {"frac_reward_zero_std": 0.2, "reward_std": 0.3, "kl": 0.05, "grad_norm": 1.0}
    assert diag.health_warnings(healthy, bands) == []
    sick = {"frac_reward_zero_std": 0.9, "reward_std": 0.01, "kl": 0.5, "grad_norm": float("nan")}
    warnings = diag.health_warnings(sick, bands)
    assert len(warnings) == 4
    assert warnings[0].startswith("frac_reward_zero_std=0.900 > 0.5") and "denser reward" in warnings[0]
    assert any(w.startswith("kl=0.5000 > kl_target=0.1") for w in warnings)


def test_run_log_writes_jsonl_and_tensorboard_and_drops_steps_after_a_resume_point(tmp_path):
    log = diag.RunLog(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        log.write(step, {"reward": step / 10, "kl": float("nan")})
    log.close()
    records = diag.read_log(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[0]["kl"] == "nan"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # A run that crashed after logging step 3 resumes from its step-2 checkpoint.
    resumed = diag.RunLog(tmp_path, tensorboard=False, resume_step=2)
    resumed.write(3, {"reward": 0.99})
    resumed.close()
    records = diag.read_log(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward"]) for r in records] == [(1, 0.1), (2, 0.2), (3, 0.99)]
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_task_order_is_seeded_covers_each_epoch_and_resumes_from_its_state():
    order = TaskOrder(7, seed=3)
    first = order.take(5) + order.take(2)
    assert sorted(first) == list(range(7))  # one epoch visits every task once
    state = order.state()
    upcoming = order.take(10)
    again = TaskOrder(7, seed=3)
    again.load_state(state)
    assert again.take(10) == upcoming
    assert TaskOrder(7, seed=4).take(7) != first
    assert TaskOrder(7, seed=3, shuffle=False).take(9) == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    with pytest.raises(ValueError, match="for 7 tasks but the run has 8"):
        TaskOrder(8, seed=3).load_state(state)


def test_shard_splits_evenly_by_rank():
    items = list(range(8))
    assert shard(items, DistContext(rank=1, world_size=4)) == [2, 3]
    assert [x for r in range(2) for x in shard(items, DistContext(rank=r, world_size=2))] == items
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        shard(items, DistContext(rank=0, world_size=3))
    assert reduce_metrics({"a": 1.0}, DistContext()) == {"a": 1.0}


def test_micro_batches_partition_the_rows():
    for rows in (1, 5, 16, 17):
        for parts in (1, 2, 3, 4, 32):
            batches = _micro_batches(rows, parts)
            assert [r for b in batches for r in b] == list(range(rows))
            assert len(batches) == min(rows, parts)


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_micro_batch_weights_recover_the_full_batch_loss(aggregation):
    """Weighted micro-batch losses add up to the loss of the whole batch, for every
    aggregation (and for a world of several ranks, whose mean is taken)."""
    from calibrl.trainer.losses import policy_loss

    torch.manual_seed(0)
    rows, width = 12, 9
    mask = torch.rand(rows, width) > 0.4
    mask[:, 0] = True
    logp = torch.randn(rows, width) * 0.1
    old = logp + 0.05 * torch.randn(rows, width)
    adv = torch.randn(rows, 1).expand(rows, width) * mask
    kwargs = dict(aggregation=aggregation, max_completion_length=width, eps_low=0.2, eps_high=0.28)
    full, _ = policy_loss(logp, old, adv, mask, **kwargs)
    for world in (1, 2, 3):
        per_rank = rows // world
        total = 0.0
        for rank in range(world):
            part = slice(rank * per_rank, (rank + 1) * per_rank)
            for micro in _micro_batches(per_rank, 2):
                index = [part.start + i for i in micro]
                loss, _ = policy_loss(logp[index], old[index], adv[index], mask[index], **kwargs)
                total += float(loss) * _micro_batch_weight(aggregation, mask[index], rows, float(mask.sum()), world)
        # Micro-batch losses re-weighted and summed in float64 vs one float32 loss over all rows: float32
        # sums over <= 48 tokens (float32_sum_error(48, .) ~ 94 u = 5.6e-6 relative without cancellation): rel 1e-5.
        assert total / world == pytest.approx(float(full), rel=1e-5)


def test_concat_batches_pads_and_keeps_groups_apart():
    from calibrl.trainer.rollout import RolloutBatch, assemble_rows

    def batch(rows, groups):
        tensors = assemble_rows(rows, pad_id=0)
        return RolloutBatch(**tensors, group_index=torch.tensor(groups), completion_texts=[""] * len(rows),
                            rollouts=[None] * len(rows), prompt_lengths=[1] * len(rows))

    a = batch([[([5, 6], False), ([7], True)], [([5, 6], False), ([8, 9], True)]], [0, 0])
    b = batch([[([5], False), ([1, 2, 3, 4], True)]], [0])
    merged = concat_batches([a, b], pad_id=0)
    assert merged.input_ids.shape == (3, 5)
    assert merged.group_index.tolist() == [0, 0, 1]
    assert merged.completion_mask[0].tolist() == [False, False, True, False, False]
    assert merged.segment_index[1].tolist() == [-1, -1, 0, 0, -1]
    assert merged.answer_mask[2].tolist() == [False, True, True, True, True]
    assert merged.attention_mask[0].tolist() == [1, 1, 1, 0, 0]



def test_a_non_finite_gradient_norm_skips_the_update():
    from calibrl.trainer.update import apply_update

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.tensor([1.0, float("nan"), 0.0])
    norm = float(torch.nn.utils.clip_grad_norm_([weight], 0.5))
    assert not apply_update(optimizer, norm)
    assert torch.equal(weight.detach(), torch.ones(3)) and not optimizer.state  # AdamW moments untouched
    weight.grad = torch.tensor([1.0, 0.0, 0.0])
    assert apply_update(optimizer, float(torch.nn.utils.clip_grad_norm_([weight], 0.5)))
    assert weight[0] < 1.0
