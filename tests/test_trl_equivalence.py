"""Our advantages and policy loss equal what TRL's ``GRPOTrainer`` computes.

A real ``trl.GRPOTrainer`` (the installed trl, 1.16 when written) is built on a
tiny randomly initialised Llama and a word-level tokenizer made here; nothing
is downloaded. Comparisons, each within the float error its computation allows
(stated where it is checked, from tests/tolerances.py):

* **Advantages** go through TRL's own code path: ``_generate_and_score_completions``
  generates real completions with the tiny model and scores them with a reward
  function that returns rewards we chose (read from a dataset column), so the
  advantages, ``reward``, ``reward_std`` and ``frac_reward_zero_std`` TRL computes
  are compared with ``compute_advantages("grpo", ...)`` for ``scale_rewards``
  "group", "batch" and "none".
* **Loss**: TRL's ``_compute_loss`` runs on an inputs dict we prepare
  (prompt/completion ids with padding, (B, T) advantages, old and reference
  log-probabilities far enough from the current ones that both clip sides and
  the KL term are active). ``policy_loss`` runs on the per-token log-probs of the
  same model from TRL's ``_get_per_token_logps_and_entropies``. The loss value,
  the gradient w.r.t. every model parameter and the metrics (``kl``,
  ``clip_ratio/*``, ``entropy``) must agree for loss types grpo, bnpo, dapo and
  dr_grpo, with beta 0 and > 0. The per-token loss itself is recovered from TRL
  one token at a time (a one-hot advantage under dr_grpo, whose normaliser is a
  constant) and compared with ``policy_loss`` of that single token.

Settings chosen so that the comparison is exact, each one a documented TRL option:
``bf16=False`` (TRL 1.16 defaults to bf16 autocast, also on CPU);
``use_bias_correction_kl=False`` (TRL 1.16 multiplies the k3 term by the ratio by
default; our ``kl_ratio_correction=True`` reproduces that and is tested too);
the model in eval mode when the loss is computed: in train mode TRL divides the
loss by ``current_gradient_accumulation_steps``, state that only its training
loop sets (1 here), and the tiny Llama has no dropout, so eval mode changes
nothing else. ``dapo`` normalises by ``num_items_in_batch``, the token count of
the whole accumulated batch: we pass this batch's count, so it equals
``token_mean``.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
trl = pytest.importorskip("trl", reason="trl (a dev dependency) is needed for the equivalence test")

from tests.tolerances import entropy_error, float32_sum_error, log_softmax_error  # noqa: E402
from calibrl.trainer.advantages import compute_advantages  # noqa: E402
from calibrl.trainer.losses import (  # noqa: E402
    masked_entropy_from_logits,
    policy_loss,
    token_logprobs,
)
from tests.advantage_inputs import single_turn_inputs  # noqa: E402

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)]
GENERATIONS = 4
# Three tasks of four rollouts: a mixed group, an all-equal group, a spread group.
REWARDS = [0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2, 0.9, 0.1, 0.3, 0.0]
PROMPTS = ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11"]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """(model directory, tokenizer): a 2-layer Llama with hidden size 32, random weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model_dir = tmp_path_factory.mktemp("tiny_llama")
    # Saved and passed by path: with beta > 0 TRL builds its reference model from the path.
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return str(model_dir), tokenizer


def make_trainer(tiny_policy, tmp_path, **overrides):
    from datasets import Dataset

    model_dir, tokenizer = tiny_policy

    def chosen_reward(prompts, completions, target_reward, **kwargs):
        return list(target_reward)

    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=len(REWARDS),
                    num_generations=GENERATIONS, max_completion_length=6, report_to="none", use_cpu=True,
                    bf16=False, use_bias_correction_kl=False, seed=0)
    settings.update(overrides)
    dataset = Dataset.from_dict({"prompt": PROMPTS, "target_reward": [0.0] * len(PROMPTS)})
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=chosen_reward, args=trl.GRPOConfig(**settings),
                              train_dataset=dataset, processing_class=tokenizer)
    # Preconditions of the comparison: TRL's plain token-level clipped objective.
    assert trainer.importance_sampling_level == "token" and trainer.top_entropy_quantile == 1.0
    assert trainer.off_policy_mask_threshold is None and not trainer.use_vllm and trainer.args.delta is None
    return trainer


