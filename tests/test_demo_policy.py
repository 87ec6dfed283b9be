"""The demo's tiny policies: tokenizer, warm-start data and training, loading by path."""

from __future__ import annotations

import pathlib
import random

import pytest

from calibrl.demo import policy as pol
from calibrl.demo.domain import Domain, generate_domain
from calibrl.api.retrieval import Hit


@pytest.fixture(scope="module")
def domain() -> Domain:
    return generate_domain(0)


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread, above all on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fake_search_many(domain: Domain):
    """Observations for the reference searches: passages that share the most words
    with the query (a stand-in for the retrieval service, counted per call)."""
    calls: list[int] = []

    def search_many(queries):
        calls.append(len(queries))
        results = []
        for query in queries:
            words = set(query.lower().split())
            ranked = sorted(domain.passages, key=lambda p: -len(words & set(f"{p.title} {p.text}".lower().split())))
            results.append([Hit(p.doc_id, p.title, 1.0, rank, p.text) for rank, p in enumerate(ranked[:2], 1)])
        return results

    return search_many, calls


@pytest.fixture(scope="module")
def examples(domain: Domain):
    search_many, calls = fake_search_many(domain)
    rewrites = pol.rewrite_examples(domain, 400, seed=0)
    trajectories = pol.search_examples(domain, search_many, pol.AgentTeacher(single_hop=20, shortcut_share=0.5),
                                       seed=0)
    assert len(calls) == 1  # one batched call for every reference search
    return rewrites, trajectories


@pytest.fixture(scope="module")
def tokenizer(domain: Domain, examples):
    rewrites, trajectories = examples
    return pol.train_tokenizer(pol.tokenizer_corpus(domain, rewrites + trajectories), vocab_size=1024)


def test_rewrite_targets_mostly_copy_and_never_use_heldout_pairs(domain: Domain, examples) -> None:
    rewrites, _ = examples
    heldout_queries = {t.query for t in domain.tasks("heldout")}
    copies = 0
    for example in rewrites:
        (prompt, trained_prompt), (target, trained_target) = example.pieces
        assert not trained_prompt and trained_target
        query = prompt.split("Question: ", 1)[1].rsplit("\nSearch query:", 1)[0]
        assert query not in heldout_queries or any(query == t.query for t in domain.tasks("train"))
        copies += target.strip() == query
    assert 0.7 < copies / len(rewrites) < 0.95
    heldout_names = {(t.entity_key, t.aspect_key) for t in domain.tasks("heldout")}
    assert heldout_names  # and the generator draws only training pairs:
    drawn = {(t.entity_key, t.aspect_key) for t in domain.tasks("train")}
    assert not heldout_names & drawn


def test_search_trajectories_follow_the_search_r1_format(examples) -> None:
    from calibrl.trainer.search_format import is_well_formed, parse_turn

    _, trajectories = examples
    two_search = [e for e in trajectories if sum(trained for _, trained in e.pieces) == 3]
    assert two_search and len(two_search) < len(trajectories)
    for example in trajectories:
        prompt = example.pieces[0][0]
        assert prompt.endswith("<think>") and not example.pieces[0][1]
        generated = [text for text, trained in example.pieces if trained]
        observations = [text for text, trained in example.pieces[1:] if not trained]
        assert all(o.startswith("\n\n<information>") and o.endswith("</information>\n\n<think>") for o in observations)
        turns = [parse_turn(text) for text in generated]
        assert [t.action for t in turns] == ["search"] * (len(turns) - 1) + ["answer"]
        assert all(t.well_formed for t in turns)
        trajectory = "<think>" + "".join(text for text, _ in example.pieces[1:])
        assert is_well_formed(trajectory)


def test_the_teacher_swaps_values_and_makes_the_careless_second_search(domain: Domain) -> None:
    """Value-swapped copies state another value in the answer passage and answer it (the
    answer must be read, not recalled); careless plans search the question's entity again
    and guess; verbose plans answer with the quoted phrase; no plan asks a held-out question."""
    teacher = pol.AgentTeacher(single_hop=40, value_swaps=1, shortcut_share=0.5, verbose_share=0.5)
    plans = pol.reference_trajectories(domain, teacher, seed=0)
    train = {t.question: t for t in domain.multistep("train")}
    assert not {p.question for p in plans} & {t.question for t in domain.multistep("heldout")}
    # no plan searches for a held-out answer document nor shows it with another value
    heldout = domain.multistep("heldout")
    assert not {q for p in plans for _, q in p.steps} & {t.steps[1].query for t in heldout}
    assert not {doc for p in plans for doc, _ in p.rewritten} & {t.gold_doc_ids[1] for t in heldout}
    two_search = [p for p in plans if p.question in train and not p.rewritten]
    careless = [p for p in two_search if p.steps[1][1] == train[p.question].shortcut_query]
    assert len(two_search) == len(train) and 0.35 < len(careless) / len(two_search) < 0.65
    careful = [p for p in two_search if p not in careless]
    assert all(p.steps == tuple((s.think, s.query) for s in train[p.question].steps) for p in careful)
    assert all(p.answer == train[p.question].answers[0] for p in careful)
    swapped = [p for p in plans if p.rewritten]
    assert len(swapped) == len(careful) + 40  # one copy of each careful plan
    passages = {x.doc_id: x.text for x in domain.passages}
    for plan in swapped:
        (doc_id, text), = plan.rewritten
        assert text != passages[doc_id] and plan.answer in text
    # the observations show the swapped text in place of the corpus text (examples follow the plans' order)
    search_many, _ = fake_search_many(domain)
    examples = pol.search_examples(domain, search_many, teacher, seed=0)
    assert len(examples) == len(plans)
    shown = 0
    for plan, example in zip(plans, examples):
        if not plan.rewritten:
            continue
        (doc_id, text), = plan.rewritten
        last_observation = example.pieces[-2][0]
        if passages[doc_id] in last_observation or text in last_observation:
            assert text in last_observation and passages[doc_id] not in last_observation
            shown += 1
    assert shown > len(swapped) // 2
    # every careful plan quotes its evidence before answering; verbose ones answer with the whole quote
    verbose = 0
    for plan, example in zip(plans, examples):
        answer_turn = example.pieces[-1][0]
        if plan.evidence:
            assert plan.answer in plan.evidence and f"It says {plan.evidence}." in answer_turn
            assert f"<answer> {plan.evidence if plan.verbose else plan.answer} </answer>" in answer_turn
            verbose += plan.verbose
        else:  # a careless plan guesses
            assert f"The answer is {plan.answer}." in answer_turn and not plan.verbose
    assert 0.35 < verbose / sum(1 for p in plans if p.evidence) < 0.65


