"""Held-out evaluation of a policy, a checkpoint or an untrained base, greedy decoding.

- Query rewriter: one greedy rewrite per task, scored through the retrieval
  client at cut-off k: ``hit@k`` (any gold passage retrieved), ``all_gold@k``,
  ``recall@k``, ``mrr``, ``ndcg@k``; plus ``empty_rewrite_rate``. The optional
  raw-query baseline sends each task's query unchanged (no model).
- Search agent: one greedy Search-R1 trajectory per task: answer ``em`` and
  ``f1`` (normalised, as in the reward), ``answered`` (an ``<answer>`` was given),
  ``well_formed``, ``searches`` per trajectory and ``gold_doc_recall`` (share of
  a task's gold passages retrieved by any of its searches; tasks with gold ids).

Several models are evaluated on the same tasks so the rows compare side by side
(:func:`format_table`, and JSON through ``calibrl eval --out``).

Prompts: each model is prompted as it was trained. A checkpoint or run dir (or the
``model/`` folder of a checkpoint) uses the ``rollout.prompt_template`` and
``rollout.chat_template`` of its ``config.yaml``; a base model uses the task kind's
built-in template with ``chat_template=auto``. An explicit choice (``calibrl eval
--prompt-template / --chat-template``) overrides that for every model. Each row
reports the template it used (:class:`PromptChoice`, ``EvalResult.prompt``).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import pathlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Sequence, TypedDict

import yaml

from calibrl.config import from_dict
from calibrl.errors import ConfigError, InvalidArgument
from calibrl.trainer.checkpoint import MODEL_DIR, STATE_FILE, find_checkpoint
from calibrl.trainer import engines  # engines.make_engine is looked up per call (tests swap it)
from calibrl.trainer.policy import load_policy
from calibrl.trainer.task_kinds import TASK_KINDS, RunAsync, task_kind
from calibrl.trainer.tasks import load_tasks, split_tasks

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import RolloutConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.policy import Policy
    from calibrl.trainer.tasks import Task

log = logging.getLogger(__name__)

CHECKPOINT_CONFIG = "config.yaml"  # the training config the loop writes into every checkpoint


@dataclass
class EvalSettings:
    """How a model is decoded and scored (the same for every model of a comparison)."""

    top_k: int = 5  # cut-off k of the retrieval metrics
    mode: str | None = None  # retrieval mode (None = the server's default)
    max_new_tokens: int = 48  # per rewrite, or per search turn
    max_turns: int = 4  # search agent
    search_top_k: int = 3  # documents per <search>
    max_obs_tokens: int = 256  # retrieved tokens per observation
    batch_size: int = 32  # tasks generated together
    device: str = "auto"
    max_query_chars: int = 512  # rewrites are cut to this before they are sent

    def __post_init__(self) -> None:
        for name in ("top_k", "max_new_tokens", "max_turns", "search_top_k", "max_obs_tokens", "batch_size",
                     "max_query_chars"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class PromptReport(TypedDict, total=False):
    """The prompt a model was evaluated with, as the JSON output records it
    (:meth:`PromptChoice.report`; empty for the raw-query row)."""

    builtin: bool  # the task kind's built-in template
    sha256: str  # first 12 hex digits of the template text's hash
    template: str
    template_source: str  # default | checkpoint | flag
    chat_template: str  # auto | on | off
    chat_template_source: str
    chat_template_applied: bool


@dataclass
class EvalResult:
    """One row of the comparison."""

    name: str
    model: str  # the folder the weights came from ("" for the raw-query baseline)
    kind: str  # the task kind's name (calibrl.trainer.task_kinds)
    num_tasks: int
    metrics: dict[str, float] = field(default_factory=dict)
    prompt: PromptReport = field(default_factory=lambda: PromptReport())  # empty for the raw-query row

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class PromptChoice:
    """The prompt one model is evaluated with, and where each half came from:
    ``default`` (a base model, no flag), ``checkpoint`` (its config.yaml) or ``flag``."""

    template: str = ""  # "" = the built-in template of the task kind
    chat_template: str = "auto"  # auto | on | off (rollout.chat_template)
    template_source: str = "default"
    chat_template_source: str = "default"

    def rollout_config(self) -> "RolloutConfig":
        """A :class:`~calibrl.trainer.config.RolloutConfig` holding this choice, so eval picks the
        effective template exactly as training does."""
        # lazy: config imports the judge server, which this module does not
        from calibrl.trainer.config import RolloutConfig

        return RolloutConfig(prompt_template=self.template, chat_template=self.chat_template)  # type: ignore[arg-type]

    def report(self, kind: str, chat_template_applied: bool) -> PromptReport:
        """What the JSON output records: the effective template text, a short hash of
        it, whether it is the built-in one, and the chat-template choice."""
        text = self.rollout_config().template_for(kind)
        return PromptReport(
            builtin=not self.template,
            sha256=hashlib.sha256(text.encode("utf-8")).hexdigest()[:12],
            template=text,
            template_source=self.template_source,
            chat_template=self.chat_template,
            chat_template_source=self.chat_template_source,
            chat_template_applied=chat_template_applied,
        )


# --------------------------------------------------------------------------- inputs


def resolve_model_path(path: str | pathlib.Path) -> pathlib.Path:
    """A loadable model folder for ``path``: a checkpoint's ``model/``, a run dir's
    latest checkpoint's ``model/``, or ``path`` itself (a model or adapter folder)."""
    path = pathlib.Path(path)
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return path
    if (path / STATE_FILE).exists() or (path / "checkpoints").is_dir():
        return find_checkpoint(path) / MODEL_DIR
    raise ConfigError(
        f"--model {path}: not a model folder (config.json / adapter_config.json), a checkpoint or a run dir"
    )


