"""Train a judge model from SME feedback: fine-tune a causal LM to answer a rubric's LLM criteria.

``calibrl rubric train-judge --feedback F --rubric R --base MODEL --out DIR`` (the
command line is in ``calibrl.judge_server.cli``; this module is the library core).

**Which records.** Only the training part of the feedback: a record is golden when
:func:`calibrl.judge_server.authoring.distill.is_golden` says so for ``golden_fraction`` (0.3, the
distil default), the same rule that wrote the golden file, so the judge is never
trained on what ``calibrl rubric validate`` measures it on. A ``golden`` file given
as well excludes its records too (for a golden set cut with another fraction). The
record written beside the model holds ``golden_sha256``, the digest
``calibrl rubric validate`` stores in its validation record for the same set.

**Targets**, per training record and LLM criterion (``tags`` compared after alias
folding, :func:`calibrl.judge_server.authoring.distill.canonical_tag`):

- ``yes_no`` with tags: the criterion is violated when the record carries one of its
  tags. Met -> ``good_answer``; violated -> the other answer. (``good_answer: yes``,
  tags ``[t]``: "no" when the record carries t, "yes" when it does not.)
- ``yes_no`` without tags: met when the expert passed the record (``pass_grade`` 4
  for records without a verdict).
- ``likert_1_5`` with tags: 5 when the record carries none of them, else the
  expert's grade (a verdict-only record counts 5 / 1, as in distillation).
- ``likert_1_5`` without tags: the expert's grade.

**Prompts.** Exactly what the backends score: ``backends.encoding.PromptEncoder``
(``prompts.item_prefix`` + ``prompts.criterion_suffix``, ``prompts.chat_parts`` when
the tokenizer has a chat template and ``use_chat_template`` allows it), prefix and
suffix tokenised separately and concatenated; the answer ids come from
``prompts.answer_tokens``. The prompt options are written to the record: serve the
judge with the same ``max_docs``, ``max_doc_chars`` and ``use_chat_template``.

**Loss.** Cross-entropy over the full vocabulary on one answer token after the
prompt: the target answer's canonical spelling (`` yes``, `` no``, `` 3`` when that is
one token, else the bare word; the bare word first under a chat template, where the
answer starts a turn). Why not the restricted distribution the score is read from
(``P(yes) / (P(yes) + P(no))``)? Raising the target token's share of the whole
vocabulary raises its share of the answer tokens too, so the score moves the same
way; and it also puts the probability mass on the answer tokens, which the restricted
loss never asks for. That matters twice: vLLM reads only the top-k logprobs (an answer
outside them is a score it cannot compute), and generate-and-parse needs the answer
to be the greedy token. The cost is the spelling choice; the score pools every
spelling, so it is unaffected.

**Figures.** Per criterion, mean loss and agreement on the training part (held-in):
a yes/no answer agrees when the backend's score (``prompts.score_from_logprobs``)
is on the target's side of 0.5; a 1-5 answer when ``round(1 + 4 score)`` is the
target grade. Printed every epoch (the running figures of that epoch's batches) and
once before and after training (a pass in eval mode), beside a tqdm bar.

**Output.** An ordinary model folder (``save_pretrained`` weights, merged when LoRA
was used, in the base's saved dtype though training runs in float32; the base's tokenizer) plus ``calibrl_judge.json``: base model, feedback
and rubric hashes, split sizes and digests, options, per-criterion figures, and the
model ids (``transformers:<folder>@<fingerprint>``). That id is what
``calibrl rubric validate --judge transformers:DIR`` binds its validation record to
(the judge appends its embedder: ``...@<fingerprint>[minilm-l6-v2]``); the record file
is not part of the fingerprint.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import inspect
import json
import pathlib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from calibrl.errors import ConfigError, InvalidArgument
from calibrl.fileperms import honour_umask
from calibrl.json_types import JsonObject
from calibrl.judge_server import prompts
from calibrl.judge_server.authoring.distill import canonical_tag, grade_value, is_golden, text_key
from calibrl.judge_server.authoring.feedback import FeedbackRecord
from calibrl.judge_server.rubric import Criterion, Rubric, RubricError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from calibrl.judge_server.backends.encoding import PromptEncoder

RECORD_FILE = "calibrl_judge.json"
RECORD_FORMAT = "calibrl.judge-training/1"


@dataclass
class TrainJudgeOptions:
    """How to fine-tune the judge; ``validate()`` names the bad value and the fix."""

    epochs: int = 3  # passes over the training examples
    lr: float | None = None  # AdamW learning rate; None: 2e-5 full fine-tuning, 2e-4 LoRA
    batch_size: int = 8  # examples (record x criterion prompts) per optimiser step
    seed: int = 0  # shuffling and LoRA initialisation
    weight_decay: float = 0.0  # AdamW weight decay
    lora: bool = False  # train LoRA adapters (peft) and merge them into the saved weights
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: float = 16.0  # LoRA scaling alpha (effective scale alpha / r)
    golden_fraction: float = 0.3  # the distil hold-out share; golden records are never trained on
    pass_grade: int = 4  # expert pass = grade >= this, for records without a verdict
    criteria: tuple[str, ...] = ()  # LLM criteria to train (empty: all of the rubric's)
    device: str = "auto"  # auto (cuda when available), cpu, cuda, cuda:1, ...
    use_chat_template: str = "auto"  # as the judge's use_chat_template: auto, true or false
    max_docs: int = 5  # retrieved passages in the prompt, as the judge's max_docs (0: none)
    max_doc_chars: int = 600  # characters per passage, as the judge's max_doc_chars

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 2e-4 if self.lora else 2e-5

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "lora_rank", "max_doc_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_docs < 0:
            raise ConfigError(f"max_docs={self.max_docs}: must be >= 0 (0 shows no retrieved passages)")
        if self.lr is not None and not 0.0 < self.lr < 1.0:
            raise ConfigError(f"lr={self.lr}: must be in (0, 1), e.g. 2e-5 (full) or 2e-4 (LoRA)")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay}: must be >= 0")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha={self.lora_alpha}: must be > 0")
        if not 0.0 <= self.golden_fraction < 1.0:
            raise ConfigError(f"golden_fraction={self.golden_fraction}: must be in [0, 1) (distil's default 0.3)")
        if not 1 <= self.pass_grade <= 5:
            raise ConfigError(f"pass_grade={self.pass_grade}: must be in 1..5")
        if self.use_chat_template not in ("auto", "true", "false"):
            raise ConfigError(f"use_chat_template={self.use_chat_template!r}: must be auto, true or false")


# --------------------------------------------------------------------------- targets


def criterion_target(criterion: Criterion, record: FeedbackRecord, pass_grade: int = 4) -> str:
    """The answer the judge should give: ``"yes"``/``"no"`` or ``"1"``..``"5"`` (see module doc)."""
    carried = {canonical_tag(t) for t in record.error_tags}
    wanted = {canonical_tag(t) for t in criterion.tags}
    if criterion.scale == "likert_1_5":
        if wanted and not (wanted & carried):
            return "5"
        return str(int(round(grade_value(record))))
    met = not (wanted & carried) if wanted else record.expert_pass(pass_grade)
    bad_answer = "no" if criterion.good_answer == "yes" else "yes"
    return criterion.good_answer if met else bad_answer


def split_for_training(records: Sequence[FeedbackRecord], golden_fraction: float,
                       golden_hashes: frozenset[str] = frozenset()) -> tuple[list, list]:
    """(training records, held-out records): held out = golden by the distil rule or listed."""
    held = [is_golden(r, golden_fraction) or r.record_hash in golden_hashes or text_key(r) in golden_hashes
            for r in records]  # golden_hashes may hold record hashes and (query, output) text keys
    train = [r for r, out in zip(records, held) if not out]
    held_out = [r for r, out in zip(records, held) if out]
    return train, held_out


def canonical_answer_ids(tokens: prompts.AnswerTokens, encode: Callable[[str], Sequence[int]],
                         chat: bool) -> dict[str, int]:
    """One token id per answer (``yes``, ``no``, ``1``..``5``): the spelling trained on."""
    pools = {"yes": tokens.yes, "no": tokens.no, **{str(k + 1): ids for k, ids in enumerate(tokens.digits)}}
    chosen: dict[str, int] = {}
    for answer, pool in pools.items():
        spellings = (answer, " " + answer) if chat else (" " + answer, answer)
        for spelling in spellings:
            ids = list(encode(spelling))
            if len(ids) == 1 and ids[0] in pool:
                chosen[answer] = ids[0]
                break
    return chosen


@dataclass
class Example:
    """One training prompt: a record asked one criterion, and the answer token to predict."""

    record: int  # index into the training records
    criterion: int  # index into the trained criteria
    prompt_ids: list[int]
    target: str  # "yes" | "no" | "1".."5"
    target_id: int


# --------------------------------------------------------------------------- figures


@dataclass
class CriterionFigures:
    """Running sums of one criterion's loss and agreement."""

    loss_sum: float = 0.0
    agreed: int = 0
    n: int = 0

    def add(self, loss: float, agrees: bool) -> None:
        self.loss_sum += loss
        self.agreed += int(agrees)
        self.n += 1

    @property
    def loss(self) -> float:
        return self.loss_sum / self.n if self.n else float("nan")

    @property
    def agreement(self) -> float:
        return self.agreed / self.n if self.n else float("nan")


