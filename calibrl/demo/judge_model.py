"""The demo's LLM judge, built here from nothing: tokenizer, warm start, SME fine-tuning, validation.

No pretrained LLM can be downloaded, so the demo builds its judge the way
:mod:`calibrl.demo.policy` builds its policies:

1. **Rubric**: ``calibrl rubric distill --criteria llm`` of the same SME feedback as the
   programmatic rubric: one yes/no question per error tag (``demo-rewriter-llm``), with
   the same golden hold-out (the split is a function of each record, not of the mode).
2. **Tokenizer**: the policies' byte-level BPE (:func:`calibrl.demo.policy.train_tokenizer`)
   trained on the domain's passages and queries and on the judge's prompts, with the
   fixed text of those prompts (instructions, field labels, each criterion's question)
   added as single tokens, as the policies' prompt templates are.
3. **Warm start**: language modelling on the domain text (the rewriter half's passages,
   the user queries of its training tasks, the training part of the SME reviews): the model
   knows the catalogue's words before it learns to judge them. Nothing golden is read: no
   golden (query, rewrite) pair, no review of a golden text, no golden rewrite
   (:func:`domain_text_examples`).
4. **Fine-tuning**: :func:`calibrl.judge_server.authoring.train_judge.train_judge` (the library
   behind ``calibrl rubric train-judge``) on the training part of the SME feedback,
   never the golden part, with the prompts the transformers backend scores.
5. **Validation**: :func:`calibrl.judge_server.authoring.validation.validate_judge` (the library
   behind ``calibrl rubric validate --judge transformers:DIR``) on the golden set, the pass
   threshold given or picked (``"auto"``) on the non-golden reviews; the record is written
   beside the rubric, where ``calibrl serve judge`` reads it.

Judge prompts show no retrieved passages (``max_docs=0``, at training, validation and
serving alike): every criterion compares the rewrite with the query, the SME records
carry no passages, and a tiny model reads a short prompt fast.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from calibrl.demo.domain import Domain
from calibrl.demo.policy import Example, PolicySpec, build_model, train_tokenizer, warm_start
from calibrl.fileperms import honour_umask

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.demo.policy import WarmStartResult
    from calibrl.judge_server.authoring.feedback import FeedbackRecord
    from calibrl.judge_server.authoring.train_judge import TrainingResult
    from calibrl.judge_server.authoring.validation import ValidationOptions
    from calibrl.judge_server.config import JudgeConfig
    from calibrl.judge_server.rubric import Rubric
    from calibrl.judge_server.validation_records import ValidationRecord

LLM_RUBRIC_ID = "demo-rewriter-llm"
JUDGE_MAX_DOCS = 0  # judge prompts show no retrieved passages (module doc)
JUDGE_MAX_DOC_CHARS = 600  # unused with max_docs=0; stated so every judge config says the same


@dataclass(frozen=True)
class JudgeModelSettings:
    """Sizes of the demo's judge model and its training."""

    warm_steps: int = 120  # language-modelling steps on the domain text
    warm_batch_size: int = 16
    epochs: int = 3  # train-judge passes over the training records x criteria
    lr: float = 3e-3  # train-judge learning rate (a tiny model from scratch, full fine-tuning)
    batch_size: int = 16  # train-judge examples per step
    spec: PolicySpec = PolicySpec(vocab_size=1024, hidden_size=64, num_layers=2, intermediate_size=128,
                                  max_positions=256)


@dataclass(frozen=True)
class JudgeModel:
    """Where the judge was saved and how its training and validation went."""

    folder: pathlib.Path
    spec: str  # the judge SPEC to serve it: transformers:<folder>
    model_id: str  # what the validation record binds (with the embedder suffix)
    training: "TrainingResult"
    validation: "ValidationRecord"
    warm_losses: tuple[float, float]  # first and last warm-start loss
    seconds: dict[str, float]  # warm start, fine-tuning, validation


