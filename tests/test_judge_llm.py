"""LLM judging with a tiny random causal LM built in the test: the batched shared-prefix
pass equals the flat batch and the one-prompt-at-a-time reference; the shared prompt
and score-extraction code; backend selection (vLLM absent)."""

import math

import pytest

from tests.conftest import torch_threads_one

from calibrl.errors import ConfigError, InvalidArgument, RewardError
from calibrl.judge_server import prompts
from calibrl.judge_server.backends import model_fingerprint, parse_spec
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.judge import load_llm
from calibrl.judge_server.rubric import Criterion
from calibrl.testing import SIMPLE_CHAT_TEMPLATE, build_tiny_causal_lm, synthetic_feedback
from calibrl.api.judge import JudgeItem
from tests.tolerances import forward_error

torch = pytest.importorskip("torch")

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

CRITERIA = [
    Criterion("intent", "llm", 1.0, question="Does the output keep the intent of the user's query?"),
    Criterion("invented", "llm", 0.5, penalty=True, good_answer="no",
              question="Does the output mention an entity that is not in the query or the documents?"),
    Criterion("quality", "llm", 1.0, question="How good is the rewrite?", scale="likert_1_5"),
]


one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)


@pytest.fixture(scope="module")
def items():
    records = synthetic_feedback(7, seed=5)
    return [r.to_item() for r in records] + [JudgeItem.make("q", "short")]  # very different lengths


def reference_scores(backend, items, criteria):
    """One prompt at a time, no padding, no cache: the obvious version."""
    encoded = backend.encoder.encode(items, criteria, "")
    rows = []
    for prefix in encoded.prefix_ids:
        row = []
        for criterion, suffix in zip(criteria, encoded.suffix_ids):
            with torch.no_grad():
                logits = backend.model(torch.tensor([prefix + suffix])).logits[0, -1]
            logprobs = torch.log_softmax(logits.float(), -1)
            row.append(prompts.score_from_logprobs(criterion, lambda t: float(logprobs[t]), backend.encoder.answer_tokens))
        rows.append(row)
    return rows