def answer_agrees(criterion: Criterion, target: str, score: float) -> bool:
    """Does the backend's score for ``criterion`` land on ``target`` (see module doc)?"""
    if criterion.scale == "likert_1_5":
        return int(round(1.0 + 4.0 * score)) == int(target)
    met = target == criterion.good_answer
    return (score >= 0.5) == met


def format_figures(criteria: Sequence[Criterion], figures: Sequence[CriterionFigures]) -> str:
    return "  ".join(f"{c.name}: loss {f.loss:.4f} agree {f.agreement:.3f}" for c, f in zip(criteria, figures))


# --------------------------------------------------------------------------- the command's core


@dataclass
class TrainingResult:
    out: pathlib.Path
    record: JsonObject
    train: list[FeedbackRecord] = field(repr=False)
    held_out: list[FeedbackRecord] = field(repr=False)


def _criterion_location(rubric: Rubric, criterion: Criterion) -> tuple[int | None, str]:
    """(line, field) of a criterion in its rubric file, for error messages."""
    index = list(rubric.criteria).index(criterion)
    line = None
    if rubric.source_yaml:
        import yaml

        from calibrl.judge_server.rubric import _node_lines

        try:
            line = _node_lines(yaml.compose(rubric.source_yaml)).get(("criteria", index))
        except yaml.YAMLError:
            line = None
    return line, f"criteria[{index}]"


