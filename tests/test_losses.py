"""Policy loss, token log-probabilities and entropy: plain-loop references,
hand-computed values, gradients and input validation."""

from __future__ import annotations

import math

import pytest
import torch

import calibrl.trainer.losses as losses
from calibrl.errors import InvalidArgument
from calibrl.trainer.losses import (
    LOSS_AGGREGATIONS,
    masked_entropy_from_logits,
    policy_loss,
    token_logprobs,
)

# ---------------------------------------------------------------------------
# Plain-loop reference
# ---------------------------------------------------------------------------


# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

def reference_token_loss(logp, old, adv, ref, beta, eps_low, eps_high) -> float:
    ratio = math.exp(logp - old)
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = -min(ratio * adv, clipped * adv)
    if ref is not None and beta > 0:
        loss += beta * (math.exp(ref - logp) - (ref - logp) - 1)
    return loss


def reference_policy_loss(logp, old, adv, mask, ref, beta, eps_low, eps_high, aggregation, max_len):
    batch, width = logp.shape
    per_token = [[reference_token_loss(float(logp[b, t]), float(old[b, t]), float(adv[b, t]),
                                       None if ref is None else float(ref[b, t]), beta, eps_low, eps_high)
                  for t in range(width)] for b in range(batch)]
    kept = [[bool(mask[b, t]) for t in range(width)] for b in range(batch)]
    if aggregation == "sequence_mean":
        rows = [sum(p for p, k in zip(per_token[b], kept[b]) if k) / max(sum(kept[b]), 1) for b in range(batch)]
        return sum(rows) / batch
    total = sum(p for b in range(batch) for p, k in zip(per_token[b], kept[b]) if k)
    if aggregation == "token_mean":
        return total / max(sum(map(sum, kept)), 1)
    return total / (batch * max_len)


def random_loss_inputs(seed: int, batch: int = 5, width: int = 7):
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 4
    old = logp + 0.4 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    adv = torch.randn(batch, width, generator=generator, dtype=torch.float64)
    lengths = torch.randint(0, width + 1, (batch,), generator=generator)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize(("beta", "eps_low", "eps_high"), [(0.0, 0.2, 0.2), (0.04, 0.2, 0.28), (0.1, 0.1, 0.3)])
@pytest.mark.parametrize("seed", range(5))
def test_policy_loss_matches_loop_reference(seed, beta, eps_low, eps_high, aggregation) -> None:
    logp, old, ref, adv, mask = random_loss_inputs(seed)
    loss, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=beta, eps_low=eps_low,
                                eps_high=eps_high, aggregation=aggregation, max_completion_length=9)
    expected = reference_policy_loss(logp, old, adv, mask, ref, beta, eps_low, eps_high, aggregation, 9)
    # float64 inputs, two orders of summing <= 8 x 9 per-token terms: float64 error ~ 72 * 1.1e-16 relative
    # to their absolute sum, far inside rel 1e-10; abs 1e-12 covers a loss that cancels to ~0.
    assert float(loss) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert metrics["policy_loss"] == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_loop_reference(seed: int) -> None:
    logp, old, ref, adv, mask = random_loss_inputs(seed, batch=8, width=9)
    _, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, eps_low=0.2, eps_high=0.28)
    tokens = [(b, t) for b in range(8) for t in range(9) if bool(mask[b, t])]
    count = max(len(tokens), 1)
    ratio = {(b, t): math.exp(float(logp[b, t] - old[b, t])) for b, t in tokens}
    low = sum(1 for b, t in tokens if ratio[b, t] < 0.8 and float(adv[b, t]) < 0) / count
    high = sum(1 for b, t in tokens if ratio[b, t] > 1.28 and float(adv[b, t]) > 0) / count
    kl = sum(math.exp(float(ref[b, t] - logp[b, t])) - float(ref[b, t] - logp[b, t]) - 1 for b, t in tokens) / count
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(low + high)
    assert metrics["kl"] == pytest.approx(kl)
    if seed == 0:
        assert low > 0 and high > 0  # the random inputs exercise both sides of the clip


# ---------------------------------------------------------------------------
# Hand-computed values and gradients
# ---------------------------------------------------------------------------


def _one(value: float) -> torch.Tensor:
    return torch.tensor([[value]], dtype=torch.float64)