def judge_config(spec: str, **overrides: str | int | bool) -> "JudgeConfig":
    """The JudgeConfig of the demo's LLM judge (validation and serving use the same prompts)."""
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeConfig

    fields = {"backend": spec, "device": "cpu", "max_docs": JUDGE_MAX_DOCS, "max_doc_chars": JUDGE_MAX_DOC_CHARS,
              **overrides}
    return load_config(JudgeConfig, None, [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                           for k, v in fields.items()])


def serve_overrides() -> list[str]:
    """``calibrl serve judge`` overrides that give the served LLM judge the validated prompts."""
    return [f"judge.max_docs={JUDGE_MAX_DOCS}", f"judge.max_doc_chars={JUDGE_MAX_DOC_CHARS}",
            "judge.device=cpu"]


def distill_llm_rubric(feedback: pathlib.Path, glossary: Sequence[str], rubric_path: pathlib.Path) -> "Rubric":
    """The LLM rubric of the SME feedback (yes/no questions), written to ``rubric_path``."""
    from calibrl.judge_server.authoring.distill import DistillOptions, distill
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.rubric import dump_rubric

    result = distill(read_feedback(feedback), DistillOptions(rubric_id=LLM_RUBRIC_ID, criteria_mode="llm",
                                                             glossary=tuple(glossary)))
    rubric_path.parent.mkdir(parents=True, exist_ok=True)
    rubric_path.write_text(dump_rubric(result.rubric), encoding="utf-8")
    return result.rubric


def judge_prompt_constants(rubric: "Rubric") -> list[str]:
    """The fixed text of the judge's prompts, each to become one token."""
    from calibrl.judge_server import prompts

    pieces = {rubric.instructions.strip() or prompts.DEFAULT_INSTRUCTIONS, "User query:", "Agent output:"}
    pieces |= {prompts.criterion_suffix(c) for c in rubric.llm_criteria}
    return sorted(pieces, key=lambda p: (-len(p), p))


def domain_text_examples(domain: Domain, golden: Sequence["FeedbackRecord"]) -> list[Example]:
    """Warm-start texts: the rewriter half's passages, the user queries of its training tasks and
    the SME-reviewed rewrites that are not golden (all trained on); the search-only passages say
    nothing about rewrites. ``golden`` (feedback records): a review with a golden item's (query,
    rewrite) text is left out whatever its id or grade, and so is any text equal to a golden rewrite."""
    from calibrl.judge_server.authoring.distill import text_key
    from calibrl.judge_server.authoring.feedback import FeedbackRecord

    golden_keys = {text_key(r) for r in golden}
    golden_rewrites = {" ".join(r.output.lower().split()) for r in golden}
    reviews = [r for r in domain.sme_feedback
               if text_key(FeedbackRecord(query=r.query, output=r.rewrite)) not in golden_keys]
    texts = [f"{p.title} {p.text}" for p in domain.rewriter_passages()]
    texts += [t.query for t in domain.tasks("train")]
    texts += [f"User query: {r.query}\nAgent output: {r.rewrite}" for r in reviews]
    texts = [t for t in texts if " ".join(t.lower().split()) not in golden_rewrites]
    return [Example(((text, True),), "text") for text in texts]


def build_judge_base(domain: Domain, rubric: "Rubric", out: pathlib.Path, settings: JudgeModelSettings, *, seed: int,
                     progress: bool, golden: Sequence["FeedbackRecord"]) -> tuple[pathlib.Path, "WarmStartResult"]:
    """Tokenizer + warm-started model, saved as a Hugging Face folder ``out``; neither reads a
    ``golden`` text (:func:`domain_text_examples`)."""
    from calibrl.judge_server import prompts

    examples = domain_text_examples(domain, golden)
    answers = [" yes", " no", " 1", " 2", " 3", " 4", " 5"]
    corpus = ["".join(text for text, _ in e.pieces) for e in examples]
    corpus += [f"Answer:{a}" for a in answers] * 20  # the answer words become tokens of their own
    tokenizer = train_tokenizer(corpus, settings.spec.vocab_size)
    tokenizer.add_tokens(judge_prompt_constants(rubric))
    prompts.answer_tokens(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], need_likert=False)
    model = build_model(tokenizer, settings.spec, seed)
    result = warm_start(model, tokenizer, examples, steps=settings.warm_steps, batch_size=settings.warm_batch_size,
                        seed=seed, progress=progress, desc="warm start judge")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    honour_umask(out)
    return out, result


