"""The demo's tiny policies: tokenizer, warm-start data and training, loading by path."""

from __future__ import annotations

import pathlib
import random
from dataclasses import replace

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
    trajectories = pol.search_examples(domain, search_many, pol.AgentTeacher(), seed=0)
    assert len(calls) == 3  # first searches, second searches (read from the first), then the observations
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
    assert trajectories and all(sum(trained for _, trained in e.pieces) == 3 for e in trajectories)
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


def test_the_teacher_reads_what_it_retrieved_and_makes_near_miss_searches(domain: Domain) -> None:
    """Careless queries leave out the plan's industry word or the fund's style word; the second
    query names the fund the observed passage names; the answer is the value the observed passage
    states; value-swapped copies state another value and answer it, with made-up family words;
    only training questions; the tokenizer reads no validation or test text."""
    from calibrl.demo import search_domain as sd

    search_many, _ = fake_search_many(domain)
    teacher = pol.AgentTeacher(careless_first=0.5, careless_second=0.5, value_swaps=1)
    plans = pol.reference_trajectories(domain, search_many, teacher, seed=0)
    train = {t.question: t for t in domain.multistep("train")}
    assert {p.question for p in plans} <= set(train)
    passages = {x.doc_id: x.text for x in domain.passages}
    facts = {f.doc_id: f for f in domain.facts}
    read = [p for p in plans if not p.rewritten]
    assert len(read) > 0.9 * len(train)
    careless_first = careless_second = 0
    for plan in read:
        task = train[plan.question]
        link = domain.search_links[task.gold_doc_ids[0]]
        (_, first), (_, second) = plan.steps
        assert first in (sd.first_query(link), sd.first_query(link, careless=True))
        careless_first += first != sd.first_query(link)
        seen = domain.search_links[search_many([first])[0][0].doc_id]  # the plan the first observation names
        assert seen.fund.name.split()[0] in second
        careless_second += seen.fund.name not in second
        observed = facts[search_many([second])[0][0].doc_id]
        assert plan.answer == observed.value and plan.answer in passages[observed.doc_id]
    assert 0.35 < careless_first / len(read) < 0.65 and 0.35 < careless_second / len(read) < 0.65
    wrong = sum(p.answer != train[p.question].answers[0] for p in read)
    assert 0.2 < wrong / len(read) < 0.8  # reading a near miss answers its value
    swapped = [p for p in plans if p.rewritten]
    assert len(swapped) == len(read)
    for plan in swapped:
        (doc_id, text), = plan.rewritten
        assert text != passages[doc_id] and plan.answer in text and plan.answer in plan.evidence
    examples = pol.search_examples(domain, search_many, teacher, seed=0)
    assert len(examples) == len(plans)
    corpus = " ".join(pol.tokenizer_corpus(domain, []))  # the domain's part (this fake search may show any passage)
    held_out = {w for t in domain.multistep_tasks if t.split != "train"
                for w in (domain.search_links[t.gold_doc_ids[0]].plan.name.split()[0],
                          domain.search_links[t.gold_doc_ids[0]].fund.name.split()[0])}
    assert held_out and not {w for w in held_out if w in corpus}
    names = {w.lower() for e in (*domain.entities, *domain.search_entities) for w in e.name.split()}
    for plan, example in zip(plans, examples):
        answer_turn = example.pieces[-1][0]
        assert f"It says {pol._rename(plan.evidence, plan.renamed)}." in answer_turn
        # every demonstration, the original as well as its value swaps, renames the family words with
        # made-up words spelled as the domain's (never one of its names) in every piece
        link = domain.search_links[train[plan.question].gold_doc_ids[0]]
        assert [old for old, _ in plan.renamed] == [link.plan.name.split()[0], link.fund.name.split()[0]]
        assert all(new in sd.name_words() and new.lower() not in names for _, new in plan.renamed)
        whole = "".join(piece for piece, _ in example.pieces)
        assert all(old not in whole and new in whole for old, new in plan.renamed)
        assert f"<answer> {plan.answer} </answer>" in answer_turn
        if plan.rewritten:  # the swapped value
            (doc_id, text), = plan.rewritten
            shown = pol._rename(text, plan.renamed)
            assert shown in example.pieces[-2][0] and passages[doc_id] not in example.pieces[-2][0]


def test_fresh_values_leave_no_demonstration_stating_its_passages_own_value(domain: Domain) -> None:
    """With ``fresh_values`` every question still gets 1 + value_swaps demonstrations, and each
    answers a value its training passage does not state (read from a rewritten passage), so no
    training answer can be recalled from the warm start."""
    search_many, _ = fake_search_many(domain)
    plain = pol.reference_trajectories(domain, search_many, pol.AgentTeacher(value_swaps=1), seed=0)
    fresh = pol.reference_trajectories(domain, search_many, pol.AgentTeacher(value_swaps=1, fresh_values=True), seed=0)
    assert len(fresh) == len(plain)
    passages = {x.doc_id: x.text for x in domain.passages}
    assert sum(not p.rewritten for p in plain) > 0.9 * len(plain) / 2  # the plain teacher keeps the originals
    for plan in fresh:
        (doc_id, text), = plan.rewritten
        assert plan.answer in text and plan.answer not in passages[doc_id]


