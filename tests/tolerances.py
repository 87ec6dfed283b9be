"""Float tolerances of the test suite, sized from an error model, never from one machine's output.

Why a tolerance at all: torch picks its CPU kernels at run time (AVX-512, AVX2 or scalar code,
``ATEN_CPU_CAPABILITY`` forces one), a matmul blocks its reduction by the shape of its inputs, and a
padded or sliced batch takes another path. The same float32 quantity computed two ways therefore
rounds differently: a sum of ``n`` terms carries a first-order error of at most
``(n - 1) * u * sum(|term|)`` in ANY order of its n - 1 additions, pairwise, blocked or SIMD lanes
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., chapter 4), ``u = 2**-24`` the
float32 unit roundoff. Two such results differ
by at most twice that. The helpers below compute these bounds from the shape and size of the data,
so a test states the error it allows and why, and passes on every CPU that rounds correctly.

Bare ``pytest.approx(x)`` (relative 1e-6, about 17 float32 roundings) is kept for values that are a
handful of float operations away from their reference (float64 arithmetic, or a few float32
operations on exactly representable inputs): their error is below 1e-7 relative on any CPU.
"""

from __future__ import annotations

U32 = 2.0**-24
"""float32 unit roundoff: the relative error of one correctly rounded operation."""

def float32_sum_error(terms: int, abs_sum: float) -> float:
    """Bound on how far two float32 sums of the same ``terms`` values, whose absolute values sum to
    ``abs_sum``, can be apart when computed in different orders: twice Higham's any-order bound."""
    return 2.0 * max(terms - 1, 1) * U32 * abs_sum


def float32_chain_error(reduction_lengths: list[int], magnitude: float) -> float:
    """Bound for a float32 value reached through a chain of reductions (a model forward: one dot
    product per layer input, a softmax over the vocabulary...) whose terms add up to at most
    ``magnitude`` in absolute value: each reduction of length ``n`` adds at most ``(n - 1) * u *
    magnitude`` to first order, and two paths through the chain may err in opposite directions."""
    return 2.0 * sum(max(n - 1, 1) for n in reduction_lengths) * U32 * magnitude


def log_softmax_error(vocab: int, hidden: int, max_abs_logit: float) -> float:
    """Bound on how far two float32 computations of ``log p(y) = s_y - logsumexp(s)`` can be apart
    when both start from the same hidden state: the logit ``s_y`` is a ``hidden``-term dot product
    (its terms sum to about ``max_abs_logit`` in absolute value); the normaliser is a ``vocab``-term
    sum of ``exp(s - max s)`` in (0, 1] whose relative error (at most ``(vocab - 1) * u``) the log
    turns into an absolute one."""
    return float32_sum_error(hidden, max_abs_logit) + float32_sum_error(vocab, 1.0)


def entropy_error(vocab: int, hidden: int, max_abs_logit: float) -> float:
    """Bound for ``H = logsumexp(s) - sum_i p_i * s_i`` computed two ways: the log-softmax bound
    plus a ``vocab``-term sum whose absolute terms add up to at most ``max_abs_logit``."""
    return log_softmax_error(vocab, hidden, max_abs_logit) + float32_sum_error(vocab, max_abs_logit)


def forward_error(model, length: int, max_abs_logit: float) -> float:
    """Bound on how far a tiny float32 transformer's per-token log-probabilities (and entropies)
    can move between two forward paths (padded or not, batched or not, another kernel): every
    reduction on the way (projections over the hidden size, attention over ``length`` positions,
    the MLP, the head, the vocabulary) may round differently; activations and logits are bounded by
    ``max_abs_logit`` (RMSNorm keeps the hidden states near 1, the head spreads the logits)."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = [config.hidden_size] * 4 + [head_dim, length, length, config.hidden_size,
                                            config.hidden_size, config.intermediate_size]
    chain = per_layer * config.num_hidden_layers + [config.hidden_size, config.vocab_size, config.vocab_size]
    return float32_chain_error(chain, max_abs_logit)