def select_criteria(rubric: Rubric, names: Sequence[str], rubric_source: str) -> tuple[Criterion, ...]:
    """The LLM criteria to train: all of them, or those ``names`` picks (unknown names refused)."""
    if not rubric.llm_criteria:
        raise RubricError(rubric_source, None, "criteria",
                          f"rubric {rubric.id!r} has no llm criterion, nothing to train a judge for "
                          f"(its criteria: {[c.name for c in rubric.criteria]}, all programmatic); distil it "
                          "with --criteria both or llm, or add an llm criterion")
    if not names:
        return rubric.llm_criteria
    by_name = {c.name: c for c in rubric.criteria}
    picked = []
    for name in names:
        if name not in by_name:
            raise InvalidArgument("--criteria", f"unknown criterion {name!r}; the LLM criteria of {rubric_source} "
                                  f"are {[c.name for c in rubric.llm_criteria]}")
        if by_name[name].kind != "llm":
            raise InvalidArgument("--criteria", f"criterion {name!r} of {rubric_source} is programmatic, not llm: "
                                  "only llm criteria are answered by the judge model")
        if by_name[name] not in picked:
            picked.append(by_name[name])
    return tuple(picked)


def check_targets(rubric: Rubric, rubric_source: str, criteria: Sequence[Criterion], examples: Sequence[Example],
                  feedback_source: str, n_train: int) -> None:
    """Refuse a criterion whose training targets are all one answer: nothing to learn."""
    for index, criterion in enumerate(criteria):
        targets = {e.target for e in examples if e.criterion == index}
        if len(targets) < 2:
            line, where = _criterion_location(rubric, criterion)
            source = f"its tags {list(criterion.tags)}" if criterion.tags else "the expert verdicts"
            raise RubricError(rubric_source, line, f"{where}.tags" if criterion.tags else where,
                              f"criterion {criterion.name!r}: every one of the {n_train} training records of "
                              f"{feedback_source} gives the answer {sorted(targets)} (from {source}); train on "
                              "the feedback this rubric was distilled from")


