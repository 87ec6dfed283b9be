"""The demo's tiny policies, built here from nothing: tokenizer, models, warm start.

1. **Tokenizer**: byte-level BPE trained with the ``tokenizers`` library on the
   domain's passages, queries and reference trajectories; the Search-R1 tags are
   single special tokens, and so is the fixed text of the trainer's prompt templates
   (:func:`prompt_constants`). Saved as a ``PreTrainedTokenizerFast``.
2. **Models**: randomly initialised Llama-architecture causal LMs (:class:`PolicySpec`:
   3 layers, hidden 96, about 0.5 M parameters), so a warm start takes a minute or
   two on two CPU cores.
3. **Warm start** (supervised, loss on generated tokens only), two models from the
   same tokenizer: the *base rewriter* learns to copy the user query and now and
   then to name the product, add the topic's terms or a single catalogue word, or
   name a wrong product (:class:`RewriteMix`): a starting point that GRPO can improve
   or not, depending on the reward. The *base search agent* learns the Search-R1
   format from reference trajectories (two searches, copying the bridge entity out
   of the first observation, then the answer), with real observations from the
   retrieval service.

Each result is an ordinary Hugging Face model folder (``config.json``, weights,
``tokenizer.json``) that :func:`calibrl.trainer.policy.load_policy` loads by path.

Only training pairs are used: held-out (product, topic) pairs and held-out
two-search questions never appear in warm-start data.
"""

from __future__ import annotations

import math
import pathlib
import random
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

from calibrl.demo.domain import (
    ACCOUNT_ASPECTS,
    ACCOUNTS,
    DOMAIN_NAME,
    FAILURE_MODES,
    FUND_ASPECTS,
    FUNDS,
    Domain,
    Fact,
    RewriteTask,
    candidate_rewrite,
    user_query,
)
from calibrl.fileperms import honour_umask
from calibrl.tiny_lm import TinyLMSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from calibrl.demo.domain import Aspect
    from calibrl.demo.search_domain import Link

# The warm start uses the trainer's own prompt templates (calibrl.trainer.search_format), filled with
# the task context the trainer sends, so the base policy sees exactly the prompts of training.
TASK_CONTEXT = (("domain", DOMAIN_NAME),)

PAD, EOS = "<pad>", "</s>"
SEARCH_TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>",
               "</information>")