def test_a_held_out_passage_is_tokenised_as_a_training_one(domain: Domain, examples) -> None:
    """The tokenizer is trained on training text only; no piece of it may be one training
    entity's own (a training ticker once became one token while a held-out one split into
    letters): a held-out plan's and fund's passages take as many tokens as a training plan's
    and fund's renamed to the same industry and style words."""
    from dataclasses import replace

    from calibrl.demo import search_domain as sd

    rewrites, trajectories = examples
    tokenizer = pol.train_tokenizer(pol.tokenizer_corpus(domain, rewrites + trajectories), pol.PolicySpec().vocab_size)

    def size(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    def like(entity, other):  # ``entity``'s family word (and all else of it) with ``other``'s other words
        return replace(entity, name=" ".join([entity.name.split()[0], *other.name.split()[1:]]))

    links = {}
    for task in domain.multistep_tasks:
        links.setdefault(task.split, []).append(domain.search_links[task.gold_doc_ids[0]])
    train = links["train"][::37]
    compared = 0
    for split in ("validation", "heldout"):
        for held in links[split][::23]:
            for n, ours in enumerate(train):
                plan, fund = like(ours.plan, held.plan), like(ours.fund, held.fund)
                assert size(sd.bridge_text(held.plan, held.fund)) == size(sd.bridge_text(plan, fund))
                for aspect in sd.SEARCH_ASPECTS:
                    value = sd.search_values(aspect.key)[n]
                    assert size(sd.fact_text(held.fund, aspect, value)) == size(sd.fact_text(fund, aspect, value))
                compared += 1
    assert compared >= 50


def test_tokenizer_keeps_tags_and_prompt_constants_whole(tokenizer) -> None:
    for tag in pol.SEARCH_TAGS:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    for constant in pol.prompt_constants():
        assert len(tokenizer(constant, add_special_tokens=False)["input_ids"]) == 1, constant
    text = "What is the expense ratio of Evergreen Growth Fund (EVGRX)? 0.12% $1,000"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    # digits one by one (copying a number is a look-up per digit)
    ids = tokenizer(" $12,345", add_special_tokens=False)["input_ids"]
    assert all(len(tokenizer.decode([i]).strip()) <= 1 for i in ids)


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


def test_the_agent_takes_its_own_shape_and_the_rewriter_the_demos(domain: Domain, tmp_path: pathlib.Path,
                                                                    one_thread) -> None:
    """The two warm starts share one tokenizer; the agent is sized by a design's
    ``agent_spec``, the rewriter by ``spec``, and each saved model is the one a warm start
    of that spec alone gives, bit for bit."""
    import torch
    from safetensors.torch import load_file

    search_many, _ = fake_search_many(domain)
    spec = pol.PolicySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=512)
    agent_spec = replace(spec, hidden_size=48, intermediate_size=96)
    bases = pol.build_base_policies(domain, tmp_path / "both", search_many, spec=spec, agent_spec=agent_spec,
                                    rewriter_steps=6, agent_steps=4, rewrite_count=120,
                                    teacher=pol.AgentTeacher(), seed=3, progress=False)
    assert saved_hidden_size(bases.agent) == 48 and saved_hidden_size(bases.rewriter) == 32
    rewrites = pol.rewrite_examples(domain, 120, pol.RewriteMix(), 3)
    trajectories = pol.search_examples(domain, search_many, pol.AgentTeacher(), 3)
    tokenizer = pol.train_tokenizer(pol.tokenizer_corpus(domain, rewrites + trajectories), spec.vocab_size)
    alone = pol._warm_start_and_save(tmp_path / "agent_alone", tokenizer, agent_spec, trajectories, 4, 8, 3)
    assert alone.losses == bases.agent_result.losses
    saved, again = (load_file(str(folder / "model.safetensors")) for folder in (bases.agent, tmp_path / "agent_alone"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[name], again[name]) for name in saved)
    with pytest.raises(ValueError, match="warm_threads=0: must be >= 1"):
        pol.build_base_policies(domain, tmp_path / "none", search_many, warm_threads=0)


@pytest.mark.slow  # two warm starts at the full demo's sizes: about 30 s
def test_the_warm_starts_on_two_threads_are_the_models_of_one_thread(domain: Domain, tmp_path: pathlib.Path,
                                                                       one_thread) -> None:
    """`calibrl demo` runs both warm starts one after the other on two threads: at the full
    demo's own model sizes (the rewriter's and the search design's agent, large enough that
    torch splits their kernels across threads), both saved models and the losses must be bit
    for bit those of one thread, and the process keeps its thread count."""
    import torch
    from safetensors.torch import load_file

    from calibrl.demo.settings import FULL

    search_many, _ = fake_search_many(domain)
    runs = {}
    for threads in (None, 2):
        runs[threads] = pol.build_base_policies(domain, tmp_path / f"threads_{threads}", search_many,
                                                agent_spec=FULL.search.agent_spec(), rewriter_steps=3,
                                                agent_steps=3, rewrite_count=120, teacher=pol.AgentTeacher(),
                                                seed=5, progress=False, warm_threads=threads)
        assert torch.get_num_threads() == 1
    for kind in ("rewriter", "agent"):
        one = load_file(str(getattr(runs[None], kind) / "model.safetensors"))
        two = load_file(str(getattr(runs[2], kind) / "model.safetensors"))
        assert one.keys() == two.keys()
        for name in one:
            assert torch.equal(one[name], two[name]), (kind, name)
        assert getattr(runs[2], f"{kind}_result").losses == getattr(runs[None], f"{kind}_result").losses


def saved_hidden_size(folder: pathlib.Path) -> int:
    """The hidden size a saved policy folder declares."""
    import json

    return json.loads((folder / "config.json").read_text())["hidden_size"]