def _token_loss(logp, old, adv, **kwargs):
    """The loss of one token (any aggregation of a single token is its own loss)."""
    return policy_loss(logp, old, adv, torch.ones(1, 1, dtype=torch.bool), **kwargs)[0]


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected"),
    [
        (1.0, 1.0, -1.0),        # on-policy: -A
        (1.5, 2.0, -2.4),        # above 1 + eps with A > 0: clipped at 1.2
        (0.5, 2.0, -1.0),        # below 1 - eps with A > 0: the unclipped ratio is the minimum
        (0.5, -1.0, 0.8),        # below 1 - eps with A < 0: clipped at 0.8
        (1.5, -1.0, 1.5),        # above 1 + eps with A < 0: unclipped (pessimistic) term
    ],
)
def test_clipped_surrogate_hand_values(ratio: float, advantage: float, expected: float) -> None:
    old = _one(-2.0)
    logp = old + math.log(ratio)
    assert float(_token_loss(logp, old, _one(advantage))) == pytest.approx(expected)


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    logp = _one(-1.0)
    assert float(_token_loss(logp, logp, _one(0.0), ref_logp=logp, beta=1.0)) == 0.0
    kl = math.exp(0.5) - 0.5 - 1
    assert float(_token_loss(logp, logp, _one(0.0), ref_logp=_one(-0.5), beta=0.1)) == pytest.approx(
        0.1 * kl)
    # With the ratio correction the KL term is weighted by r = exp(logp - old).
    corrected = _token_loss(logp, logp - 0.2, _one(0.0), ref_logp=_one(-0.5), beta=0.1, kl_ratio_correction=True)
    assert float(corrected) == pytest.approx(0.1 * kl * math.exp(0.2))


def test_gradient_vanishes_where_the_clip_is_active() -> None:
    old = torch.full((1, 3), -2.0, dtype=torch.float64)
    logp = (old + torch.tensor([[math.log(1.5), math.log(1.1), math.log(0.5)]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 3, dtype=torch.bool), aggregation="token_mean")
    loss.backward()
    # d/dlogp of -r*A is -r*A for the unclipped token; 0 for both clipped ones.
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.1 / 3, 0.0])


def test_aggregations_weight_sequences_differently() -> None:
    zero = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    values = {agg: float(policy_loss(zero, zero, adv, mask, aggregation=agg, max_completion_length=8)[0])
              for agg in LOSS_AGGREGATIONS}
    assert values["sequence_mean"] == pytest.approx(-(1.0 + 3.0) / 2)
    assert values["token_mean"] == pytest.approx(-(4.0 + 3.0) / 5)
    assert values["constant"] == pytest.approx(-(4.0 + 3.0) / (2 * 8))


def test_masked_positions_do_not_matter() -> None:
    logp, old, ref, adv, mask = random_loss_inputs(7)
    noisy = [t.clone() for t in (logp, old, ref, adv)]
    for tensor in noisy:
        tensor[~mask] = 123.0
    for aggregation in LOSS_AGGREGATIONS:
        clean, clean_metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1, aggregation=aggregation,
                                           max_completion_length=7)
        dirty, dirty_metrics = policy_loss(noisy[0], noisy[1], noisy[3], mask, ref_logp=noisy[2], beta=0.1,
                                           aggregation=aggregation, max_completion_length=7)
        assert float(clean) == pytest.approx(float(dirty))
        assert clean_metrics == pytest.approx(dirty_metrics)


def test_sequences_without_tokens_count_as_zero_in_sequence_mean() -> None:
    zero = torch.zeros(2, 2)
    adv = torch.ones(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(zero, zero, adv, mask)
    assert float(loss) == pytest.approx(-0.5)  # TRL's clamp(min=1): the empty row contributes 0


def test_policy_loss_does_not_mutate_and_only_logp_gets_a_gradient() -> None:
    logp, old, ref, adv, mask = random_loss_inputs(2)
    logp.requires_grad_()
    old.requires_grad_()
    snapshots = [t.detach().clone() for t in (logp, old, ref, adv, mask)]
    loss, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.05)
    loss.backward()
    assert logp.grad is not None and old.grad is None
    for before, after in zip(snapshots, (logp, old, ref, adv, mask)):
        assert torch.equal(before, after.detach())


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(old_logp=torch.zeros(2, 4)), "old_logp"),
        (dict(token_adv=torch.zeros(3, 3)), "token_adv"),
        (dict(mask=torch.ones(2, 2)), "mask"),
        (dict(mask=torch.full((2, 3), 2.0)), "mask"),
        (dict(logp=torch.zeros(6)), "logp"),
        (dict(ref_logp=torch.zeros(1, 3)), "ref_logp"),
        (dict(beta=0.1), "ref_logp"),
        (dict(beta=-0.1), "beta"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(aggregation="seq-mean-token-sum"), "aggregation"),
        (dict(aggregation="constant"), "max_completion_length"),
        (dict(aggregation="constant", max_completion_length=0), "max_completion_length"),
    ],
)
def test_bad_loss_arguments_name_the_field(kwargs: dict, field: str) -> None:
    arguments = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), token_adv=torch.zeros(2, 3),
                     mask=torch.ones(2, 3, dtype=torch.bool))
    arguments.update(kwargs)
    positional = [arguments.pop(name) for name in ("logp", "old_logp", "token_adv", "mask")]
    with pytest.raises(InvalidArgument) as caught:
        policy_loss(*positional, **arguments)
    assert caught.value.field == field