def _load_base(base: pathlib.Path,
               device: str) -> tuple["PreTrainedTokenizerBase", "PreTrainedModel", "torch.dtype | str | None"]:
    """(tokenizer, float32 model, the dtype the base was saved in) of a causal LM folder,
    or a ConfigError naming --base."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not base.is_dir():
        raise ConfigError(f"--base {base}: no such folder (a Hugging Face causal LM folder is expected)")
    if not (base / "config.json").is_file():
        raise ConfigError(f"--base {base}: no config.json, not a Hugging Face model folder")
    try:
        config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--base {base}: config.json cannot be read ({exc})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"--base {base}: model_type {config.model_type!r} is not a causal LM (a decoder such as "
                          "llama, qwen2, mistral or gpt2 is needed: the judge reads the next-token distribution)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype="float32")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--base {base}: cannot load the tokenizer and causal LM weights ({exc})") from None
    saved_dtype = getattr(config, "dtype", None)
    return tokenizer, model.to(device), saved_dtype


def _left_pad(sequences: Sequence[Sequence[int]], pad_id: int,
              device: str) -> tuple["Tensor", "Tensor", "Tensor"]:
    """(ids, mask, positions), left-padded: the next token always follows the last column."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def answer_loss(last_logits: "Tensor", target_ids: "Tensor") -> "Tensor":
    """Per-example cross-entropy of the answer token. ``last_logits: (B, V)``, ``target_ids: (B,)``
    -> ``(B,)``, float32 whatever the model's dtype."""
    import torch

    return torch.nn.functional.cross_entropy(last_logits.float(), target_ids, reduction="none")


class _Scorer:
    """Forward passes over examples, the loss, and the backend's score readout."""

    def __init__(self, model: "PreTrainedModel", pad_id: int, device: str, tokens: prompts.AnswerTokens,
                 criteria: Sequence[Criterion]) -> None:
        self.model, self.pad_id, self.device, self.tokens, self.criteria = model, pad_id, device, tokens, criteria
        params = inspect.signature(model.forward).parameters
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def losses(self, batch: Sequence[Example]) -> tuple["Tensor", "Tensor"]:
        """(per-example loss (B,), log-probs of the next token (B, V), detached)."""
        import torch

        ids, mask, positions = _left_pad([e.prompt_ids for e in batch], self.pad_id, self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                            **self.keep).logits[:, -1]
        targets = torch.tensor([e.target_id for e in batch], dtype=torch.long, device=self.device)
        return answer_loss(logits, targets), torch.log_softmax(logits.detach().float(), dim=-1)

    def tally(self, batch: Sequence[Example], losses: "Tensor", logprobs: "Tensor",
              figures: list[CriterionFigures]) -> None:
        ids = list(self.tokens.all_ids())
        column = {t: i for i, t in enumerate(ids)}
        picked = logprobs[:, ids].cpu().tolist()
        for example, loss, row in zip(batch, losses.detach().cpu().tolist(), picked):
            criterion = self.criteria[example.criterion]
            score = prompts.score_from_logprobs(criterion, lambda t: row[column[t]], self.tokens)
            figures[example.criterion].add(loss, answer_agrees(criterion, example.target, score))

    def evaluate(self, examples: Sequence[Example], batch_size: int) -> list[CriterionFigures]:
        import torch

        figures = [CriterionFigures() for _ in self.criteria]
        self.model.eval()
        with torch.inference_mode():
            for start in range(0, len(examples), batch_size):
                batch = examples[start:start + batch_size]
                losses, logprobs = self.losses(batch)
                self.tally(batch, losses, logprobs, figures)
        return figures