# queries -> per query, hits (objects with .title and .text) best first
class RetrievedPassage(Protocol):
    """A search hit as the warm start reads it (a ``calibrl.api.retrieval.Hit`` with its text)."""

    @property
    def doc_id(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def text(self) -> str: ...


SearchManyFn = Callable[[Sequence[str]], Sequence[Sequence[RetrievedPassage]]]


@dataclass(frozen=True)
class PolicySpec:
    """Size of the tiny policy."""

    vocab_size: int = 2048  # BPE merges target; the prompt constants are added on top
    hidden_size: int = 96
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 1024  # a three-turn search trajectory is under 700 tokens

    def lm_spec(self) -> TinyLMSpec:
        """The model's shape (full multi-head attention, tied embeddings, default init)."""
        return TinyLMSpec(arch="llama", hidden_size=self.hidden_size, num_layers=self.num_layers,
                          num_heads=self.num_heads, num_kv_heads=self.num_heads,
                          intermediate_size=self.intermediate_size, max_positions=self.max_positions,
                          tie_word_embeddings=True)


@dataclass(frozen=True)
class RewriteMix:
    """How often each move of :func:`calibrl.demo.domain.candidate_rewrite` is the
    warm-start target of a query (weights, normalised when drawn). The base rewriter
    mostly copies; it has seen the catalogue names and terms used, rarely."""

    copy: float = 0.82  # the query verbatim
    replace_alias: float = 0.05  # the nickname replaced by the product's name (or the name appended)
    add_intent: float = 0.05  # the topic's catalogue terms appended
    hint_word: float = 0.04  # one word of the product's name or of the topic's terms appended
    random_term: float = 0.02  # one catalogue word appended, right or wrong
    wrong_entity: float = 0.01  # another product's name and the topic's terms
    drop_tail: float = 0.01  # the first half of the query only

    def choices(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        names = ("copy", "hint_word", "random_term", "replace_alias", "add_intent", "wrong_entity", "drop_tail")
        return names, tuple(getattr(self, n) for n in names)


@dataclass(frozen=True)
class Example:
    """One warm-start sequence: text pieces, each trained on (generated) or not (prompt, observation)."""

    pieces: tuple[tuple[str, bool], ...]
    kind: str  # "rewrite" | "search"


# --- tokenizer and model --------------------------------------------------------------------------------------------


def prompt_constants() -> list[str]:
    """The fixed text of the trainer's prompt templates (and of this domain's context
    line), each of which becomes one token: a tiny model should not pay for reading a
    70-word instruction on every call. ``Question:`` keeps no trailing space, so the
    query's first word is tokenised as it is when the rewrite copies it."""
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, SEARCH_TEMPLATE, format_context

    pieces = {format_context(TASK_CONTEXT)}
    for template in (REWRITE_TEMPLATE, SEARCH_TEMPLATE):
        for part in re.split(r"\{context\}|\{query\}", template):
            part = part.rstrip(" ")
            if len(part.strip()) > 1:
                pieces.add(part)
    return sorted(pieces, key=lambda p: (-len(p), p))


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> "PreTrainedTokenizerFast":
    """A byte-level BPE tokenizer trained on ``texts``, wrapped as PreTrainedTokenizerFast;
    the Search-R1 tags are special tokens and the prompt constants single added tokens."""
    from transformers import PreTrainedTokenizerFast

    from calibrl.tiny_lm import train_bpe_tokenizer

    # digits one by one: copying a number out of a passage is then a look-up per digit, whatever numbers
    # the training texts hold (experiments/LOG.md, D11); a word split at each inner capital ("KeLi" -> "Ke" "Li"):
    # a name of the search half is spelled with the same few pieces, seen or not (D14)
    core = train_bpe_tokenizer(texts, vocab_size, [PAD, EOS, *SEARCH_TAGS], added_tokens=prompt_constants(),
                               individual_digits=True, split_inner_capitals=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, additional_special_tokens=list(SEARCH_TAGS)
    )


def build_model(tokenizer: "PreTrainedTokenizerFast", spec: PolicySpec = PolicySpec(),
                seed: int = 0) -> "PreTrainedModel":
    """A randomly initialised Llama-architecture causal LM sized by ``spec``
    (:func:`calibrl.tiny_lm.build_tiny_lm`)."""
    from calibrl.tiny_lm import build_tiny_lm

    return build_tiny_lm(tokenizer, spec.lm_spec(), seed)


# --- warm-start data ------------------------------------------------------------------------------------------------

_ENTITIES = {e.key: e for e in (*FUNDS, *ACCOUNTS)}
_ASPECTS = {a.key: a for a in (*FUND_ASPECTS, *ACCOUNT_ASPECTS)}


def rewrite_examples(domain: Domain, count: int, mix: RewriteMix = RewriteMix(), seed: int = 0) -> list[Example]:
    """``count`` (query -> rewrite) examples on training pairs: queries freshly drawn
    from the task templates (every failure mode), targets drawn from ``mix``."""
    rng = random.Random(seed)
    pairs = sorted({(t.entity_key, t.aspect_key) for t in domain.tasks("train")})
    moves, weights = mix.choices()
    examples = []
    for n in range(count):
        entity_key, aspect_key = rng.choice(pairs)
        entity, aspect = _ENTITIES[entity_key], _ASPECTS[aspect_key]
        mode = rng.choice(FAILURE_MODES)
        query = user_query(entity, aspect, mode, rng)
        task = RewriteTask(f"warm-{n}", query, (), (), mode, (entity.name,), aspect.terms, entity_key, aspect_key,
                           "train")
        target = candidate_rewrite(task, rng.choices(moves, weights)[0], rng)
        examples.append(Example(((rewrite_prompt(query), False), (" " + target, True)), "rewrite"))
    return examples


def rewrite_prompt(query: str) -> str:
    """The rewriter prompt of a rewrite task of this domain, as the trainer builds it."""
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, fill_template

    return fill_template(REWRITE_TEMPLATE, query, TASK_CONTEXT)


def search_prompt(question: str) -> str:
    """The search-agent prompt of a two-search question (no context), ending with ``<think>``."""
    from calibrl.trainer.search_format import SEARCH_TEMPLATE, fill_template, search_prompt_suffix

    return fill_template(SEARCH_TEMPLATE, question) + search_prompt_suffix()


def _observation(hits: Sequence[RetrievedPassage]) -> str:
    from calibrl.trainer.search_format import format_observation

    return format_observation(hits)


def trajectory_example(question: str, steps: Sequence[tuple[str, str, Sequence[RetrievedPassage]]], answer: str,
                       evidence: str = "") -> Example:
    """A reference Search-R1 trajectory: for each (think, query, hits) a search turn
    and its observation, then the answer, after the ``evidence`` (the words of the
    passage that state it) when given. The ``<think>`` opening each turn belongs to
    the prompt or the observation, never to a generated piece."""
    pieces: list[tuple[str, bool]] = [(search_prompt(question), False)]
    for think, query, hits in steps:
        pieces.append((f" {think} </think>\n<search> {query} </search>", True))
        pieces.append((_observation(hits), False))
    reason = f"It says {evidence}." if evidence else f"The answer is {answer}."
    pieces.append((f" {reason} </think>\n<answer> {answer} </answer>", True))
    return Example(tuple(pieces), "search")


def evidence_of(text: str, value: str, words: int = 4) -> str:
    """The ``words`` words of a passage before ``value``, and the value: what a reader
    quotes before answering (copying the value is then a short look-up)."""
    before = text[: text.index(value)].split()
    return " ".join([*before[-words:], value])


@dataclass(frozen=True)
class AgentTeacher:
    """How the base search agent's reference trajectories are drawn (its warm start).

    The teacher shows the format and always reads what it retrieved: its second query
    names the fund the observed passage names, and it quotes the words of the last
    observed passage that state the value, then answers that value, right or wrong. It
    makes two mistakes that RL can fix from the answer reward, since the right move is in
    the base agent's samples too: in a ``careless_first`` share of its demonstrations the
    first query leaves out the plan's industry word (a near miss that ties the sibling
    plans), in a ``careless_second`` share the second query leaves out the fund's style
    word (it ties the sibling funds)."""

    careless_first: float = 0.5
    careless_second: float = 0.5
    value_swaps: int = 2  # extra copies of each trajectory whose answer passage states another value
    # The first copy states a fresh value too, so that no demonstration states a training passage's own value:
    # nothing of an answer can be recalled, every value is copied from the observed passage (experiments/LOG.md, D16).
    fresh_values: bool = False


@dataclass(frozen=True)
class Plan:
    """One reference trajectory before retrieval: its searches, its answer, and the
    passages whose text the observation shows changed (doc id -> text)."""

    question: str
    steps: tuple[tuple[str, str], ...]  # (think, query)
    answer: str
    rewritten: tuple[tuple[str, str], ...] = ()
    evidence: str = ""  # the answer passage's words that state the answer
    renamed: tuple[tuple[str, str], ...] = ()  # (name word, made-up word): replaced in every piece of the example


def reference_trajectories(domain: Domain, search_many: "SearchManyFn", teacher: AgentTeacher = AgentTeacher(),
                           seed: int = 0) -> list[Plan]:
    """The warm-start plans, on training questions only: each question once, with the
    teacher's careless queries drawn as :class:`AgentTeacher` says, its second query and
    answer read from what ``search_many`` returned; then ``value_swaps`` copies of each
    whose answer passage states another value of the aspect (so the answer is read, not
    recalled). With ``teacher.fresh_values`` the question's own first demonstration is
    replaced by one more such copy. A trajectory whose observation is not a passage it can read on from is
    left out."""
    from calibrl.demo.search_domain import SEARCH_ASPECTS, fact_text, first_query, search_values, second_query

    rng = random.Random(seed)
    facts_by_doc = {f.doc_id: f for f in domain.facts}
    aspects = {a.key.replace("_", "-"): a for a in SEARCH_ASPECTS}
    tasks = domain.multistep("train")
    firsts = []
    for task in tasks:
        link = domain.search_links[task.gold_doc_ids[0]]
        firsts.append(first_query(link, careless=rng.random() < teacher.careless_first))
    first_hits = dict(zip(sorted(set(firsts)), search_many(sorted(set(firsts)))))
    seconds: list[tuple["Aspect", str, str] | None] = []
    for task, query in zip(tasks, firsts):
        hits = first_hits[query]
        link = domain.search_links.get(hits[0].doc_id) if hits else None
        aspect = next(a for suffix, a in aspects.items() if task.gold_doc_ids[-1].endswith("-" + suffix))
        careless = rng.random() < teacher.careless_second
        seconds.append(None if link is None else (aspect, second_query(link.fund, aspect, careless), query))
    wanted = sorted({s[1] for s in seconds if s is not None})
    second_hits = dict(zip(wanted, search_many(wanted)))
    plans: list[Plan] = []
    read: list[tuple[Plan, Fact, "Link"]] = []
    for task, step in zip(tasks, seconds):
        if step is None:
            continue
        aspect, query, first = step
        hits = second_hits[query]
        fact = facts_by_doc.get(hits[0].doc_id) if hits else None
        if fact is None or fact.aspect.key != aspect.key:
            continue
        think1, think2 = (s.think for s in task.steps)
        link = domain.search_links[task.gold_doc_ids[0]]
        plan = Plan(task.question, ((think1, first), (think2, query)), fact.value,
                    evidence=evidence_of(fact_text(fact.entity, fact.aspect, fact.value), fact.value))
        read.append((plan, fact, link))
    # Every demonstration renames the family words of the plan and of the fund its passages name with
    # made-up words of the same spelling (no word of any name of the domain), in every piece: a name is
    # copied from the question or the passage, never recalled (experiments/LOG.md, D14).
    reserved = {w.lower() for e in (*domain.entities, *domain.search_entities) for w in e.name.split()}
    for plan, fact, link in read:
        pool = search_values(fact.aspect.key)
        words = (link.plan.name.split()[0], link.fund.name.split()[0])
        if not teacher.fresh_values:
            plans.append(replace(plan, renamed=tuple((w, made_up_word(rng, reserved)) for w in words)))
        for _ in range(teacher.value_swaps + teacher.fresh_values):
            value = rng.choice(pool)
            while value == fact.value:
                value = rng.choice(pool)
            text = fact_text(fact.entity, fact.aspect, value)
            renamed = tuple((w, made_up_word(rng, reserved)) for w in words)
            plans.append(Plan(plan.question, plan.steps, value, ((fact.doc_id, text),), evidence_of(text, value),
                              renamed))
    return plans


def made_up_word(rng: random.Random, reserved: set[str]) -> str:
    """A family word spelled as the domain's (:func:`calibrl.demo.search_domain.name_word`)
    that is no word of ``reserved`` (lower case)."""
    from calibrl.demo.search_domain import name_word

    return name_word(rng, set(reserved))


def _rename(text: str, renamed: Sequence[tuple[str, str]]) -> str:
    for old, new in renamed:
        text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    return text


@dataclass(frozen=True)
class _ShownHit:
    doc_id: str
    title: str
    text: str


def search_examples(domain: Domain, search_many: SearchManyFn, teacher: AgentTeacher = AgentTeacher(),
                    seed: int = 0) -> list[Example]:
    """The reference trajectories of :func:`reference_trajectories`, their observations
    retrieved through ``search_many`` (the demo's retrieval service)."""
    plans = reference_trajectories(domain, search_many, teacher, seed)
    queries = sorted({query for plan in plans for _, query in plan.steps})
    found = dict(zip(queries, search_many(queries)))

    def shown(plan: Plan, query: str) -> list[RetrievedPassage]:
        rewritten = dict(plan.rewritten)
        return [_ShownHit(h.doc_id, h.title, rewritten[h.doc_id]) if h.doc_id in rewritten else h
                for h in found[query]]

    examples = []
    for plan in plans:
        example = trajectory_example(plan.question, [(think, query, shown(plan, query)) for think, query in plan.steps],
                                     plan.answer, plan.evidence)
        if plan.renamed:
            example = Example(tuple((_rename(text, plan.renamed), trained) for text, trained in example.pieces),
                              example.kind)
        examples.append(example)
    return examples


def tokenizer_corpus(domain: Domain, examples: Iterable[Example]) -> list[str]:
    """Texts the tokenizer is trained on: the rewriter half's passages and queries, the search
    half's training passages and questions, the warm-start sequences. No validation or test
    text of the search half: their names are made of pieces the model has seen in training."""
    held_out = {d for t in domain.multistep_tasks if t.split != "train" for d in t.gold_doc_ids}
    held_out |= {f"{link.fund.key}-{suffix}" for doc in held_out if doc in domain.search_links
                 for link in (domain.search_links[doc],)
                 for suffix in ("minimum-investment", "total-assets", "holdings", "inception")}
    texts = [f"{p.title} {p.text}" for p in domain.passages if p.doc_id not in held_out]
    texts += [t.query for t in domain.rewrite_tasks] + [t.question for t in domain.multistep("train")]
    texts += ["".join(text for text, _ in e.pieces) for e in examples]
    return texts


# --- warm start -----------------------------------------------------------------------------------------------------


def encode_example(tokenizer: "PreTrainedTokenizerFast", example: Example) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of an example, tokenised piece by piece exactly as the
    rollout does (the prompt with the tokenizer's special tokens, the rest without)."""
    ids: list[int] = []
    trained: list[bool] = []
    for n, (text, is_trained) in enumerate(example.pieces):
        piece = tokenizer(text, add_special_tokens=(n == 0))["input_ids"]
        ids += piece
        trained += [is_trained] * len(piece)
    if example.kind == "rewrite":  # a rewrite ends with EOS; a search turn ends at its stop tag
        ids.append(tokenizer.eos_token_id)
        trained.append(True)
    return ids, trained


def _batch(encoded: Sequence[tuple[list[int], list[bool]]], pad_id: int) -> tuple["torch.Tensor", ...]:
    import torch

    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, (ids, trained) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        mask = torch.tensor(trained)
        labels[row, : len(ids)] = torch.where(mask, torch.tensor(ids), torch.tensor(-100))
    return input_ids, attention, labels


@dataclass
class WarmStartResult:
    losses: list[float]
    examples: int
    parameters: int
    seconds: float = 0.0


def warm_start(
    model: "PreTrainedModel",
    tokenizer: "PreTrainedTokenizerFast",
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    desc: str = "warm start",
) -> WarmStartResult:
    """Supervised training on ``examples`` (loss on generated pieces only): AdamW,
    linear warm-up then cosine decay to a tenth, grad norm clipped to 1."""
    import time

    import torch
    from tqdm.auto import tqdm

    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    if not examples:
        raise ValueError("no warm-start examples")
    started = time.perf_counter()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = [encode_example(tokenizer, e) for e in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False)
    for _ in bar:
        batch = [pool[rng.randrange(len(pool))] for _ in range(batch_size)]
        input_ids, attention, labels = _batch(batch, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return WarmStartResult(losses=losses, examples=len(pool), parameters=sum(p.numel() for p in model.parameters()),
                           seconds=time.perf_counter() - started)


@dataclass(frozen=True)
class BasePolicies:
    """Where :func:`build_base_policies` saved the two models, and how their warm start went."""

    rewriter: pathlib.Path
    agent: pathlib.Path
    rewriter_result: WarmStartResult
    agent_result: WarmStartResult


def build_base_policies(
    domain: Domain,
    out_dir: str | pathlib.Path,
    search_many: SearchManyFn,
    *,
    spec: PolicySpec = PolicySpec(),
    agent_spec: PolicySpec | None = None,
    rewriter_steps: int = 400,
    agent_steps: int = 200,
    rewrite_count: int = 4000,
    teacher: AgentTeacher = AgentTeacher(),
    mix: RewriteMix = RewriteMix(),
    seed: int = 0,
    progress: bool = True,
    warm_threads: int | None = None,
) -> BasePolicies:
    """Train one tokenizer on the domain, then warm-start two models from it (the agent
    sized by ``agent_spec``, by default ``spec`` as the rewriter), saved as Hugging Face
    folders ``out_dir/base_rewriter`` and ``out_dir/base_agent``: the rewriter on
    (query -> rewrite) examples, the search agent on reference trajectories (observations
    from ``search``).

    The two warm starts run one after the other; ``warm_threads``: each with this many
    torch threads (this process's count is restored after; None keeps it). With the pinned
    float kernels (:mod:`calibrl.kernels`) a warm start's model does not depend on the
    thread count (tests/test_demo_policy.py checks it bit for bit), so on two cores the
    agent's warm start, much the longer, gets both."""
    import torch

    if warm_threads is not None and warm_threads < 1:
        raise ValueError(f"warm_threads={warm_threads}: must be >= 1")
    out = pathlib.Path(out_dir)
    rewrites = rewrite_examples(domain, rewrite_count, mix, seed)
    trajectories = search_examples(domain, search_many, teacher, seed)
    tokenizer = train_tokenizer(tokenizer_corpus(domain, rewrites + trajectories), spec.vocab_size)
    jobs = {"base_rewriter": (rewrites, rewriter_steps, 32, spec),
            "base_agent": (trajectories, agent_steps, 8, agent_spec or spec)}
    results: dict[str, WarmStartResult] = {}
    threads_before = torch.get_num_threads()
    try:
        for name, (examples, steps, batch, shape) in jobs.items():
            results[name] = _warm_start_and_save(out / name, tokenizer, shape, examples, steps, batch, seed,
                                                 threads=warm_threads, progress=progress)
    finally:
        torch.set_num_threads(threads_before)
    return BasePolicies(out / "base_rewriter", out / "base_agent", results["base_rewriter"], results["base_agent"])


def _warm_start_and_save(folder: pathlib.Path, tokenizer: "PreTrainedTokenizerFast", spec: PolicySpec,
                         examples: Sequence[Example], steps: int, batch_size: int, seed: int,
                         threads: int | None = None, progress: bool = False, lr: float = 3e-3) -> WarmStartResult:
    """A fresh model from ``spec``, warm-started (peak learning rate ``lr``) and saved with
    ``tokenizer`` as ``folder`` (``threads``: torch's thread count, set first; None keeps it)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    model = build_model(tokenizer, spec, seed)
    result = warm_start(model, tokenizer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                        progress=progress, desc=f"warm start {folder.name}")
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    honour_umask(folder)
    return result


def build_base_agent(
    domain: Domain,
    out_dir: str | pathlib.Path,
    search_many: SearchManyFn,
    *,
    tokenizer: "PreTrainedTokenizerFast | None" = None,
    spec: PolicySpec = PolicySpec(),
    steps: int = 300,
    teacher: AgentTeacher = AgentTeacher(),
    seed: int = 0,
    progress: bool = True,
    lr: float = 3e-3,
) -> tuple[pathlib.Path, WarmStartResult]:
    """Warm-start the base search agent alone (peak learning rate ``lr``), saved as
    ``out_dir/base_agent``; with no ``tokenizer``, one is trained on the domain and the
    agent's examples."""
    out = pathlib.Path(out_dir) / "base_agent"
    trajectories = search_examples(domain, search_many, teacher, seed)
    if tokenizer is None:
        tokenizer = train_tokenizer(tokenizer_corpus(domain, trajectories), spec.vocab_size)
    return out, _warm_start_and_save(out, tokenizer, spec, trajectories, steps, 8, seed, progress=progress, lr=lr)


__all__ = [
    "AgentTeacher", "BasePolicies", "build_base_agent", "build_base_policies", "build_model", "encode_example", "EOS",
    "evidence_of", "Example", "PAD", "Plan", "PolicySpec", "prompt_constants", "reference_trajectories",
    "rewrite_examples", "rewrite_prompt", "RewriteMix", "search_examples", "search_prompt", "train_tokenizer",
    "trajectory_example", "warm_start", "WarmStartResult",
]