# ---------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_advantages_equal_trl(tiny_policy, tmp_path, scale_rewards: str) -> None:
    trainer = make_trainer(tiny_policy, tmp_path, scale_rewards=scale_rewards)
    rollouts = [{"prompt": PROMPTS[i // GENERATIONS], "target_reward": reward} for i, reward in enumerate(REWARDS)]
    trainer.model.train()
    output = trainer._generate_and_score_completions(rollouts)
    trl_advantages = output["advantages"]
    completion_mask = output["completion_mask"].bool()
    assert trl_advantages.shape == (len(REWARDS),)
    assert bool(completion_mask[:, 0].all())  # every rollout has at least its first token

    # Ours, on the rollouts in a shuffled order with arbitrary group labels.
    order = torch.randperm(len(REWARDS), generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([17, -2, 5])[torch.arange(len(REWARDS)) // GENERATIONS]
    inputs = single_turn_inputs(torch.tensor(REWARDS)[order], labels[order], completion_mask[order])
    token_adv, metrics = compute_advantages("grpo", inputs, scale=scale_rewards)
    ours = torch.empty_like(token_adv)
    ours[order] = token_adv

    assert bool((ours[~completion_mask] == 0).all())
    expanded = trl_advantages[:, None].expand_as(ours)
    # Both compute (R - mean) / (std + eps) over groups of a few rewards in float32, in their own order:
    # |A| <= 2, float32_sum_error(GENERATIONS, 2) ~ 1e-6 before the division by std >= 0.4.
    torch.testing.assert_close(ours[completion_mask], expanded[completion_mask],
                               atol=float32_sum_error(GENERATIONS, 2.0) / 0.4, rtol=0)
    assert float(trl_advantages.abs().max()) > 0.5  # a real signal was compared, not zeros

    logged = trainer._metrics["train"]
    # float32 mean / std of the same few rewards in [0, 1], two orders: float32_sum_error(n, n) < 1e-6.
    assert metrics["reward"] == pytest.approx(logged["reward"][-1], abs=1e-6)
    assert metrics["reward_std"] == pytest.approx(logged["reward_std"][-1], abs=1e-6)
    if scale_rewards == "batch":
        # TRL's zero-std flag follows the std it divided by: the batch std is not 0 here.
        assert logged["frac_reward_zero_std"][-1] == 0.0
        assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)
    else:
        # A count over groups: k / n in float32 on both sides, exact to 1 ulp.
        assert metrics["frac_reward_zero_std"] == pytest.approx(logged["frac_reward_zero_std"][-1], abs=1e-6)
        assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------

BATCH, PROMPT_LEN, COMPLETION_LEN = 6, 4, 7


def loss_inputs(trainer, seed: int = 1):
    """A prepared TRL inputs dict, plus the model's per-token log-probs and entropies (with grad)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, len(WORDS), (BATCH, PROMPT_LEN), generator=generator)
    prompt_mask = torch.ones(BATCH, PROMPT_LEN, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = 0
    completion_ids = torch.randint(3, len(WORDS), (BATCH, COMPLETION_LEN), generator=generator)
    completion_mask = torch.ones(BATCH, COMPLETION_LEN, dtype=torch.long)
    for row, length in enumerate([7, 5, 3, 7, 1, 6]):  # right padding
        completion_mask[row, length:] = 0
        completion_ids[row, length:] = 0
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, COMPLETION_LEN, compute_entropy=True)
    with torch.no_grad():
        advantages = torch.randn(BATCH, COMPLETION_LEN, generator=generator)
        old_logp = logp.detach() + 0.4 * torch.randn(BATCH, COMPLETION_LEN, generator=generator)
        ref_logp = logp.detach() + 0.3 * torch.randn(BATCH, COMPLETION_LEN, generator=generator)
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": advantages, "old_per_token_logps": old_logp, "ref_per_token_logps": ref_logp,
        "num_items_in_batch": completion_mask.sum(),
    }
    return inputs, logp, entropy, input_ids, attention_mask


CASES = [
    # loss_type, our aggregation, beta, TRL's use_bias_correction_kl, temperature
    ("grpo", "sequence_mean", 0.0, False, 1.0),
    ("grpo", "sequence_mean", 0.04, False, 1.0),
    ("bnpo", "token_mean", 0.04, False, 1.0),
    ("dapo", "token_mean", 0.04, False, 0.7),
    ("dr_grpo", "constant", 0.04, False, 1.0),
    ("grpo", "sequence_mean", 0.04, True, 1.0),
]


@pytest.mark.parametrize(("loss_type", "aggregation", "beta", "ratio_kl", "temperature"), CASES)
def test_policy_loss_equals_trl(tiny_policy, tmp_path, loss_type, aggregation, beta, ratio_kl, temperature) -> None:
    trainer = make_trainer(tiny_policy, tmp_path, loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                           max_completion_length=9, use_bias_correction_kl=ratio_kl, temperature=temperature)
    model = trainer.model
    model.eval()
    parameters = [p for p in model.parameters() if p.requires_grad]
    inputs, logp, trl_entropy, input_ids, attention_mask = loss_inputs(trainer)

    trl_loss = trainer._compute_loss(model, inputs)
    trl_grads = torch.autograd.grad(trl_loss, parameters)
    ours, metrics = policy_loss(
        logp, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"],
        ref_logp=inputs["ref_per_token_logps"] if beta > 0 else None, beta=beta, eps_low=0.2, eps_high=0.28,
        aggregation=aggregation, max_completion_length=9, kl_ratio_correction=ratio_kl,
    )
    our_grads = torch.autograd.grad(ours, parameters)

    # Same log-probs, two codes that sum the per-token terms (|term| <= |A| * 1.28 + beta * KL) in their
    # own order and normalise by at least one token: float32_sum_error over the tokens.
    tokens = int(inputs["completion_mask"].sum())
    term_bound = float(inputs["advantages"].abs().max()) * 1.28 + 1.0
    loss_tolerance = float32_sum_error(tokens, tokens * term_bound) / tokens
    assert float(ours.detach()) == pytest.approx(float(trl_loss.detach()), abs=loss_tolerance, rel=0)
    for ours_grad, trl_grad in zip(our_grads, trl_grads):
        # Each gradient entry is the same kind of token sum through the model's backward (another
        # order of the same terms); rtol 1e-5 is ~170 u, the loss bound above sized for the entries.
        torch.testing.assert_close(ours_grad, trl_grad, atol=loss_tolerance, rtol=1e-5)
    assert max(float(g.abs().max()) for g in trl_grads) > 1e-4  # gradients are not trivially zero

    logged = trainer._metrics["eval"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        # Fractions of the same masked tokens counted by both: k / n, exact to 1 float32 ulp.
        assert metrics[name] == pytest.approx(logged[name][-1], abs=1e-6)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    if beta > 0:
        # The k3 KL averaged over the same tokens (|KL| < 1 per token here), two orders of summation.
        assert metrics["kl"] == pytest.approx(logged["kl"][-1], abs=float32_sum_error(tokens, tokens) / tokens)
        assert metrics["kl"] > 1e-3

    # token_logprobs / entropy from the model's full logits equal TRL's fused-head values.
    mask = inputs["completion_mask"].bool()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, PROMPT_LEN - 1:-1]  # position t predicts completion token t
        our_logp = token_logprobs(logits, inputs["completion_ids"], temperature=temperature)
        our_entropy, our_entropy_mean = masked_entropy_from_logits(logits, mask, temperature=temperature)
    # Another forward (full logits vs TRL's own slice) and another log-softmax / entropy kernel on the
    # same weights: the bounds of tests/tolerances.py for this vocabulary, width and logit range.
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    max_logit = float(logits.abs().max()) / temperature
    torch.testing.assert_close(our_logp[mask], logp.detach()[mask], atol=log_softmax_error(vocab, hidden, max_logit),
                               rtol=0)
    entropy_tolerance = entropy_error(vocab, hidden, max_logit)
    torch.testing.assert_close(our_entropy[mask], trl_entropy[mask], atol=entropy_tolerance, rtol=0)
    assert our_entropy_mean == pytest.approx(logged["entropy"][-1], abs=entropy_tolerance, rel=0)


def test_per_token_loss_equals_trl(tiny_policy, tmp_path) -> None:
    """TRL's per-token loss, read one token at a time: under dr_grpo the loss is
    sum(per_token * mask) / (B * max_completion_length), so with a one-hot
    advantage (and beta 0) it is that single token's loss over a constant.
    Every third trained token is read (a forward pass each), clipped ones included."""
    max_len = 9
    trainer = make_trainer(tiny_policy, tmp_path, loss_type="dr_grpo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
                           max_completion_length=max_len)
    trainer.model.eval()
    inputs, logp, _, _, _ = loss_inputs(trainer, seed=5)
    mask = inputs["completion_mask"].bool()

    def ours(row: int, column: int) -> float:
        """Our loss of the single token (row, column)."""
        token = (slice(row, row + 1), slice(column, column + 1))
        return float(policy_loss(logp.detach()[token], inputs["old_per_token_logps"][token],
                                 inputs["advantages"][token], torch.ones(1, 1, dtype=torch.bool),
                                 eps_low=0.2, eps_high=0.28)[0])

    probed = mask.nonzero()[::3]
    ratio = torch.exp(logp.detach() - inputs["old_per_token_logps"])
    clipped = (ratio < 0.8) | (ratio > 1.28)
    assert bool(clipped[probed[:, 0], probed[:, 1]].any()) and not bool(clipped[probed[:, 0], probed[:, 1]].all())
    with torch.no_grad():
        for row, column in probed.tolist():
            one_hot = torch.zeros_like(inputs["advantages"])
            one_hot[row, column] = inputs["advantages"][row, column]
            loss = trainer._compute_loss(trainer.model, {**inputs, "advantages": one_hot})
            # One nonzero term among zeros: TRL's sum is exact, then / (B * max_len) and * (B * max_len)
            # in float32 round twice (2 u relative); |term| < 10, so 1e-6 allows 8 u.
            assert float(loss) * (BATCH * max_len) == pytest.approx(ours(row, column), abs=1e-6)
    assert max(abs(ours(row, column)) for row, column in probed.tolist()) > 0.1