def _sha256_file(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _figures_json(criteria: Sequence[Criterion], figures: Sequence[CriterionFigures]) -> dict[str, dict]:
    return {c.name: {"loss": round(f.loss, 6), "agreement": round(f.agreement, 6), "n": f.n}
            for c, f in zip(criteria, figures)}


def train_judge(
    feedback_path: str | pathlib.Path,
    rubric_path: str | pathlib.Path,
    base: str | pathlib.Path,
    out: str | pathlib.Path,
    options: TrainJudgeOptions | None = None,
    *,
    golden_path: str | pathlib.Path | None = None,
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> TrainingResult:
    """Fine-tune ``base`` on the training part of the feedback; write ``out`` (see module doc)."""
    options = options or TrainJudgeOptions()
    options.validate()
    import torch

    from calibrl.judge_server.backends.encoding import PromptEncoder
    from calibrl.judge_server.backends.hf import resolve_device
    from calibrl.judge_server.rubric import load_rubric

    feedback_path, rubric_path, base, out = (pathlib.Path(p) for p in (feedback_path, rubric_path, base, out))
    _check_out_folder(out, base)

    # ---- inputs: feedback, split, rubric, criteria
    records, train, held_out = _read_training_split(feedback_path, golden_path, options.golden_fraction)
    rubric = load_rubric(rubric_path)
    criteria = select_criteria(rubric, options.criteria, str(rubric_path))

    # ---- model, tokenizer and the backends' prompt encoder
    device = resolve_device(options.device)
    tokenizer, model, saved_dtype = _load_base(base, device)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    try:
        encoder = PromptEncoder(tokenizer, prompts.PromptOptions(options.max_docs, options.max_doc_chars),
                                options.use_chat_template, max_positions)
        tokens = encoder.answer_tokens
        if any(c.scale == "likert_1_5" for c in criteria) and not all(tokens.digits):
            raise ConfigError("the judge tokenizer has no single-token digits 1-5 for the rubric's 1-5 questions")
    except ConfigError as exc:
        raise ConfigError(f"--base {base}: {exc}") from None
    # tokenised as the encoder finds answer tokens: no special tokens
    answer_ids = canonical_answer_ids(tokens, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                                      encoder.chat)

    examples = _examples(train, criteria, encoder, rubric.instructions, answer_ids, max_positions,
                         options.pass_grade, feedback_path)
    check_targets(rubric, str(rubric_path), criteria, examples, str(feedback_path), len(train))

    echo(f"train-judge: {len(train)} training records of {len(records)} ({len(held_out)} golden, never trained "
         f"on) x {len(criteria)} criteria = {len(examples)} examples; base {base} on {device}"
         f"{', LoRA r=' + str(options.lora_rank) if options.lora else ''}; lr {options.learning_rate:g}")
    _echo_targets(criteria, examples, echo)

    # ---- train
    torch.manual_seed(options.seed)
    if options.lora:
        model = _with_lora(model, options)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    scorer = _Scorer(model, int(pad if pad is not None else 0), device, tokens, criteria)
    before = scorer.evaluate(examples, options.batch_size)
    echo(f"before training: {format_figures(criteria, before)}")

    _fit(model, scorer, examples, criteria, options, progress=progress, echo=echo)
    after = scorer.evaluate(examples, options.batch_size)
    echo(f"after training: {format_figures(criteria, after)}")

    # ---- write the model folder and the record
    _save_model(model, tokenizer, out, saved_dtype, merge_lora=options.lora)
    record = _training_record(out, base, feedback_path, rubric_path, golden_path, options, records, train, held_out,
                              rubric, encoder.chat, answer_ids, criteria, examples, before, after)
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    echo(f"wrote {out} (judge model id {record['model_ids']['transformers']}); validate it with: calibrl rubric "
         f"validate --rubric {rubric_path} --golden GOLDEN --judge transformers:{out}")
    return TrainingResult(out, record, train, held_out)


def _read_training_split(feedback_path: pathlib.Path, golden_path: str | pathlib.Path | None,
                         golden_fraction: float) -> tuple[list[FeedbackRecord], list[FeedbackRecord],
                                                          list[FeedbackRecord]]:
    """(every feedback record, the training ones, the golden ones never trained on)."""
    from calibrl.judge_server.authoring.feedback import read_feedback

    records = read_feedback(feedback_path)
    golden_hashes: frozenset[str] = frozenset()
    if golden_path is not None:
        # a golden file excludes its records and every review of the same (query, output) text
        golden_hashes = frozenset(key for r in read_feedback(golden_path) for key in (r.record_hash, text_key(r)))
    train, held_out = split_for_training(records, golden_fraction, golden_hashes)
    if not train:
        raise ConfigError(f"{feedback_path}: all {len(records)} records are golden (golden_fraction="
                          f"{golden_fraction}); no training records are left")
    return records, train, held_out


def _save_model(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", out: pathlib.Path,
                saved_dtype: "torch.dtype | str | None", *, merge_lora: bool) -> None:
    """Write the trained model and its tokenizer to ``out`` in the base's dtype (LoRA merged in)."""
    import torch

    if merge_lora:
        model = model.merge_and_unload()
    model.eval()
    if isinstance(saved_dtype, torch.dtype) and saved_dtype != torch.float32:
        model = model.to(saved_dtype)  # trained in float32, saved as the base was (a bf16 base stays bf16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    honour_umask(out)


def _check_out_folder(out: pathlib.Path, base: pathlib.Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; choose a new folder, nothing is "
                          "overwritten")
    if out.resolve() == base.resolve():
        raise ConfigError(f"--out {out} is the --base folder; the base model is never overwritten")


def _examples(train: Sequence[FeedbackRecord], criteria: Sequence[Criterion], encoder: "PromptEncoder",
              instructions: str, answer_ids: dict[str, int], max_positions: int | None, pass_grade: int,
              feedback_path: pathlib.Path) -> list[Example]:
    """One example per (training record, criterion): the judge prompt and the answer the record asks for."""
    suffixes = [encoder.encode_suffix(c) for c in criteria]
    examples: list[Example] = []
    for r, record in enumerate(train):
        prefix = encoder.encode_prefix(record.to_item(), instructions)
        if max_positions is not None and len(prefix) + max(len(s) for s in suffixes) > max_positions:
            raise InvalidArgument(f"{feedback_path}: record {record.id or record.record_hash[:12]}",
                                  f"judge prompt is {len(prefix) + max(len(s) for s in suffixes)} tokens, the "
                                  f"base model takes at most {max_positions}; lower --max-doc-chars or --max-docs")
        for c, (criterion, suffix) in enumerate(zip(criteria, suffixes)):
            target = criterion_target(criterion, record, pass_grade)
            examples.append(Example(r, c, prefix + suffix, target, answer_ids[target]))
    return examples


def _echo_targets(criteria: Sequence[Criterion], examples: Sequence[Example], echo: Callable[[str], None]) -> None:
    for c, criterion in enumerate(criteria):
        counts: dict[str, int] = {}
        for e in examples:
            if e.criterion == c:
                counts[e.target] = counts.get(e.target, 0) + 1
        echo(f"  {criterion.name} ({criterion.scale}, tags {list(criterion.tags)}): targets "
             + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))


def _fit(model: "PreTrainedModel", scorer: _Scorer, examples: Sequence[Example], criteria: Sequence[Criterion],
         options: TrainJudgeOptions, *, progress: bool, echo: Callable[[str], None]) -> None:
    """``options.epochs`` epochs of AdamW over the examples, shuffled by ``options.seed``."""
    import torch
    from tqdm.auto import tqdm

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=options.learning_rate, weight_decay=options.weight_decay)
    order = torch.Generator().manual_seed(options.seed)
    steps_per_epoch = (len(examples) + options.batch_size - 1) // options.batch_size
    bar = tqdm(total=options.epochs * steps_per_epoch, desc="train-judge", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for epoch in range(1, options.epochs + 1):
            model.train()
            running = [CriterionFigures() for _ in criteria]
            permutation = torch.randperm(len(examples), generator=order).tolist()
            for start in range(0, len(examples), options.batch_size):
                batch = [examples[i] for i in permutation[start:start + options.batch_size]]
                losses, logprobs = scorer.losses(batch)
                optimizer.zero_grad(set_to_none=True)
                losses.mean().backward()
                optimizer.step()
                scorer.tally(batch, losses, logprobs, running)
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{losses.mean().item():.4f}")
            line = f"epoch {epoch}/{options.epochs}: {format_figures(criteria, running)}"
            echo(line)
    finally:
        bar.close()


def _training_record(out: pathlib.Path, base: pathlib.Path, feedback_path: pathlib.Path, rubric_path: pathlib.Path,
                     golden_path: str | pathlib.Path | None, options: TrainJudgeOptions,
                     records: Sequence[FeedbackRecord], train: Sequence[FeedbackRecord],
                     held_out: Sequence[FeedbackRecord], rubric: Rubric, chat: bool, answer_ids: dict[str, int],
                     criteria: Sequence[Criterion], examples: Sequence[Example], before: Sequence[CriterionFigures],
                     after: Sequence[CriterionFigures]) -> JsonObject:
    """The training record written beside the model (``RECORD_FILE``)."""
    from calibrl.judge_server.backends import model_fingerprint, model_id_for
    from calibrl.judge_server.authoring.validation import golden_digest

    fingerprint = model_fingerprint(out)
    return {
        "format": RECORD_FORMAT,
        "model_ids": {"transformers": model_id_for("transformers", out), "vllm": model_id_for("vllm", out)},
        "fingerprint": fingerprint,
        "base": {"path": str(base.resolve()), "model_id": model_id_for("transformers", base)},
        "feedback": {
            "path": str(feedback_path), "sha256": _sha256_file(feedback_path), "n_records": len(records),
            "n_train": len(train), "n_held_out": len(held_out), "golden_fraction": options.golden_fraction,
            "golden_file": str(golden_path) if golden_path else None,
            "train_sha256": golden_digest(train), "golden_sha256": golden_digest(held_out),
        },
        "rubric": {"path": str(rubric_path), "id": rubric.id, "version": rubric.version, "hash": rubric.hash},
        "prompt": {"use_chat_template": options.use_chat_template, "chat": chat,
                   "max_docs": options.max_docs, "max_doc_chars": options.max_doc_chars,
                   "answer_token_ids": answer_ids},
        "criteria": {
            c.name: {"scale": c.scale, "tags": list(c.tags),
                     "targets": {t: sum(1 for e in examples if e.criterion == i and e.target == t)
                                 for t in sorted({e.target for e in examples if e.criterion == i})},
                     "before": _figures_json([c], [before[i]])[c.name],
                     "final": _figures_json([c], [after[i]])[c.name]}
            for i, c in enumerate(criteria)
        },
        "options": {**dataclasses.asdict(options), "criteria": [c.name for c in criteria],
                    "learning_rate": options.learning_rate},
        "created_at": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    }


def _with_lora(model: "PreTrainedModel", options: TrainJudgeOptions) -> "PreTrainedModel":
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("--lora needs peft: pip install 'calibrl[lora]'") from None
    config = LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha, lora_dropout=0.0,
                        target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def read_training_record(folder: str | pathlib.Path) -> JsonObject:
    """The ``calibrl_judge.json`` of a trained judge folder."""
    path = pathlib.Path(folder) / RECORD_FILE
    if not path.is_file():
        raise ConfigError(f"{folder}: no {RECORD_FILE}; not a folder written by 'calibrl rubric train-judge'")
    return json.loads(path.read_text(encoding="utf-8"))