def score_tolerance(backend, items):
    """How far a criterion score may move between two forward paths (prefix cache, padding, batch):
    a yes/no score is sigmoid(logit_yes - logit_no), so it moves by at most half the logits' error; a
    1-5 expectation over (k - 1) / 4 by at most the logits' error. tests/tolerances.forward_error bounds
    the logits' error from the model's sizes, the longest prompt and the largest logit."""
    encoded = backend.encoder.encode(items, CRITERIA, "")
    longest = max(len(p) for p in encoded.prefix_ids) + max(len(s) for s in encoded.suffix_ids)
    with torch.no_grad():
        logits = backend.model(torch.tensor([encoded.prefix_ids[0] + encoded.suffix_ids[0]])).logits
    # The largest logit of one prompt stands for all: the head's weights bound every prompt's alike; x2 margin.
    return forward_error(backend.model, longest, 2.0 * float(logits.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_cache_equals_flat_equals_reference(arch, tiny_llama, tmp_path, items):
    folder = tiny_llama if arch == "llama" else build_tiny_causal_lm(tmp_path / arch, arch="qwen2", seed=2)
    backend = load_llm(JudgeConfig(backend=f"transformers:{folder}", device="cpu", max_items_per_forward=3))
    assert backend.model_id.startswith(f"transformers:{folder.name}@")
    cached = backend.score(items, CRITERIA, "")
    backend.mode = "flat"
    flat = backend.score(items, CRITERIA, "")
    reference = reference_scores(backend, items, CRITERIA)
    assert len(cached) == len(items) and all(len(row) == len(CRITERIA) for row in cached)
    tolerance = score_tolerance(backend, items)
    for row_c, row_f, row_r in zip(cached, flat, reference):
        assert row_c == pytest.approx(row_r, abs=tolerance)
        assert row_f == pytest.approx(row_r, abs=tolerance)
    values = [v for row in cached for v in row]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert max(values) - min(values) > 0.05  # continuous scores that depend on the prompt


def test_packed_suffixes_equal_the_cache_per_criterion_and_the_reference(tiny_llama, items):
    """The default path packs an item's criterion suffixes into one row behind its prefix with a
    block-causal mask, through the pruned forward for this Llama; it must score what the transformers
    forward of the same packed row scores (under sdpa and eager attention), what one row per criterion
    over a repeated cache scores (the path kept for attention kernels without 4D masks), and the
    one-prompt reference, and an item alone as within any request."""
    backend = load_llm(JudgeConfig(backend=f"transformers:{tiny_llama}", device="cpu"))
    assert backend.packs_suffixes and backend.pruned is not None
    tolerance = score_tolerance(backend, items)
    reference = reference_scores(backend, items, CRITERIA)
    pruned = backend.score(items, CRITERIA, "")
    assert [backend.score([item], CRITERIA, "")[0] for item in items] == pruned  # bitwise: one item per forward
    backend.pruned = None
    packed = backend.score(items, CRITERIA, "")
    assert [backend.score([item], CRITERIA, "")[0] for item in items] == packed
    backend.model.set_attn_implementation("eager")
    eager = backend.score(items, CRITERIA, "")
    backend.packs_suffixes = False
    per_criterion = backend.score(items, CRITERIA, "")
    for rows in (pruned, packed, eager, per_criterion):
        for row, row_r in zip(rows, reference):
            assert row == pytest.approx(row_r, abs=tolerance)


def test_good_answer_no_is_the_complement(tiny_llama, items):
    backend = load_llm(JudgeConfig(backend=f"transformers:{tiny_llama}", device="cpu"))
    question = "Does the output mention an entity that is not in the query?"
    yes_good = Criterion("a", "llm", 1.0, question=question)
    no_good = Criterion("b", "llm", 1.0, question=question, good_answer="no")
    rows = backend.score(items[:3], [yes_good, no_good], "")
    for a, b in rows:
        # p and 1 - p from the same float64 log-probs: a float64 subtraction, exact to ~1e-16.
        assert a + b == pytest.approx(1.0, abs=1e-6)


def test_chat_template_prompts(tmp_path):
    folder = build_tiny_causal_lm(tmp_path / "chat", chat_template=SIMPLE_CHAT_TEMPLATE, seed=3)
    backend = load_llm(JudgeConfig(backend=f"transformers:{folder}", device="cpu"))
    item = JudgeItem.make("VTSAX fees", "What are the VTSAX fees?", ["VTSAX charges 0.04%."])
    prefix = backend.encoder.prefix_text(item, "")
    suffix = backend.encoder.suffix_text(CRITERIA[0])
    assert prefix.startswith("<s><|user|>\n") and "User query: VTSAX fees" in prefix
    assert suffix.endswith("Answer:</s>\n<|assistant|>\n")
    cached = backend.score([item], CRITERIA, "")
    tolerance = score_tolerance(backend, [item])
    assert cached == [pytest.approx(r, abs=tolerance) for r in reference_scores(backend, [item], CRITERIA)]
    with pytest.raises(ConfigError, match="use_chat_template=true but the judge tokenizer has no chat template"):
        load_llm(JudgeConfig(backend=f"transformers:{build_tiny_causal_lm(tmp_path / 'plain')}",
                             use_chat_template="true"))


def test_generate_mode_parses_or_fails_loudly(tiny_llama, items):
    backend = load_llm(JudgeConfig(backend=f"transformers:{tiny_llama}", device="cpu", llm_mode="generate"))
    encoded = backend.encoder.encode(items[:3], CRITERIA, "")
    answers = backend.generate_answers(encoded, CRITERIA)
    assert len(answers) == 3
    parsed = [v for row in answers for v in row]
    assert all(v is None or 0.0 <= v <= 1.0 for v in parsed)
    if any(v is None for v in parsed):  # a random model rarely answers in format: never a silent 0
        with pytest.raises(RewardError, match="could not be parsed"):
            backend.score(items[:3], CRITERIA, "")


def test_prompt_longer_than_the_model_is_rejected(tmp_path):
    folder = build_tiny_causal_lm(tmp_path / "short", max_positions=64)
    backend = load_llm(JudgeConfig(backend=f"transformers:{folder}", device="cpu"))
    with pytest.raises(InvalidArgument, match=r"items\[0\]: judge prompt is \d+ tokens, the judge model takes at most 64"):
        backend.score([JudgeItem.make("q", "o")], CRITERIA, "")


def test_shared_prompt_and_score_code():
    item = JudgeItem.make("vtsax fees", "VTSAX fees?", ["a " * 400, "second doc", "third"])
    prefix = prompts.item_prefix(item, "Grade it.", prompts.PromptOptions(max_docs=2, max_doc_chars=20))
    assert prefix.startswith("Grade it.\n\nUser query: vtsax fees\nAgent output: VTSAX fees?\n")
    assert "[1] a a a a a a a a a a ...\n[2] second doc\n\n" in prefix and "third" not in prefix
    assert prompts.criterion_suffix(CRITERIA[0]).endswith("Answer yes or no.\nAnswer:")
    assert "from 1 (worst) to 5 (best)" in prompts.criterion_suffix(CRITERIA[2])

    tokens = prompts.AnswerTokens(yes=(10, 11), no=(20,), digits=((1,), (2,), (3,), (4,), (5,)))
    sparse = {10: math.log(0.2), 11: math.log(0.1), 20: math.log(0.1), 99: math.log(0.6)}
    assert prompts.score_from_logprob_map(CRITERIA[0], sparse, tokens) == pytest.approx(0.75)
    assert prompts.score_from_logprob_map(CRITERIA[1], sparse, tokens) == pytest.approx(0.25)
    likert = {1: math.log(0.1), 3: math.log(0.2), 5: math.log(0.2)}  # E = (0.1 + 0.6 + 1.0) / 0.5 = 3.4
    assert prompts.score_from_logprob_map(CRITERIA[2], likert, tokens) == pytest.approx((3.4 - 1) / 4)
    with pytest.raises(ValueError, match="no probability on 'yes' or 'no'"):
        prompts.score_from_logprob_map(CRITERIA[0], {99: 0.0}, tokens)

    assert prompts.parse_answer(CRITERIA[0], " Yes, it does") == 1.0
    assert prompts.parse_answer(CRITERIA[1], "yes") == 0.0
    assert prompts.parse_answer(CRITERIA[2], " 4 out of 5") == 0.75
    assert prompts.parse_answer(CRITERIA[0], "maybe") is None
    assert prompts.parse_answer(CRITERIA[2], "yes") is None


def test_answer_tokens_need_single_token_answers():
    vocab = {"yes": [5], " yes": [6], "no": [7], " no": [7], "1": [1], "2": [2], "3": [3], "4": [4], "5": [9]}
    tokens = prompts.answer_tokens(lambda s: vocab.get(s, [0, 0]))
    assert tokens.yes == (5, 6) and tokens.no == (7,) and tokens.digits[4] == (9,)
    with pytest.raises(ConfigError, match=r"no single-token spelling of \['no'\]"):
        prompts.answer_tokens(lambda s: vocab.get(s, [0, 0]) if "no" not in s.lower() else [1, 2])


def test_specs_model_ids_and_missing_vllm(tiny_llama, tmp_path):
    assert parse_spec("programmatic").backend == "programmatic"
    assert parse_spec("transformers:/m/judge").model_path == "/m/judge"
    for bad, message in [("openai:gpt", "backend must be one of"), ("transformers", "needs a model folder"),
                         ("programmatic:/x", "takes no model path")]:
        with pytest.raises(ConfigError, match=message):
            parse_spec(bad)
    same = build_tiny_causal_lm(tmp_path / "same", seed=1)
    other = build_tiny_causal_lm(tmp_path / "other", seed=7)
    assert model_fingerprint(same) == model_fingerprint(tiny_llama)
    assert model_fingerprint(other) != model_fingerprint(tiny_llama)
    with pytest.raises(ConfigError, match="does not exist"):
        model_fingerprint(tmp_path / "nowhere")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"judge backend 'vllm' needs the vllm package.*calibrl\[gpu\]"):
            load_llm(JudgeConfig(backend=f"vllm:{tiny_llama}"))
    else:
        pytest.skip("vllm is installed here")