def checkpoint_config_path(path: str | pathlib.Path) -> pathlib.Path | None:
    """The ``config.yaml`` of the checkpoint ``path`` is, holds (a run dir: its latest
    checkpoint) or is the ``model/`` folder of; None for a base model or adapter folder."""
    path = pathlib.Path(path)
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        checkpoint = path.parent if path.name == MODEL_DIR and (path.parent / STATE_FILE).exists() else None
    elif (path / STATE_FILE).exists() or (path / "checkpoints").is_dir():
        checkpoint = find_checkpoint(path)
    else:
        checkpoint = None
    return checkpoint / CHECKPOINT_CONFIG if checkpoint is not None else None


def choose_prompt(model: str | pathlib.Path, kind: str, *, prompt_template: str | None = None,
                  chat_template: str | None = None) -> PromptChoice:
    """The prompt ``model`` is evaluated with on ``kind`` tasks: the given
    ``prompt_template`` (text, "" = built-in) and ``chat_template`` (auto|on|off) where
    not None, else what its checkpoint was trained with, else built-in and auto."""
    # lazy: config imports the judge server, which this module does not
    from calibrl.trainer.config import RolloutConfig

    trained = RolloutConfig()
    source = "default"
    config_path = checkpoint_config_path(model)
    if config_path is not None and (prompt_template is None or chat_template is None):
        if not config_path.exists():
            log.warning("%s has no %s: evaluating it with the built-in prompt", config_path.parent, CHECKPOINT_CONFIG)
        else:
            try:
                data = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
                raise ConfigError(f"{config_path}: cannot read the checkpoint's training config ({exc})") from None
            rollout = data.get("rollout") if isinstance(data, dict) else None
            if not isinstance(rollout, dict):
                raise ConfigError(f"{config_path}: no 'rollout' section; is this a calibrl checkpoint?")
            keys = ("prompt_template", "chat_template")  # a run older than these options has neither
            try:
                trained = from_dict(RolloutConfig, {k: rollout[k] for k in keys if k in rollout}, "rollout")
                trained.validate()
            except ConfigError as exc:
                raise ConfigError(f"{config_path}: {exc}") from None
            source = "checkpoint"
            tasks_section = data.get("tasks")
            trained_kind = tasks_section.get("kind") if isinstance(tasks_section, dict) else None
            if trained.prompt_template and trained_kind in TASK_KINDS and trained_kind != kind:
                log.warning("%s was trained as a %s agent with its own prompt template; evaluating it on %s tasks "
                            "with that template", config_path.parent, trained_kind, kind)
    return PromptChoice(
        template=trained.prompt_template if prompt_template is None else prompt_template,
        chat_template=trained.chat_template if chat_template is None else chat_template,
        template_source=source if prompt_template is None else "flag",
        chat_template_source=source if chat_template is None else "flag",
    )


def load_eval_tasks(path: str, *, fmt: str = "auto", kind: str = "auto", heldout_fraction: float = 0.0,
                    seed: int = 0, limit: int = 0) -> list["Task"]:
    """Tasks to evaluate: the file's tasks, or the held-out part of the split
    training made with the same ``heldout_fraction`` and ``seed``."""
    tasks = load_tasks(path, kind=None if kind == "auto" else kind, fmt=fmt)
    if heldout_fraction > 0:
        _, tasks = split_tasks(tasks, heldout_fraction, seed)
    if limit:
        tasks = tasks[:limit]
    kinds = {t.kind for t in tasks}
    if len(kinds) != 1:
        raise ConfigError(f"{path}: mixes task kinds {sorted(kinds)}; evaluate one agent at a time")
    return tasks


# --------------------------------------------------------------------------- evaluation