def test_tokenizer_keeps_tags_and_prompt_constants_whole(tokenizer) -> None:
    for tag in pol.SEARCH_TAGS:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    for constant in pol.prompt_constants():
        assert len(tokenizer(constant, add_special_tokens=False)["input_ids"]) == 1, constant
    text = "What is the expense ratio of Evergreen Growth Fund (EVGRX)? 0.12% $1,000"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_encoding_matches_the_rollout_prompt_and_masks_only_generated_tokens(tokenizer, examples) -> None:
    from calibrl.trainer.rollout import encode_prompt
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, fill_template

    rewrites, _ = examples
    example = rewrites[0]
    ids, trained = pol.encode_example(tokenizer, example)
    query = example.pieces[0][0].split("Question: ", 1)[1].rsplit("\nSearch query:", 1)[0]
    prompt_ids = encode_prompt(tokenizer, fill_template(REWRITE_TEMPLATE, query, pol.TASK_CONTEXT))
    assert ids[: len(prompt_ids)] == prompt_ids
    assert not any(trained[: len(prompt_ids)]) and all(trained[len(prompt_ids):])
    assert ids[-1] == tokenizer.eos_token_id


def test_warm_start_learns_and_saves_a_folder_the_trainer_loads(tokenizer, examples, tmp_path: pathlib.Path,
                                                                 one_thread) -> None:
    import torch

    from calibrl.trainer.engines import make_engine
    from calibrl.trainer.policy import load_policy
    from calibrl.trainer.kinds.rewrite import rollout_rewrites
    from calibrl.trainer.tasks import Task

    rewrites, _ = examples
    spec = pol.PolicySpec(hidden_size=48, num_layers=2, num_heads=4, intermediate_size=96, max_positions=512)
    model = pol.build_model(tokenizer, spec, seed=0)
    result = pol.warm_start(model, tokenizer, rewrites, steps=60, batch_size=16, lr=5e-3, progress=False)
    assert result.parameters == sum(p.numel() for p in model.parameters())
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    policy = load_policy(str(tmp_path), device="cpu")
    assert policy.tokenizer.eos_token_id == tokenizer.eos_token_id
    torch.testing.assert_close(policy.model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    task = Task("t", "rewrite", "Pine thing skim?", ("evergreen-expense-ratio",), context=pol.TASK_CONTEXT)
    batch = rollout_rewrites(make_engine("transformers", policy), policy.tokenizer, [task], group_size=2,
                             max_new_tokens=16, temperature=1.0, seed=0)
    assert len(batch.rollouts) == 2 and batch.completion_mask.any()


def test_rewrite_mix_is_a_distribution() -> None:
    names, weights = pol.RewriteMix().choices()
    # float64 sum of a handful of weights: error ~1e-16, 1e-9 is ample.
    assert len(set(names)) == len(names) and abs(sum(weights) - 1.0) < 1e-9
    assert max(zip(weights, names))[1] == "copy"
    rng = random.Random(0)
    assert rng.choices(names, weights)[0] in names


def test_the_rewriter_warm_started_beside_the_agent_is_the_model_trained_alone(domain: Domain, tmp_path: pathlib.Path,
                                                                                 one_thread) -> None:
    """`calibrl demo` warm-starts the rewriter in a spawned process while it warm-starts the
    agent: both saved models must be bit for bit those of the two warm starts one after another."""
    import torch
    from safetensors.torch import load_file

    search_many, _ = fake_search_many(domain)
    spec = pol.PolicySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=512)
    folders = {}
    for beside in (False, True):
        bases = pol.build_base_policies(domain, tmp_path / f"beside_{beside}", search_many, spec=spec,
                                        rewriter_steps=6, agent_steps=4, rewrite_count=120,
                                        teacher=pol.AgentTeacher(single_hop=5), seed=3, progress=False,
                                        rewriter_beside=beside)
        folders[beside] = bases
    for kind in ("rewriter", "agent"):
        alone = load_file(str(getattr(folders[False], kind) / "model.safetensors"))
        beside = load_file(str(getattr(folders[True], kind) / "model.safetensors"))
        assert alone.keys() == beside.keys()
        for name in alone:
            assert torch.equal(alone[name], beside[name]), (kind, name)  # exact: same kernels, seed and data
    assert folders[True].rewriter_result.losses == folders[False].rewriter_result.losses
