"""The policy: loading from a folder, LoRA, the frozen reference, per-token log-probabilities."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calibrl.errors import ConfigError, InvalidArgument, NotFound  # noqa: E402
from calibrl.testing import build_model, build_tokenizer, save_tiny_policy  # noqa: E402
from tests.tolerances import forward_error  # noqa: E402
from calibrl.trainer.engines import inference_weights  # noqa: E402
from calibrl.trainer.policy import (  # noqa: E402
    LoraSettings,
    Policy,
    load_policy,
    make_reference,
)
from calibrl.testing.logprobs import sequence_logprobs  # noqa: E402

LORA = LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _batch(tokenizer):
    """Three texts of different lengths, right-padded."""
    texts = ["<think> a </think>", "The Eiffel Tower is in Paris, the capital of France.", "Dune"]
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
    return input_ids, attention_mask, [len(r) for r in rows]


def _manual_logprobs(model, input_ids, lengths, temperature=1.0):
    """The obvious loop: one unpadded forward per prefix."""
    logp = torch.zeros(input_ids.shape)
    entropy = torch.zeros(input_ids.shape)
    with torch.no_grad():
        for b, length in enumerate(lengths):
            for t in range(1, length):
                logits = model(input_ids=input_ids[b : b + 1, :t]).logits[0, -1].double() / temperature
                dist = torch.log_softmax(logits, dim=-1)
                logp[b, t] = dist[input_ids[b, t]]
                entropy[b, t] = -(dist.exp() * dist).sum()
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_a_manual_loop(tokenizer, temperature):
    model = build_model(tokenizer)
    input_ids, attention_mask, lengths = _batch(tokenizer)
    with torch.no_grad():
        logp, entropy = sequence_logprobs(model, input_ids, attention_mask, temperature=temperature, return_entropy=True)
    expected_logp, expected_entropy = _manual_logprobs(model, input_ids, lengths, temperature)
    valid = attention_mask.bool()
    assert logp.shape == entropy.shape == input_ids.shape
    assert torch.all(logp[:, 0] == 0) and torch.all(entropy[:, 0] == 0)
    with torch.no_grad():
        max_logit = float(model(input_ids=input_ids, attention_mask=attention_mask).logits.abs().max()) / temperature
    tolerance = forward_error(model, input_ids.shape[1], max_logit)
    # Padded batch vs one unpadded forward per prefix (float64 softmax at the end): the whole forward may
    # round differently, tests/tolerances.forward_error bounds it from the model's sizes and logit range.
    torch.testing.assert_close(logp[valid], expected_logp[valid].float(), atol=tolerance, rtol=0)
    # Same bound: an entropy is a vocabulary sum of p * log p over the same logits.
    torch.testing.assert_close(entropy[valid], expected_entropy[valid].float(), atol=tolerance, rtol=0)
    assert bool((logp[valid] <= 0).all())


def test_token_logprobs_are_differentiable_and_validated(tokenizer):
    model = build_model(tokenizer).train()
    input_ids, attention_mask, _ = _batch(tokenizer)
    logp = sequence_logprobs(model, input_ids, attention_mask)
    (logp * attention_mask).sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    with pytest.raises(InvalidArgument, match="temperature"):
        sequence_logprobs(model, input_ids, attention_mask, temperature=0.0)
    with pytest.raises(InvalidArgument, match="input_ids"):
        sequence_logprobs(model, input_ids[0], attention_mask[0])


def test_load_policy_from_a_folder(policy_dir, tokenizer):
    policy = load_policy(str(policy_dir), device="cpu", dtype="float32")
    assert isinstance(policy, Policy) and not policy.is_lora
    assert policy.device == torch.device("cpu") and policy.model_id == str(policy_dir)
    assert next(policy.model.parameters()).dtype == torch.float32
    assert policy.model.training
    assert policy.tokenizer.pad_token_id == tokenizer.pad_token_id
    # Same weights as the model that was saved.
    input_ids, attention_mask, _ = _batch(tokenizer)
    with torch.no_grad():
        loaded = sequence_logprobs(policy.model, input_ids, attention_mask)
        original = sequence_logprobs(build_model(tokenizer), input_ids, attention_mask)
    torch.testing.assert_close(loaded, original)  # same weights, same kernels: bitwise (default tolerance)

    bf16 = load_policy(str(policy_dir), device="cpu", dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_threads_loading_policies_at_once_each_get_the_saved_weights(tokenizer, tmp_path):
    """`calibrl demo` evaluates two arms at a time, each thread loading its checkpoints:
    transformers builds a model under process-wide patches, so loads that overlap must not
    leave a model on the meta device or with another's weights. The demo's policies tie
    their input and output embeddings, the case where overlapping loads broke."""
    import concurrent.futures

    from calibrl.tiny_lm import TinyLMSpec, build_tiny_lm

    folder = tmp_path / "tied"
    build_tiny_lm(tokenizer, TinyLMSpec(tie_word_embeddings=True), 0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    expected = load_policy(str(folder), device="cpu", dtype="float32").model.state_dict()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: load_policy(str(folder), device="cpu", dtype="float32"), range(32)))
    for policy in loaded:
        state = policy.model.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in state.items():
            assert tensor.device.type == "cpu" and torch.equal(tensor, expected[name]), name


def test_load_policy_errors(policy_dir, tmp_path):
    with pytest.raises(NotFound, match="local folders"):
        load_policy(str(tmp_path / "missing"))
    with pytest.raises(NotFound, match="config.json"):
        load_policy(str(tmp_path))
    with pytest.raises(InvalidArgument, match="dtype"):
        load_policy(str(policy_dir), dtype="float8")
    with pytest.raises(InvalidArgument, match="device"):
        load_policy(str(policy_dir), device="not-a-device")
    with pytest.raises(InvalidArgument, match="lora.r"):
        LoraSettings(r=0)


def test_gradient_checkpointing(policy_dir, tokenizer):
    policy = load_policy(str(policy_dir), device="cpu", dtype="float32", gradient_checkpointing=True)
    model = policy.model
    assert getattr(model, "is_activation_checkpointing", None) or getattr(model, "is_gradient_checkpointing")
    input_ids, attention_mask, _ = _batch(tokenizer)
    sequence_logprobs(policy.model, input_ids, attention_mask).sum().backward()
    assert policy.model.model.layers[0].self_attn.q_proj.weight.grad is not None

    pytest.importorskip("peft")
    lora_policy = load_policy(str(policy_dir), device="cpu", dtype="float32", lora=LORA, gradient_checkpointing=True)
    sequence_logprobs(lora_policy.model, input_ids, attention_mask).sum().backward()
    grads = [p.grad for n, p in lora_policy.model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None for g in grads)


def test_reference_is_a_frozen_copy(policy_dir, tokenizer):
    policy = load_policy(str(policy_dir), device="cpu", dtype="float32")
    reference = make_reference(policy)
    assert reference is not policy.model and not reference.training
    assert all(not p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in policy.model.parameters())
    input_ids, attention_mask, _ = _batch(tokenizer)
    with torch.no_grad():
        before = sequence_logprobs(reference, input_ids, attention_mask)
        for p in policy.model.parameters():
            p.add_(0.05)
        after = sequence_logprobs(reference, input_ids, attention_mask)
        moved = sequence_logprobs(policy.model, input_ids, attention_mask)
    torch.testing.assert_close(before, after)  # the frozen reference: same weights, same kernels, bitwise
    assert not torch.allclose(moved, before)


def _randomise_lora(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def test_lora_wraps_with_peft_and_the_reference_disables_adapters(policy_dir, tokenizer):
    peft = pytest.importorskip("peft")
    policy = load_policy(str(policy_dir), device="cpu", dtype="float32", lora=LORA)
    assert policy.is_lora and isinstance(policy.model, peft.PeftModel)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable) and not any("k_proj" in n for n in trainable)

    reference = make_reference(policy)
    reference.requires_grad_(False)
    reference.eval()
    assert list(reference.parameters()) == []
    assert all(p.requires_grad for n, p in policy.model.named_parameters() if "lora_" in n)
    assert policy.model.training

    input_ids, attention_mask, _ = _batch(tokenizer)
    base = build_model(tokenizer)
    with torch.no_grad():
        base_logp = sequence_logprobs(base, input_ids, attention_mask)
        # B = 0 at init: the adapter adds exact zeros to the same float32 products, so the values match to
        # the default float32 tolerance (atol 1e-5) on any CPU (they are in fact bitwise equal).
        torch.testing.assert_close(sequence_logprobs(policy.model, input_ids, attention_mask), base_logp)  # B = 0 at init
        _randomise_lora(policy.model)
        trained = sequence_logprobs(policy.model, input_ids, attention_mask)
        ref = sequence_logprobs(reference, input_ids, attention_mask)
    assert not torch.allclose(trained, base_logp, atol=1e-3)  # randomised adapters move log-probs by >> 1e-3
    torch.testing.assert_close(ref, base_logp)  # adapters disabled: the base model's own kernels, default tolerance
    assert policy.model.training  # the reference call restored the mode
    # Adapters are active again after the reference call.
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(policy.model, input_ids, attention_mask), trained)


def test_lora_inference_weights_merge_the_adapter(policy_dir, tokenizer):
    pytest.importorskip("peft")
    policy = load_policy(str(policy_dir), device="cpu", dtype="float32", lora=LORA)
    _randomise_lora(policy.model)
    merged = dict(inference_weights(policy.model))
    fresh = build_model(tokenizer, seed=123)
    assert set(merged) == set(fresh.state_dict())
    fresh.load_state_dict(merged)
    input_ids, attention_mask, _ = _batch(tokenizer)
    policy.model.eval()
    with torch.no_grad():
        # Merged W + s * B A vs the adapter's separate matmuls: the same products rounded in another order
        # through the whole forward, bounded by tests/tolerances.forward_error.
        logits = fresh(input_ids=input_ids, attention_mask=attention_mask).logits
        tolerance = forward_error(fresh, input_ids.shape[1], float(logits.abs().max()))
        torch.testing.assert_close(
            sequence_logprobs(fresh, input_ids, attention_mask),
            sequence_logprobs(policy.model, input_ids, attention_mask),
            atol=tolerance,
            rtol=0,
        )
    # The policy itself is untouched (still unmerged, adapters still separate).
    assert any("lora_A" in n for n, _ in policy.model.named_parameters())


def test_full_model_inference_weights_are_its_state_dict(tokenizer):
    model = build_model(tokenizer)
    weights = dict(inference_weights(model))
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_saved_adapter_folder_loads_trainable(policy_dir, tokenizer, tmp_path):
    pytest.importorskip("peft")
    policy = load_policy(str(policy_dir), device="cpu", dtype="float32", lora=LORA)
    _randomise_lora(policy.model)
    policy.model.save_pretrained(tmp_path / "adapter")
    resumed = load_policy(str(tmp_path / "adapter"), device="cpu", dtype="float32")
    assert resumed.is_lora and resumed.model_id == str(policy_dir)
    assert any(p.requires_grad for p in resumed.model.parameters())
    input_ids, attention_mask, _ = _batch(tokenizer)
    with torch.no_grad():
        # The saved adapter reloads bitwise: same weights, same kernels (default float32 tolerance).
        torch.testing.assert_close(
            sequence_logprobs(resumed.model, input_ids, attention_mask),
            sequence_logprobs(policy.model, input_ids, attention_mask),
        )
    with pytest.raises(ConfigError, match="already holds a LoRA adapter"):
        load_policy(str(tmp_path / "adapter"), device="cpu", lora=LORA)


def test_the_engine_samples_from_the_lora_policy(policy_dir, tokenizer):
    pytest.importorskip("peft")
    from calibrl.trainer.engines import TransformersEngine

    policy = load_policy(str(policy_dir), device="cpu", dtype="float32", lora=LORA)
    _randomise_lora(policy.model)
    merged = build_model(tokenizer, seed=5)
    merged.load_state_dict(dict(inference_weights(policy.model)))
    merged_policy = Policy(model=merged, tokenizer=tokenizer, device=torch.device("cpu"), model_id="merged")
    prompts = [tokenizer(t)["input_ids"] for t in ("Dune is a novel", "<think> where is the tower")]
    with_adapter = TransformersEngine(policy).generate(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0)
    from_merged = TransformersEngine(merged_policy).generate(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0)
    base = TransformersEngine(Policy(build_model(tokenizer), tokenizer, torch.device("cpu"), "base")).generate(
        prompts, max_new_tokens=8, temperature=0.0, top_p=1.0
    )
    assert with_adapter == from_merged
    assert with_adapter != base


# --------------------------------------------------------------------------- a group's prompt runs once


def _grouped_batch(tokenizer, generator):
    """Three prompts of different lengths, left-padded to one width, each repeated in rows that are
    not contiguous (2, 3 and 1 rows), with random completions right-padded by a mask."""
    texts = ["Question: who wrote Dune?", "hello", "The Eiffel Tower is in Paris, the capital of France."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, prompts))
    of_row = [0, 1, 0, 1, 2, 1]
    completion = 7
    input_ids = torch.full((len(of_row), width + completion), tokenizer.pad_token_id)
    attention_mask = torch.zeros(input_ids.shape, dtype=torch.long)
    for row, group in enumerate(of_row):
        prompt = prompts[group]
        input_ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) : width] = 1
        length = completion - row % 3  # completions of 7, 6 and 5 tokens
        input_ids[row, width : width + length] = torch.randint(5, 300, (length,), generator=generator)
        attention_mask[row, width : width + length] = 1
    return input_ids, attention_mask, width, of_row


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_shared_prompt_gives_the_same_logprobs_entropies_and_gradients(tokenizer, arch):
    from calibrl.trainer.policy import completion_logprobs, prefix_groups

    model = build_model(tokenizer, arch=arch)
    input_ids, attention_mask, width, of_row = _grouped_batch(tokenizer, torch.Generator().manual_seed(0))
    groups = prefix_groups(model, input_ids, attention_mask, width - 1)
    assert groups is not None and groups.first.numel() == 3  # three distinct prompts in six rows
    assert [int(groups.first[g]) for g in groups.of_row] == [of_row.index(g) for g in of_row]
    entropy_mask = attention_mask[:, width:].bool()
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, input_ids, attention_mask, start=width,
                                            entropy_mask=entropy_mask, share_prefix=share)
        (logp * entropy_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[share] = (logp.detach(), entropy, grads)
    with torch.no_grad():
        max_logit = float(model(input_ids=input_ids, attention_mask=attention_mask).logits.abs().max())
    # One forward pass or two (the prompt, then the rest over its keys and values): the same products
    # and sums, rounded in other blockings; tests/tolerances.forward_error bounds it.
    tolerance = forward_error(model, input_ids.shape[1], max_logit)
    torch.testing.assert_close(results[True][0][entropy_mask], results[False][0][entropy_mask], atol=tolerance, rtol=0)
    torch.testing.assert_close(results[True][1][entropy_mask], results[False][1][entropy_mask], atol=tolerance, rtol=0)
    # The gradient sums the rows' contributions: relative to its largest entry, within the same chain bound
    # per unit of a row's loss (the loss is a sum of log-probs bounded by max_logit each).
    plain = results[False][2]
    assert float((results[True][2] - plain).abs().max()) <= tolerance * len(of_row) * entropy_mask.shape[1] \
        * max(1.0, float(plain.abs().max()))
    assert float((results[True][2] - plain).abs().max()) < 1e-3 * float(plain.abs().max())


def test_sharing_is_skipped_where_it_cannot_help_or_cannot_run(policy_dir, tokenizer):
    from calibrl.trainer.policy import completion_logprobs, prefix_groups

    model = build_model(tokenizer)
    input_ids, attention_mask, width, _ = _grouped_batch(tokenizer, torch.Generator().manual_seed(1))
    distinct = torch.tensor([0, 1, 4])  # one row of each prompt: nothing to share
    assert prefix_groups(model, input_ids[distinct], attention_mask[distinct], width - 1) is None
    assert prefix_groups(model, input_ids, attention_mask, 0) is None  # an empty prefix
    # Rows that differ before the cut share nothing: a later completion column makes them distinct.
    assert prefix_groups(model, input_ids, attention_mask, width + 3) is None
    with torch.no_grad():  # the plain path then, bitwise
        plain, _ = completion_logprobs(model, input_ids[distinct], attention_mask[distinct], start=width)
        shared, _ = completion_logprobs(model, input_ids[distinct], attention_mask[distinct], start=width,
                                        share_prefix=True)
    assert torch.equal(plain, shared)
    # Gradient checkpointing turns the cache off in training: the plain forward.
    checkpointed = load_policy(str(policy_dir), device="cpu", dtype="float32", gradient_checkpointing=True).model
    checkpointed.train()
    assert prefix_groups(checkpointed, input_ids, attention_mask, width - 1) is None


def test_the_lora_reference_shares_the_prompt_too(policy_dir, tokenizer):
    pytest.importorskip("peft")
    from calibrl.trainer.policy import completion_logprobs, prefix_groups

    policy = load_policy(str(policy_dir), device="cpu", dtype="float32", lora=LORA)
    _randomise_lora(policy.model)
    reference = make_reference(policy)
    input_ids, attention_mask, width, _ = _grouped_batch(tokenizer, torch.Generator().manual_seed(2))
    assert prefix_groups(reference, input_ids, attention_mask, width - 1) is not None
    mask = attention_mask[:, width:].bool()
    with torch.no_grad():
        plain, _ = completion_logprobs(reference, input_ids, attention_mask, start=width)
        shared, _ = completion_logprobs(reference, input_ids, attention_mask, start=width, share_prefix=True)
        policy_plain, _ = completion_logprobs(policy.model, input_ids, attention_mask, start=width)
        max_logit = float(reference(input_ids=input_ids, attention_mask=attention_mask).logits.abs().max())
    tolerance = forward_error(build_model(tokenizer), input_ids.shape[1], max_logit)  # same sizes as the policy
    torch.testing.assert_close(shared[mask], plain[mask], atol=tolerance, rtol=0)
    assert not torch.allclose(policy_plain[mask], plain[mask], atol=1e-3)  # the adapters are off in the reference