def evaluate_models(
    models: Sequence[str],
    tasks: Sequence["Task"],
    retrieval: "RetrievalClient",
    settings: EvalSettings,
    *,
    run_async: RunAsync,
    names: Sequence[str] | None = None,
    raw_query_baseline: bool = False,
    prompt_template: str | None = None,
    chat_template: str | None = None,
) -> list[EvalResult]:
    """One :class:`EvalResult` per model (loaded one at a time), same tasks and settings.

    ``prompt_template`` (text or ``@file``; "" = the built-in one) and ``chat_template``
    (auto, on, off) override every model's prompt; None (default) prompts each model as
    it was trained (:func:`choose_prompt`)."""
    # lazy: config imports the judge server, which this module does not
    from calibrl.trainer.config import CHAT_TEMPLATE_CHOICES, resolve_prompt_template

    if prompt_template is not None:
        prompt_template = resolve_prompt_template(prompt_template, "prompt_template")
    if chat_template is not None and chat_template not in CHAT_TEMPLATE_CHOICES:
        raise ConfigError(f"chat_template={chat_template!r}: must be one of {sorted(CHAT_TEMPLATE_CHOICES)}")
    kind = tasks[0].kind
    prompts = [choose_prompt(model, kind, prompt_template=prompt_template, chat_template=chat_template)
               for model in models]  # every checkpoint config is read before the first model loads
    rows: list[EvalResult] = []
    if raw_query_baseline:
        baseline = task_kind(kind).query_baseline
        if baseline is None:
            with_baseline = [name for name, k in TASK_KINDS.items() if k.query_baseline is not None]
            raise ConfigError(f"the raw-query baseline applies to {with_baseline} tasks only, not {kind}")
        rows.append(EvalResult("raw query", "", kind, len(tasks), baseline(tasks, retrieval, settings, run_async)))
    for i, model in enumerate(models):
        folder = resolve_model_path(model)
        policy = load_policy(str(folder), device=settings.device, dtype="auto")
        policy.model.eval()
        try:
            chat_applied = _chat_template_applied(prompts[i], policy.tokenizer, folder)
            metrics = evaluate_policy(policy, tasks, retrieval, settings, run_async=run_async, prompt=prompts[i])
        finally:
            del policy
            gc.collect()
        rows.append(EvalResult(names[i] if names else str(model), str(folder), kind, len(tasks), metrics,
                               prompts[i].report(kind, chat_applied)))
    return rows


def _chat_template_applied(prompt: PromptChoice, tokenizer: "PreTrainedTokenizerBase", folder: pathlib.Path) -> bool:
    """Whether ``prompt`` wraps the text in the tokenizer's chat template; a chat
    template asked for ("on") that the tokenizer lacks is an error."""
    has_chat_template = bool(getattr(tokenizer, "chat_template", None))
    flag = prompt.rollout_config().chat_template_flag()
    if flag and not has_chat_template:
        where = "--chat-template" if prompt.chat_template_source == "flag" else "the checkpoint's rollout.chat_template"
        raise ConfigError(
            f"chat_template=on ({where}) but the tokenizer of {folder} has no chat template; use auto or off"
        )
    return has_chat_template if flag is None else flag


def evaluate_policy(policy: "Policy", tasks: Sequence["Task"], retrieval: "RetrievalClient", settings: EvalSettings, *,
                    run_async: RunAsync, prompt: PromptChoice | None = None) -> dict[str, float]:
    """Greedy metrics of one loaded :class:`~calibrl.trainer.policy.Policy` on ``tasks``,
    prompted with ``prompt`` (default: the built-in template, chat template auto)."""
    rollout = (prompt or PromptChoice()).rollout_config()
    kind = tasks[0].kind
    template, chat_template = rollout.template_for(kind), rollout.chat_template_flag()
    engine = engines.make_engine("transformers", policy)
    return task_kind(kind).evaluate(engine, policy.tokenizer, tasks, retrieval, settings, run_async, template,
                                    chat_template)


# --------------------------------------------------------------------------- output


def format_table(rows: Sequence[EvalResult]) -> str:
    """The results as an aligned text table, one row per model."""
    if not rows:
        return "(no results)"
    names = task_kind(rows[0].kind).metric_names
    header = ["model", "tasks", *names, "prompt"]
    body = [[row.name, str(row.num_tasks), *(f"{row.metrics.get(n, float('nan')):.3f}" for n in names),
             _prompt_cell(row.prompt)] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def render(line: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))

    return "\n".join([render(header), "  ".join("-" * w for w in widths), *(render(line) for line in body)])


def _prompt_cell(prompt: PromptReport) -> str:
    """``built-in`` or ``custom:<hash>``, ``+chat`` when the chat template wrapped it."""
    if not prompt:
        return "-"
    cell = "built-in" if prompt["builtin"] else f"custom:{prompt['sha256'][:8]}"
    return cell + ("+chat" if prompt["chat_template_applied"] else "")
