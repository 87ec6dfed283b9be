"""Generation engines and rollouts: sampling, stops, masks, segments, groups, observations."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calibrl.errors import ConfigError, InvalidArgument  # noqa: E402
from calibrl.testing import build_model, build_tokenizer  # noqa: E402
from calibrl.trainer.aio import BackgroundLoop  # noqa: E402
from calibrl.trainer.engines import (  # noqa: E402
    TransformersEngine,
    VLLMEngine,
    make_engine,
    sample_next_token,
    top_p_filter,
    truncate_completion,
)
from calibrl.trainer.policy import Policy  # noqa: E402
from calibrl.testing.logprobs import sequence_logprobs  # noqa: E402
from calibrl.trainer.kinds.rewrite import RewriteRollout  # noqa: E402
from calibrl.trainer.kinds.search.records import SearchRollout
from calibrl.trainer.rollout import assemble_rows, decode_completion
from calibrl.trainer.kinds.rewrite import rollout_rewrites
from calibrl.trainer.kinds.search.rollout import rollout_search, search_prompt_ids
from calibrl.trainer.search_format import OBSERVATION_PREFIX, THINK_OPEN, parse_turn  # noqa: E402
from calibrl.trainer.tasks import Task  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture()
def policy(tokenizer):
    return Policy(model=build_model(tokenizer), tokenizer=tokenizer, device=torch.device("cpu"), model_id="tiny")


def _prompts(tokenizer):
    texts = ["hello", "The Eiffel Tower is in Paris, the capital of", "Question: who wrote Dune?"]
    return [tokenizer(t)["input_ids"] for t in texts]


# --------------------------------------------------------------------------- engines


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_left_padded_batch_equals_one_prompt_at_a_time(tokenizer, arch):
    policy = Policy(build_model(tokenizer, arch=arch), tokenizer, torch.device("cpu"), arch)
    engine = TransformersEngine(policy)
    prompts = _prompts(tokenizer)
    batched = engine.generate(prompts, max_new_tokens=12, temperature=0.0, top_p=1.0)
    alone = [engine.generate([p], max_new_tokens=12, temperature=0.0, top_p=1.0)[0] for p in prompts]
    assert batched == alone
    assert all(len(c) == 12 for c in batched)
    chunked = TransformersEngine(policy, max_batch_size=2).generate(prompts, max_new_tokens=12, temperature=0.0, top_p=1.0)
    assert chunked == batched


def test_greedy_continuation_matches_argmax_of_the_full_forward(policy, tokenizer):
    engine = TransformersEngine(policy)
    prompt = _prompts(tokenizer)[1]
    completion = engine.generate([prompt], max_new_tokens=6, temperature=0.0, top_p=1.0)[0]
    sequence = prompt + completion
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([sequence])).logits[0]
    expected = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert completion == expected


def test_stop_strings_cut_at_the_first_completing_token(policy, tokenizer):
    engine = TransformersEngine(policy)
    prompt = _prompts(tokenizer)[2]
    free = engine.generate([prompt], max_new_tokens=24, temperature=0.0, top_p=1.0)[0]
    text = tokenizer.decode(free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    stopped = engine.generate([prompt], max_new_tokens=24, temperature=0.0, top_p=1.0, stop_strings=[stop])[0]
    end = next(n for n in range(1, len(free) + 1) if stop in tokenizer.decode(free[:n]))
    assert stopped == free[:end]
    assert stop in tokenizer.decode(stopped) and stop not in tokenizer.decode(stopped[:-1])
    assert truncate_completion(free, tokenizer, stop_strings=[stop]) == stopped


def test_eos_ends_a_completion_and_is_kept(policy, tokenizer):
    engine = TransformersEngine(policy)
    prompt = _prompts(tokenizer)[0]
    free = engine.generate([prompt], max_new_tokens=16, temperature=0.0, top_p=1.0)[0]
    chosen_eos = free[5]
    policy.model.generation_config.eos_token_id = [tokenizer.eos_token_id, chosen_eos]
    stopped = TransformersEngine(policy).generate([prompt], max_new_tokens=16, temperature=0.0, top_p=1.0)[0]
    first = free.index(chosen_eos)
    assert stopped == free[: first + 1]
    assert truncate_completion(free, tokenizer, eos_ids=frozenset({chosen_eos})) == stopped


def test_seeded_sampling_is_reproducible(policy, tokenizer):
    engine = TransformersEngine(policy)
    prompts = _prompts(tokenizer)
    first = engine.generate(prompts, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7)
    again = engine.generate(prompts, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7)
    other = engine.generate(prompts, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=8)
    assert first == again
    assert first != other


def test_generation_restores_train_mode_and_needs_no_grad(policy, tokenizer):
    policy.model.train()
    TransformersEngine(policy).generate(_prompts(tokenizer), max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert policy.model.training
    assert all(p.grad is None for p in policy.model.parameters())


def test_generation_input_is_validated(policy, tokenizer):
    engine = TransformersEngine(policy)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        engine.generate(_prompts(tokenizer), max_new_tokens=0, temperature=1.0, top_p=1.0)
    with pytest.raises(InvalidArgument, match="top_p"):
        engine.generate(_prompts(tokenizer), max_new_tokens=2, temperature=1.0, top_p=0.0)
    with pytest.raises(InvalidArgument, match=r"prompts_token_ids\[1\]"):
        engine.generate([[1, 2], []], max_new_tokens=2, temperature=1.0, top_p=1.0)
    with pytest.raises(InvalidArgument, match="context of 512"):
        engine.generate([[5] * 500], max_new_tokens=20, temperature=1.0, top_p=1.0)


def test_top_p_filter_matches_a_loop():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=generator) * 2
    for top_p in (0.05, 0.5, 0.9):
        filtered = top_p_filter(logits, top_p)
        for row in range(logits.shape[0]):
            probs = torch.softmax(logits[row], -1)
            order = torch.argsort(probs, descending=True).tolist()
            kept, mass = set(), 0.0
            for token in order:
                kept.add(token)
                mass += float(probs[token])
                if mass >= top_p:
                    break
            assert {t for t in range(30) if filtered[row, t] > float("-inf")} == kept
            assert torch.equal(filtered[row, sorted(kept)], logits[row, sorted(kept)])
    # A tiny nucleus is greedy.
    draws = sample_next_token(logits, temperature=1.0, top_p=1e-6, generator=generator)
    assert torch.equal(draws, logits.argmax(-1))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all -inf"])
def test_non_finite_logits_are_a_clear_error_not_a_draw(poison):
    from calibrl.errors import FailedPrecondition

    logits = torch.randn(3, 10)
    if poison == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 4] = poison
    logits[2, 0] = float("-inf")  # a masked token alone is fine
    for temperature in (0.0, 1.0):
        with pytest.raises(FailedPrecondition, match=r"NaN or infinite in rows \[1\] of 3.*precision=fp32"):
            sample_next_token(logits, temperature=temperature, top_p=0.9)
    assert sample_next_token(logits[[0, 2]], temperature=1.0, top_p=1.0).shape == (2,)


def test_a_policy_with_nan_weights_fails_generation_with_that_error(policy):
    from calibrl.errors import FailedPrecondition

    broken = build_model(policy.tokenizer)
    with torch.no_grad():
        broken.lm_head.weight[3, 0] = float("nan")
    engine = TransformersEngine(Policy(model=broken, tokenizer=policy.tokenizer, device=torch.device("cpu"),
                                       model_id="broken"))
    with pytest.raises(FailedPrecondition, match="logits are NaN"):
        engine.generate([[1, 5, 6]], max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)


def test_vllm_engine_without_vllm_is_a_clear_error(policy):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - only on GPU machines with the extra
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match=r"calibrl\[gpu\].*transformers"):
        make_engine("vllm", policy)
    with pytest.raises(ConfigError, match="vllm"):
        VLLMEngine("some/path")
    with pytest.raises(ConfigError, match="'beam' is not one of"):
        make_engine("beam", policy)
    assert isinstance(make_engine("transformers", policy, max_batch_size=4), TransformersEngine)


# --------------------------------------------------------------------------- assembly


def test_assemble_rows_masks_and_segments():
    rows = [
        [([1, 2, 3], False), ([4, 5], True), ([6, 7, 8], False), ([9], True)],
        [([1, 2], False), ([10, 11, 12], True)],
    ]
    out = assemble_rows(rows, pad_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 10, 11, 12, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1] * 9, [1] * 5 + [0] * 4]
    assert out["completion_mask"].tolist() == [
        [False, False, False, True, True, False, False, False, True],
        [False, False, True, True, True, False, False, False, False],
    ]
    assert out["segment_index"].tolist() == [[-1, -1, -1, 0, 0, -1, -1, -1, 1], [-1, -1, 0, 0, 0, -1, -1, -1, -1]]
    assert out["answer_mask"].tolist() == [
        [False] * 8 + [True],
        [False, False, True, True, True, False, False, False, False],
    ]


# --------------------------------------------------------------------------- rewriter


def _rewrite_tasks():
    return [
        Task(task_id="t1", kind="rewrite", query="where is the eiffel tower", gold_doc_ids=("eiffel",)),
        Task(task_id="t2", kind="rewrite", query="who made python", gold_doc_ids=("python",),
             context=(("domain", "software"),)),
    ]


def test_rewrite_rollouts_give_group_size_rows_per_task(policy, tokenizer):
    engine = TransformersEngine(policy)
    tasks = _rewrite_tasks()
    batch = rollout_rewrites(engine, tokenizer, tasks, group_size=3, max_new_tokens=8, temperature=1.0, seed=3)
    assert len(batch) == 6
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert [r.task.task_id for r in batch.rollouts] == ["t1"] * 3 + ["t2"] * 3
    assert all(isinstance(r, RewriteRollout) for r in batch.rollouts)
    assert not hasattr(batch, "old_logp")  # behaviour log-probs travel on the pending batch
    for row in range(len(batch)):
        prompt_length = batch.prompt_lengths[row]
        trained = batch.completion_mask[row]
        length = int(batch.attention_mask[row].sum())
        assert not trained[:prompt_length].any() and trained[prompt_length:length].all() and not trained[length:].any()
        completion = batch.input_ids[row][trained].tolist()
        assert 1 <= len(completion) <= 8
        assert batch.completion_texts[row] == decode_completion(tokenizer, completion)
        assert batch.rollouts[row].rewrite == batch.completion_texts[row].split("\n")[0].strip()
        assert torch.equal(batch.answer_mask[row], trained)
        assert set(batch.segment_index[row][trained].tolist()) == {0}
    prompt_text = tokenizer.decode(batch.input_ids[3][: batch.prompt_lengths[3]])
    assert "domain: software\nQuestion: who made python" in prompt_text
    # Same seed, same rollouts.
    again = rollout_rewrites(engine, tokenizer, tasks, group_size=3, max_new_tokens=8, temperature=1.0, seed=3)
    assert torch.equal(again.input_ids, batch.input_ids)
    # The batch feeds sequence_logprobs directly.
    with torch.no_grad():
        logp = sequence_logprobs(policy.model, batch.input_ids, batch.attention_mask)
    assert logp.shape == batch.input_ids.shape and bool((logp[batch.completion_mask] < 0).all())


def test_prompts_use_the_chat_template_when_there_is_one(tokenizer):
    chat = build_tokenizer()
    chat.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    task = SEARCH_TASKS[0]
    rendered = chat.decode(search_prompt_ids(chat, task))
    assert rendered.startswith("[user] Answer the question below.")
    assert rendered.endswith("Question: Where is the Eiffel Tower?\n\n[assistant] <think>")
    plain = chat.decode(search_prompt_ids(chat, task, chat_template=False))
    assert plain.startswith("<s>Answer the question below.") and plain.endswith("Eiffel Tower?\n<think>")
    with pytest.raises(InvalidArgument, match="chat_template"):
        search_prompt_ids(tokenizer, task, chat_template=True)


def test_rewrite_rollouts_reject_bad_input(policy, tokenizer):
    engine = TransformersEngine(policy)
    with pytest.raises(InvalidArgument, match="group_size"):
        rollout_rewrites(engine, tokenizer, _rewrite_tasks(), group_size=0, max_new_tokens=4)
    with pytest.raises(InvalidArgument, match=r"tasks\[0\].kind"):
        rollout_rewrites(engine, tokenizer, [Task("s", "search", "q", answers=("a",))], group_size=2, max_new_tokens=4)
    with pytest.raises(InvalidArgument, match="tasks"):
        rollout_rewrites(engine, tokenizer, [], group_size=2, max_new_tokens=4)


# --------------------------------------------------------------------------- search agent


class ScriptedEngine:
    """Returns fixed turn texts per rollout row, in order; records every call.

    The engine interface is what is under test here: the rollout must hand it the
    right contexts and assemble what it returns."""

    def __init__(self, tokenizer, scripts):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.turn = [0] * len(scripts)
        self.finished = [False] * len(scripts)
        self.calls: list[list[list[int]]] = []
        self.returned: dict[tuple[int, int], list[int]] = {}

    def generate(self, prompts_token_ids, *, max_new_tokens, temperature, top_p, stop_strings=(), seed=None):
        assert set(stop_strings) == {"</search>", "</answer>"}
        live = [r for r in range(len(self.scripts)) if not self.finished[r]]
        assert len(prompts_token_ids) == len(live)
        self.calls.append([list(p) for p in prompts_token_ids])
        out = []
        for row in live:
            text = self.scripts[row][self.turn[row]]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self.returned[(row, self.turn[row])] = ids
            self.turn[row] += 1
            if parse_turn(text).action != "search" or self.turn[row] == len(self.scripts[row]):
                self.finished[row] = True
            out.append(ids)
        return out

    def update_weights(self, model):
        pass


class RecordingRetrieval:
    """The RetrievalClient interface over a real in-process Retriever, recording calls."""

    def __init__(self, retriever):
        self.retriever = retriever
        self.calls = []

    async def score(self, items, top_k, mode=None, include_text=False):
        self.calls.append((list(items), top_k, include_text))
        return self.retriever.score(items, top_k, mode, include_text)

    async def search(self, queries, top_k, mode=None, include_text=False):
        return self.retriever.search(queries, top_k, mode, include_text)


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.testing import build_test_index

    index_dir = build_test_index(tmp_path_factory.mktemp("index"))
    return Retriever.load(index_dir, device="cpu")


@pytest.fixture(scope="module")
def background():
    with BackgroundLoop() as loop:
        yield loop


SEARCH_TASKS = [
    Task("q1", "search", "Where is the Eiffel Tower?", gold_doc_ids=("eiffel",), answers=("Paris",)),
    Task("q2", "search", "Who created Python?", gold_doc_ids=("python",), answers=("Guido van Rossum",)),
]
SCRIPTS = [
    # task q1, rollout 0: search, search, answer
    ["I should look it up.</think>\n<search> Eiffel Tower location </search>",
     " The tower is in Paris. Check the museum too.</think>\n<search> Louvre Paris museum </search>",
     " Both are in Paris.</think>\n<answer> Paris </answer>"],
    # task q1, rollout 1: answers at once
    ["I know this.</think>\n<answer> Paris </answer>"],
    # task q2, rollout 0: no action at all (ends the rollout)
    ["just rambling without any tags"],
    # task q2, rollout 1: searches on every turn, runs out of turns
    ["Look up.</think><search> Python programming language creator </search>",
     " Again.</think><search> Guido van Rossum </search>",
     " And again.</think><search> Rust language </search>"],
]


def test_search_rollout_masks_segments_and_observations(tokenizer, retriever, background):
    engine = ScriptedEngine(tokenizer, SCRIPTS)
    retrieval = RecordingRetrieval(retriever)
    batch = rollout_search(engine, tokenizer, SEARCH_TASKS, group_size=2, retrieval=retrieval,
                           run_async=background.run, max_turns=3, top_k=2, max_obs_tokens=400)
    assert len(batch) == 4 and batch.group_index.tolist() == [0, 0, 1, 1]
    assert all(isinstance(r, SearchRollout) for r in batch.rollouts)

    # One engine call per turn with the live rows only; one batched retrieval call per turn with searches.
    assert [len(call) for call in engine.calls] == [4, 2, 2]
    assert [len(items) for items, _, _ in retrieval.calls] == [2, 2]
    assert all(top_k == 2 and include_text for _, top_k, include_text in retrieval.calls)

    for row, script in enumerate(SCRIPTS):
        task = batch.rollouts[row].task
        prompt = search_prompt_ids(tokenizer, task)
        assert tokenizer.decode(prompt).endswith("Question: " + task.query + "\n" + THINK_OPEN)
        length = int(batch.attention_mask[row].sum())
        ids = batch.input_ids[row][:length].tolist()
        trained = batch.completion_mask[row][:length].tolist()
        segments = batch.segment_index[row][:length].tolist()
        assert ids[: len(prompt)] == prompt and not any(trained[: len(prompt)])
        assert not batch.completion_mask[row][length:].any() and (batch.segment_index[row][length:] == -1).all()

        # Walk the row: generated turn k is segment k and is exactly what the engine returned;
        # between turns lies an untrained observation ending with "<think>".
        position = len(prompt)
        turns = engine.turn[row]
        for k in range(turns):
            generated = engine.returned[(row, k)]
            end = position + len(generated)
            assert ids[position:end] == generated
            assert all(trained[position:end]) and set(segments[position:end]) == {k}
            position = end
            if position < length and not trained[position]:
                obs_end = position
                while obs_end < length and not trained[obs_end]:
                    obs_end += 1
                observation = tokenizer.decode(ids[position:obs_end])
                assert observation.startswith(OBSERVATION_PREFIX + "Doc 1(Title: ")
                assert observation.endswith("</information>\n\n<think>")
                assert all(s == -1 for s in segments[position:obs_end])
                # The engine saw the whole trajectory so far, ending with the observation's <think>.
                call = engine.calls[k + 1]
                assert ids[:obs_end] in call
                assert tokenizer.decode(ids[:obs_end]).endswith("<think>")
                position = obs_end
        assert position == length

        # The answer segment is the last generated turn.
        answer_positions = batch.answer_mask[row].nonzero().flatten().tolist()
        last_turn = engine.returned[(row, turns - 1)]
        assert answer_positions == list(range(length - len(last_turn), length))
        # Nothing trained ever decodes to an opening <think>: it is always prompt or observation.
        assert THINK_OPEN not in tokenizer.decode(batch.input_ids[row][batch.completion_mask[row]])

    searcher, knower, rambler, persistent = batch.rollouts
    assert searcher.answer == "Paris" and searcher.well_formed
    assert [s.query for s in searcher.steps] == ["Eiffel Tower location", "Louvre Paris museum"]
    assert [s.think for s in searcher.steps] == ["I should look it up.", "The tower is in Paris. Check the museum too."]
    assert searcher.steps[0].result.hits[0].doc_id == "eiffel" and searcher.steps[0].result.hit
    assert searcher.steps[0].result.hits[0].text.startswith("The Eiffel Tower")
    # Answering without a search breaks the format (CalibAdv rule 1: at least one search).
    assert knower.answer == "Paris" and not knower.well_formed and knower.steps == ()
    assert rambler.answer is None and not rambler.well_formed and rambler.steps == ()
    assert int(batch.segment_index[2].max()) == 0
    # The last turn's search is not executed: there is no turn left to read its result.
    assert persistent.answer is None and not persistent.well_formed and len(persistent.steps) == 2
    assert int(batch.segment_index[3].max()) == 2

    # Later searches tell the retrieval service what the rollout has already seen.
    second_turn_items = retrieval.calls[1][0]
    first_docs = tuple(searcher.steps[0].result.doc_ids)
    assert second_turn_items[0].seen_doc_ids == first_docs
    assert second_turn_items[0].gold_doc_ids == ("eiffel",) and second_turn_items[0].gold_answers == ("Paris",)
    assert searcher.steps[1].result.is_new == tuple(d not in first_docs for d in searcher.steps[1].result.doc_ids)

    # completion_texts hold the trajectory from the prompt's <think>, observations included.
    assert batch.completion_texts[1] == THINK_OPEN + SCRIPTS[1][0]
    assert batch.completion_texts[0].count("<information>") == 2


def test_observations_are_cut_to_max_obs_tokens(tokenizer, retriever, background):
    scripts = [["a</think><search> Eiffel Tower </search>", " b</think><answer> Paris </answer>"]]
    engine = ScriptedEngine(tokenizer, scripts)
    batch = rollout_search(engine, tokenizer, SEARCH_TASKS[:1], group_size=1, retrieval=RecordingRetrieval(retriever),
                           run_async=background.run, max_turns=2, top_k=3, max_obs_tokens=5)
    observation = [t for t, m in zip(batch.input_ids[0].tolist(), batch.completion_mask[0].tolist()) if not m]
    observation = observation[len(search_prompt_ids(tokenizer, SEARCH_TASKS[0])):]
    text = tokenizer.decode(observation)
    assert text.startswith("\n\n<information>") and text.endswith("</information>\n\n<think>")
    inner = text[len("\n\n<information>") : -len("</information>\n\n<think>")]
    assert 0 < len(tokenizer(inner, add_special_tokens=False)["input_ids"]) <= 6
    assert batch.rollouts[0].well_formed


def test_search_rollout_with_the_real_engine(policy, tokenizer, retriever, background):
    """A random tiny model rarely closes an action: the invariants must hold anyway."""
    engine = TransformersEngine(policy)
    batch = rollout_search(engine, tokenizer, SEARCH_TASKS, group_size=3, retrieval=RecordingRetrieval(retriever),
                           run_async=background.run, max_turns=2, max_new_tokens_per_turn=10, max_obs_tokens=64,
                           seed=0)
    assert len(batch) == 6 and batch.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(batch.completion_mask, batch.segment_index >= 0)
    last = batch.segment_index.max(dim=1, keepdim=True).values
    assert torch.equal(batch.answer_mask, batch.completion_mask & (batch.segment_index == last))
    assert bool((batch.completion_mask.sum(1) >= 1).all())
    for row, rollout in enumerate(batch.rollouts):
        assert isinstance(rollout, SearchRollout)
        assert batch.completion_texts[row].startswith(THINK_OPEN)
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids)


def test_search_rollout_rejects_bad_settings(policy, tokenizer, retriever, background):
    engine = TransformersEngine(policy)
    retrieval = RecordingRetrieval(retriever)
    with pytest.raises(InvalidArgument, match="max_turns"):
        rollout_search(engine, tokenizer, SEARCH_TASKS, group_size=2, retrieval=retrieval, run_async=background.run,
                       max_turns=0)
    with pytest.raises(InvalidArgument, match="over the model's context of 512"):
        rollout_search(engine, tokenizer, SEARCH_TASKS, group_size=2, retrieval=retrieval, run_async=background.run,
                       max_turns=4, max_new_tokens_per_turn=64, max_obs_tokens=256)
    with pytest.raises(InvalidArgument, match=r"tasks\[0\].kind"):
        rollout_search(engine, tokenizer, _rewrite_tasks(), group_size=2, retrieval=retrieval,
                       run_async=background.run)
    assert retrieval.calls == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_repeated_prompt_is_prefilled_once_and_samples_the_same(tokenizer, arch):
    policy = Policy(build_model(tokenizer, arch=arch), tokenizer, torch.device("cpu"), arch)
    prompts = _prompts(tokenizer)
    batch = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[1], prompts[0]]
    widths = []
    hook = policy.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        shared = TransformersEngine(policy, share_prompts=True)
        greedy = shared.generate(batch, max_new_tokens=10, temperature=0.0, top_p=1.0)
        assert widths[0] == (3, max(map(len, prompts)))  # the prefill ran three distinct prompts
        assert all(shape == (6, 1) for shape in widths[1:])  # then every row decodes
        widths.clear()
        plain = TransformersEngine(policy).generate(batch, max_new_tokens=10, temperature=0.0, top_p=1.0)
        assert widths[0][0] == 6
    finally:
        hook.remove()
    # The tiny model's logits are spread (no greedy near-ties), so rounding never flips an argmax here.
    assert greedy == plain
    sampled = [shared.generate(batch, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5) for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert sampled[0] == TransformersEngine(policy).generate(batch, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5)