# ---------------------------------------------------------------------------
# token_logprobs and entropy
# ---------------------------------------------------------------------------


@pytest.fixture
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force several chunks (and a ragged last one) on small inputs."""
    monkeypatch.setattr(losses, "ROWS_PER_CHUNK", 4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_log_softmax(tiny_chunks, temperature: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator) * 3
    ids = torch.randint(0, 11, (3, 5), generator=generator)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    # Default float32 assert_close (atol 1e-5, rtol 1.3e-6) covers log_softmax_error(11, 1, 15) = 3e-6:
    # an 11-term normaliser and |logits / T| <= 15 (randn * 3 / 0.7).
    torch.testing.assert_close(token_logprobs(logits, ids, temperature=temperature), expected)


def test_token_logprobs_are_differentiable_and_upcast_bf16(tiny_chunks) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=generator, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3), generator=generator)
    token_logprobs(logits, ids).sum().backward()
    expected = torch.nn.functional.one_hot(ids, 7) - torch.softmax(logits.detach(), dim=-1)
    # softmax of 7 values in float32 twice (one-hot - p): a few u per entry, inside the default atol 1e-5.
    torch.testing.assert_close(logits.grad, expected)
    low = token_logprobs(logits.detach().bfloat16(), ids)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, token_logprobs(logits.detach().bfloat16().float(), ids))


def test_token_logprobs_reject_bad_ids() -> None:
    with pytest.raises(InvalidArgument) as caught:
        token_logprobs(torch.zeros(1, 2, 5), torch.tensor([[0, 5]]))
    assert caught.value.field == "token_ids"
    with pytest.raises(InvalidArgument) as caught:
        token_logprobs(torch.zeros(1, 2, 5), torch.tensor([[0, 1, 2]]))
    assert caught.value.field == "token_ids"
    with pytest.raises(InvalidArgument) as caught:
        token_logprobs(torch.zeros(2, 5), torch.tensor([[0, 1]]))
    assert caught.value.field == "logits"


def test_entropy_matches_categorical_and_respects_the_mask(tiny_chunks) -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 9, generator=generator) * 2
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    entropy, mean = masked_entropy_from_logits(logits, mask)
    expected = torch.distributions.Categorical(logits=logits).entropy() * mask
    # Default float32 assert_close (atol 1e-5): entropy_error(9, 1, 8) ~ 9e-6 for 9 logits of |x| <= 8.
    torch.testing.assert_close(entropy, expected)
    # The same 4 float32 entropies (all > 0) summed in two orders: <= 2 * 3 u = 3.6e-7 relative.
    assert mean == pytest.approx(float(expected.sum() / mask.sum()), rel=1e-6)
    assert not entropy.requires_grad
    # Uniform logits: entropy log(V).
    uniform, uniform_mean = masked_entropy_from_logits(torch.zeros(1, 2, 9), torch.ones(1, 2))
    # log(9) through a float32 logsumexp of 9 zeros: a few u (rel 1e-6 is ~17 u).
    assert uniform_mean == pytest.approx(math.log(9), rel=1e-6)


def test_entropy_with_grad_and_empty_mask() -> None:
    logits = torch.randn(2, 3, 5, requires_grad=True)
    entropy, _ = masked_entropy_from_logits(logits, torch.ones(2, 3), with_grad=True)
    assert entropy.requires_grad
    _, empty_mean = masked_entropy_from_logits(logits, torch.zeros(2, 3, dtype=torch.bool))
    assert empty_mean == 0.0
    with pytest.raises(InvalidArgument) as caught:
        masked_entropy_from_logits(logits, torch.ones(3, 3))
    assert caught.value.field == "mask"
    with pytest.raises(InvalidArgument) as caught:
        masked_entropy_from_logits(logits, torch.ones(2, 3), temperature=0.0)
    assert caught.value.field == "temperature"
