"""The pruned shared-prefix forward (judge_server/backends/pruned_forward.py) against
transformers' own forward of each whole prompt, per architecture and attention layout, and
the fallback for models it does not reproduce."""

import pytest

from tests.conftest import torch_threads_one
from tests.tolerances import forward_error

from calibrl.judge_server.backends.hf import SuffixLayout
from calibrl.judge_server.backends.pruned_forward import PrunedForward, pruned_forward_for, unsupported_reason
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.judge import load_llm
from calibrl.judge_server.rubric import Criterion
from calibrl.api.judge import JudgeItem
from calibrl.testing import build_tiny_causal_lm, build_tokenizer
from calibrl.tiny_lm import TinyLMSpec, build_tiny_lm

torch = pytest.importorskip("torch")

one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)

# (arch, heads, key/value heads, layers): grouped-query and plain attention, the Qwen2 projection
# biases, one layer (the prefix pass then runs no attention at all) and three.
CASES = [("llama", 4, 2, 2), ("llama", 4, 4, 3), ("qwen2", 4, 1, 2), ("llama", 2, 1, 1)]


def full_prompt_logprobs(model, prefix, suffix):
    """The reference: transformers' forward of the whole prompt, next-token log-probabilities."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix + suffix])).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("arch,heads,kv_heads,layers", CASES)
def test_pruned_logprobs_equal_the_full_forward(arch, heads, kv_heads, layers):
    tokenizer = build_tokenizer()
    spec = TinyLMSpec(arch=arch, hidden_size=32, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      initializer_range=0.2, lm_head_std=1.0)
    model = build_tiny_lm(tokenizer, spec, seed=layers).eval()
    pruned = pruned_forward_for(model)
    assert pruned is not None, unsupported_reason(model)
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    vocab = model.config.vocab_size
    prefix = torch.randint(3, vocab, (83,), generator=generator).tolist()
    suffixes = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (1, 6, 17, 4)]
    layout = SuffixLayout.build(suffixes, torch, "cpu", torch.float32)
    with torch.inference_mode():
        got = pruned.item_logprobs(prefix, layout)
    assert got.shape == (len(suffixes), vocab) and got.dtype == torch.float32
    references = [full_prompt_logprobs(model, prefix, suffix) for suffix in suffixes]
    # Same modules, other shapes (packed suffixes over a cache, the answer rows alone in the last layer):
    # the reductions round differently, bounded by forward_error; x2 margin on the largest logit.
    with torch.no_grad():
        largest = float(model(torch.tensor([prefix + suffixes[2]])).logits.abs().max())
    tolerance = forward_error(model, len(prefix) + 17, 2.0 * largest)
    for row, reference in zip(got, references):
        assert float((row - reference).abs().max()) <= tolerance
    # the rows differ from one another: each answer position reads its own suffix
    assert float((got[0] - got[2]).abs().max()) > 100 * tolerance


def test_models_it_does_not_reproduce_fall_back_to_the_transformers_forward(tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = build_tiny_causal_lm(tmp_path / "gpt2", seed=4)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=1024,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    assert unsupported_reason(gpt2) == "model_type 'gpt2' is not one of ['llama', 'qwen2']"
    gpt2.save_pretrained(str(folder))
    backend = load_llm(JudgeConfig(backend=f"transformers:{folder}", device="cpu"))
    assert backend.pruned is None
    item = JudgeItem.make("vtsax fees", "VTSAX expense ratio", ["VTSAX charges 0.04% a year."])
    criteria = [Criterion("intent", "llm", 1.0, question="Does the output keep the intent of the query?"),
                Criterion("quality", "llm", 1.0, question="How good is it?", scale="likert_1_5")]
    [scores] = backend.score([item], criteria, "")
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)

    llama = build_tiny_lm(tokenizer, TinyLMSpec())
    assert unsupported_reason(llama) is None
    del llama.model.layers[0].self_attn.q_proj
    assert "lacks the Llama modules" in unsupported_reason(llama)


def test_the_backend_uses_it_for_llama_judges(tmp_path):
    backend = load_llm(JudgeConfig(backend=f"transformers:{build_tiny_causal_lm(tmp_path / 'llama')}", device="cpu"))
    assert isinstance(backend.pruned, PrunedForward)



@pytest.mark.parametrize("arch,heads,kv_heads,layers", CASES[:3])
def test_kept_suffix_mask_leaves_scores_bitwise_unchanged(arch, heads, kv_heads, layers):
    """One mask per score call, each item a view of it: every item's log-probabilities are the
    same bits as with a fresh mask of its own, whatever prefix lengths came before (the kept
    mask is rebuilt wider when a longer prefix comes)."""
    tokenizer = build_tokenizer()
    spec = TinyLMSpec(arch=arch, hidden_size=32, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      initializer_range=0.2, lm_head_std=1.0)
    model = build_tiny_lm(tokenizer, spec, seed=layers).eval()
    pruned = pruned_forward_for(model)
    generator = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    suffixes = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (1, 6, 17, 4)]
    layout = SuffixLayout.build(suffixes, torch, "cpu", torch.float32)
    with torch.inference_mode():
        for n in (83, 5, 83, 300, 1, 129, 300, 511):  # repeats, and prefixes past the first mask's 256 columns
            prefix = torch.randint(3, vocab, (n,), generator=generator).tolist()
            fresh = SuffixLayout.build(suffixes, torch, "cpu", torch.float32)
            mask = layout.mask(n)
            assert torch.equal(mask, fresh.mask(n)) and mask.shape[-1] == n + 28
            assert torch.equal(pruned.item_logprobs(prefix, layout), pruned.item_logprobs(prefix, fresh))
    assert layout.kept["mask"].shape[-1] == 511 + 28


def test_a_gpu_mask_is_copied_to_aligned_rows_with_the_same_values():
    """cuDNN attention on an H200 failed with "misaligned address" on the layout's mask view
    (it starts part way into a row); on a GPU the mask goes to aligned storage first."""
    from calibrl.judge_server.backends.masks import MASK_ALIGN, aligned_copy, aligned_for_kernels

    layout = SuffixLayout.build([[5, 6, 7], [8], [9, 10]], torch, "cpu", torch.float32)
    view = layout.mask(37)
    assert view.storage_offset() % MASK_ALIGN != 0  # the fault's precondition
    assert aligned_for_kernels(view) is view  # the CPU path is untouched
    copy = aligned_copy(view[:, :, [2, 5]])
    for tensor, source in ((aligned_copy(view), view), (copy, view[:, :, [2, 5]])):
        assert torch.equal(tensor, source)
        assert tensor.storage_offset() % MASK_ALIGN == 0 and tensor.stride(-2) % MASK_ALIGN == 0
        assert tensor.data_ptr() % (MASK_ALIGN * tensor.element_size()) == 0