def build_and_validate_judge(domain: Domain, feedback: pathlib.Path, rubric: "Rubric", rubric_path: pathlib.Path,
                             golden: Sequence["FeedbackRecord"], golden_path: pathlib.Path, out: pathlib.Path,
                             settings: JudgeModelSettings = JudgeModelSettings(), *, pass_threshold: float | str,
                             gate: str = "estimate", seed: int = 0, progress: bool = True) -> JudgeModel:
    """Build, fine-tune and validate the LLM judge (module doc); the validation record is
    written beside ``rubric_path``. ``golden`` is the golden set the programmatic judge was
    validated on; it is also excluded from training by name (``golden_path``) and from the
    warm start. ``pass_threshold``: a number, or ``"auto"`` to pick it on the reviews of
    ``feedback`` that are not golden; ``gate``: what must reach min_kappa (ValidationOptions.gate)."""
    from calibrl.judge_server.authoring.train_judge import TrainJudgeOptions, train_judge
    from calibrl.judge_server.authoring.validation import validate_judge, validation_path, write_record

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    base, warm = build_judge_base(domain, rubric, out / "judge_base", settings, seed=seed, progress=progress,
                                  golden=golden)
    seconds["warm start"] = time.perf_counter() - started

    started = time.perf_counter()
    options = TrainJudgeOptions(epochs=settings.epochs, lr=settings.lr, batch_size=settings.batch_size, seed=seed,
                                device="cpu", max_docs=JUDGE_MAX_DOCS,
                                max_doc_chars=JUDGE_MAX_DOC_CHARS)
    log = io.StringIO()  # train-judge's per-epoch lines go to the demo log, not between the stage lines
    with contextlib.redirect_stdout(log):
        training = train_judge(feedback, rubric_path, base, out / "judge", options, golden_path=golden_path,
                               progress=False, echo=lambda line: print(line, flush=True))
    (out / "train_judge.log").write_text(log.getvalue(), encoding="utf-8")
    seconds["fine-tuning"] = time.perf_counter() - started

    started = time.perf_counter()
    spec = f"transformers:{out / 'judge'}"
    config = judge_config(spec, allow_unvalidated=True, cache_size=0)
    record = validate_judge(rubric, golden, config, *validation_options(pass_threshold, gate, feedback))
    write_record(validation_path(rubric_path), record)
    seconds["validation"] = time.perf_counter() - started
    return JudgeModel(out / "judge", spec, record.model_id, training, record,
                      (warm.losses[0], warm.losses[-1]), seconds)


def validation_options(pass_threshold: float | str, gate: str,
                       feedback: pathlib.Path) -> tuple["ValidationOptions", list["FeedbackRecord"] | None]:
    """(ValidationOptions, calibration records) of a validation: ``"auto"`` calibrates the pass
    threshold on the reviews of ``feedback`` (validate_judge leaves the golden ones out)."""
    from calibrl.judge_server.authoring.feedback import read_feedback
    from calibrl.judge_server.authoring.validation import ValidationOptions

    if pass_threshold == "auto":
        return ValidationOptions(gate=gate), read_feedback(feedback)
    return ValidationOptions(pass_threshold=float(pass_threshold), gate=gate), None


__all__ = [
    "JUDGE_MAX_DOCS", "JudgeModel", "JudgeModelSettings", "LLM_RUBRIC_ID", "build_and_validate_judge",
    "build_judge_base", "distill_llm_rubric", "domain_text_examples", "judge_config", "judge_prompt_constants",
    "serve_overrides", "validation_options",
]
