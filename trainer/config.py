"""The trainer's one config: every knob of `calibrl train`, typed and documented.

Load it with ``load_train_config(path, overrides)`` (YAML file plus
``dotted.key=value`` overrides); ``calibrl train --print-config`` lists every
field with its default and doc line. Variants are tagged unions chosen by a
``type`` field: ``advantage.type`` is ``grpo`` or ``calibadv``. Each section's
``validate()`` rejects bad values at load, and :meth:`TrainConfig.validate`
rejects bad combinations, each with a message naming the values and the fix.

Importing this module imports no torch.
"""

from __future__ import annotations

import math
import pathlib
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import yaml

from calibrl.config import load_config, option, to_dict
from calibrl.errors import ConfigError
from calibrl.api.judge_config import JudgeConfig
from calibrl.sme.queue import ReviewConfig
from calibrl.tracking import check_report_to
from calibrl.trainer.task_kinds import TASK_KINDS, record_formats, task_kind
from calibrl.trainer.diagnostics import HealthConfig
from calibrl.trainer.policy import LoraSettings
from calibrl.trainer.rewards import RewardConfig

if TYPE_CHECKING:  # pragma: no cover
    from calibrl.trainer.policy import LoraSettings

INPROCESS = "inprocess"
NO_JUDGE = "none"
# rollout.chat_template -> the rollout functions' chat_template argument.
CHAT_TEMPLATE_CHOICES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
_TEMPLATE_FIELDS = ("query", "context")


@dataclass
class LoraConfig:
    """A fresh LoRA adapter on the policy (needs peft); only the adapter is trained."""

    enabled: bool = option(False, "Train a LoRA adapter instead of every weight.")
    r: int = option(16, "Adapter rank.")
    alpha: int = option(32, "Scaling numerator: the update is scaled by alpha / r.")
    dropout: float = option(0.05, "Dropout on the adapter input.")
    target_modules: list[str] = option(factory=lambda: ["all-linear"], doc="Module names, or peft's 'all-linear'.")

    def validate(self) -> None:
        if self.enabled:
            if self.r < 1:
                raise ConfigError(f"policy.lora.r={self.r}: must be >= 1")
            if self.alpha <= 0:
                raise ConfigError(f"policy.lora.alpha={self.alpha}: must be > 0")
            if not 0.0 <= self.dropout < 1.0:
                raise ConfigError(f"policy.lora.dropout={self.dropout}: must be in [0, 1)")
            if not self.target_modules:
                raise ConfigError("policy.lora.target_modules is empty: name modules or use ['all-linear']")

    def settings(self) -> "LoraSettings | None":
        """The ``calibrl.trainer.policy.LoraSettings`` of this config, or None when disabled."""
        if not self.enabled:
            return None

        targets: str | tuple[str, ...] = self.target_modules[0] if self.target_modules == ["all-linear"] else tuple(self.target_modules)
        return LoraSettings(r=self.r, alpha=self.alpha, dropout=self.dropout, target_modules=targets)


@dataclass
class PolicyConfig:
    """The model being trained."""

    path: str = option("", "Local folder of the policy (save_pretrained output, or a LoRA adapter folder).")
    device: str = option("auto", "auto, cpu, cuda or cuda:N (torchrun ranks take cuda:LOCAL_RANK).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "float32", "Weight dtype; keep float32 weights and use precision=bf16 autocast for mixed precision."
    )
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass (saves memory).")
    lora: LoraConfig = option(factory=LoraConfig, doc="LoRA adapter settings.")

    def validate(self) -> None:
        if not self.path.strip():
            raise ConfigError("policy.path is empty: set policy.path=<folder of a Hugging Face causal LM>")


@dataclass
class TasksConfig:
    """Training tasks (JSONL; see calibrl.trainer.tasks for the formats)."""

    path: str = option("", "JSONL file of tasks.")
    format: str = option(
        "auto", "Record format: rewrite, search, hotpotqa or a registered kind's; auto looks at the keys."
    )
    kind: str = option(
        "auto", "Agent to train: rewrite (query rewriter), search (multi-step agent) or another registered task kind; "
        "auto = the format's kind."
    )
    heldout_fraction: float = option(
        0.0, "Fraction held out of training (for `calibrl eval` or eval.heldout_split); 0 trains on all."
    )
    limit: int = option(0, "Use only the first N tasks (0 = all); handy for smoke runs.")
    shuffle: bool = option(True, "Visit tasks in a fresh seeded permutation each epoch.")

    def validate(self) -> None:
        if not self.path.strip():
            raise ConfigError("tasks.path is empty: set tasks.path=<tasks.jsonl>")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"tasks.heldout_fraction={self.heldout_fraction}: must be in [0, 1)")
        if self.limit < 0:
            raise ConfigError(f"tasks.limit={self.limit}: must be >= 0 (0 = all tasks)")
        if self.format != "auto" and self.format not in record_formats():
            raise ConfigError(f"tasks.format: {self.format!r} is not one of {['auto', *record_formats()]}")
        if self.kind != "auto" and self.kind not in TASK_KINDS:
            raise ConfigError(f"tasks.kind: {self.kind!r} is not one of {['auto', *TASK_KINDS]}")

    def may_be_multi_step(self) -> bool:
        """Whether the tasks may be multi-step trajectories (``auto``: not known before the file is read)."""
        return self.kind == "auto" or task_kind(self.kind).multi_step


@dataclass
class ServicesConfig:
    """Where rewards come from: the two gRPC services, or in-process equivalents."""

    retrieval: str = option(
        INPROCESS, "Retrieval service target (host:port, dns:///name:port) or 'inprocess' (loads index_dir)."
    )
    judge: str = option(
        INPROCESS, "Judge service target, 'inprocess' (loads rubric_dir), or 'none' when no rubric weight is set."
    )
    index_dir: str = option("", "Index folder for retrieval=inprocess (built with `calibrl index build`).")
    rubric_dir: str = option("", "Folder of rubric files for judge=inprocess.")
    inprocess_judge: JudgeConfig = option(factory=JudgeConfig, doc="The in-process judge (judge=inprocess).")
    inprocess_device: str = option("cpu", "Device of the in-process retriever's embedder.")
    timeout_s: float = option(30.0, "Deadline of each service call, in seconds.")
    max_attempts: int = option(5, "Attempts per call on UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED.")
    api_key: str = option("", "API key sent as 'authorization: Bearer <key>' (or set CALIBRL_API_KEY).")
    tls_ca_file: str = option("", "PEM root certificate for TLS; empty = plaintext.")

    def validate(self) -> None:
        if not self.retrieval.strip():
            raise ConfigError("services.retrieval is empty: give host:port or 'inprocess' (with services.index_dir)")
        if self.retrieval == INPROCESS and not self.index_dir.strip():
            raise ConfigError(
                "services.retrieval=inprocess needs services.index_dir=<index folder>; or point "
                "services.retrieval at a running retrieval server (host:port)"
            )
        if self.judge == INPROCESS and not self.rubric_dir.strip():
            raise ConfigError(
                "services.judge=inprocess needs services.rubric_dir=<rubric folder>; or point services.judge at "
                "a running judge (host:port), or set services.judge=none when no rubric weight is used"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"services.timeout_s={self.timeout_s}: must be > 0")
        if self.max_attempts < 1:
            raise ConfigError(f"services.max_attempts={self.max_attempts}: must be >= 1")


@dataclass
class RolloutConfig:
    """Sampling of the G rollouts per task."""

    engine: Literal["transformers", "vllm"] = option("transformers", "Generation engine; vllm needs a GPU.")
    group_size: int = option(8, "Rollouts per task (G); the group baseline is their mean reward.")
    prompts_per_step: int = option(8, "Tasks per optimizer step, over all ranks (rollouts = this x group_size).")
    chunk_prompts: int = option(
        0, "Tasks generated per chunk: each chunk's rewards are scored while the next generates (0 = auto)."
    )
    off_policy_steps: int = option(
        0,
        "0: on-policy. 1: generate step t+1's rollouts before step t's update, so their scoring runs behind a "
        "whole step; they are trained one update stale, the clipped ratio to their behaviour log-probs corrects it.",
    )
    dynamic_sampling: bool = option(
        False,
        "DAPO dynamic sampling: sample rounds of prompts_per_step tasks and keep the groups whose rewards are "
        "not all equal, up to prompts_per_step groups (on-policy only; see calibrl.trainer.dynamic_sampling).",
    )
    max_sampling_rounds: int = option(
        4, "Dynamic sampling: most rounds per step; then the batch is filled up with all-equal groups."
    )
    max_new_tokens: int = option(48, "Rewriter: tokens per completion. Search agent: tokens per turn.")
    temperature: float = option(1.0, "Sampling temperature (also divides the logits of the loss, as in TRL).")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    max_turns: int = option(4, "Search agent: generated turns per trajectory, the answer turn included.")
    max_obs_tokens: int = option(256, "Search agent: tokens of retrieved text per observation.")
    search_top_k: int = option(3, "Search agent: documents returned per <search>.")
    generation_batch_size: int = option(0, "Transformers engine: prompts per forward batch (0 = all at once).")
    share_prompt_prefix: bool = option(
        True,
        "Run a group's shared prompt once per forward pass (the transformers engine's prefill, the policy's and "
        "the reference's log-probs) and let each rollout attend to its keys and values: the same numbers up to "
        "float rounding, several times less work when prompts are long; false: every rollout runs its whole prompt.",
    )
    share_generation_prompts: Literal["auto", "on", "off"] = option(
        "auto",
        "The transformers engine's prefill alone: a prompt that appears several times in a generation batch (a "
        "group's prompt; a search agent's conversations whose turns so far are the same) runs once and its keys "
        "and values are copied to each row. auto = as share_prompt_prefix; on / off whatever it says, e.g. on with "
        "share_prompt_prefix=false where prompts are a small share of each row and the shared log-prob pass costs "
        "more than it saves.",
    )
    prompt_template: str = option(
        "",
        "Policy prompt: empty = the task kind's built-in template; else text with {query} (required) and "
        "{context} (optional), or @path of a UTF-8 file (relative to the current dir, read at load: the "
        "saved config holds the text).",
    )
    chat_template: Literal["auto", "on", "off"] = option(
        "auto", "Wrap the prompt in the tokenizer's chat template: auto = when the tokenizer has one."
    )

    def validate(self) -> None:
        # Resolve @file first so that the saved config.yaml (and every checkpoint's)
        # holds the template text itself, not a path that may not exist later.
        self.prompt_template = resolve_prompt_template(self.prompt_template)
        if self.group_size < 2:
            raise ConfigError(
                f"rollout.group_size={self.group_size}: GRPO needs >= 2 rollouts per task (a group of one has "
                "advantage 0 and teaches nothing); use 4-16"
            )
        if self.prompts_per_step < 1:
            raise ConfigError(f"rollout.prompts_per_step={self.prompts_per_step}: must be >= 1")
        if self.chunk_prompts < 0:
            raise ConfigError(f"rollout.chunk_prompts={self.chunk_prompts}: must be >= 0 (0 = auto)")
        if self.off_policy_steps not in (0, 1):
            raise ConfigError(
                f"rollout.off_policy_steps={self.off_policy_steps}: must be 0 (on-policy) or 1 (generate the next "
                "step's rollouts while this step's rewards are scored)"
            )
        if self.max_sampling_rounds < 1:
            raise ConfigError(
                f"rollout.max_sampling_rounds={self.max_sampling_rounds}: must be >= 1 (the rounds of tasks dynamic "
                "sampling may draw per step before it trains on what it has)"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"rollout.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(
                f"rollout.temperature={self.temperature}: training samples must be random, use > 0 (e.g. 1.0); "
                "greedy decoding is for `calibrl eval`"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p}: must be in (0, 1]")
        for name in ("max_turns", "max_obs_tokens", "search_top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name}={getattr(self, name)}: must be >= 1")
        if self.generation_batch_size < 0:
            raise ConfigError(f"rollout.generation_batch_size={self.generation_batch_size}: must be >= 0")

    def template_for(self, kind: str) -> str:
        """The prompt template of a policy of task kind ``kind`` (``calibrl.trainer.task_kinds``):
        the configured one, or the kind's built-in template when none is set."""
        return self.prompt_template or task_kind(kind).builtin_template

    def chat_template_flag(self) -> bool | None:
        """``chat_template`` as the rollout functions take it (None = auto)."""
        return CHAT_TEMPLATE_CHOICES[self.chat_template]

    def chunk_size(self, prompts_on_rank: int) -> int:
        """Tasks per generation chunk on a rank holding ``prompts_on_rank`` tasks."""
        if self.chunk_prompts:
            return min(self.chunk_prompts, prompts_on_rank)
        # Two chunks hide most of the reward latency behind the second chunk's
        # generation; more chunks shrink generation batches for little gain.
        return max(1, math.ceil(prompts_on_rank / 2))


def resolve_prompt_template(value: str, where: str = "rollout.prompt_template") -> str:
    """The template text of a ``prompt_template`` value: ``""`` (the built-in one) stays
    ``""``, ``@path`` is replaced by the UTF-8 text of that file (relative to the
    current directory), any other value is the template itself. Raises ConfigError
    naming ``where``, the value (shortened) and the fix when the file cannot be read
    or the template could not be filled (see :func:`prompt_template_problem`)."""
    if value == "":
        return ""
    if not value.startswith("@"):
        problem = prompt_template_problem(value)
        if problem:
            raise ConfigError(f"{where}={_shorten(value)}: {problem}")
        return value
    path = pathlib.Path(value[1:]).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"cannot be read ({exc.strerror or exc})"
        raise ConfigError(
            f"{where}={_shorten(value)}: the file {path} {reason}; give the path of a UTF-8 text file after '@' "
            "(relative to the current directory), or the template text itself"
        ) from None
    if not text.strip():
        problem = f"is empty; write the template in it, or leave {where} empty for the built-in template"
    elif text.startswith("@"):
        problem = ("starts with '@', which marks a file path when the saved config is loaded again; start it "
                   "with any other character")
    else:
        problem = prompt_template_problem(text)
    if problem:
        raise ConfigError(f"{where}={_shorten(value)}: the template in {path} {problem}")
    return text


def prompt_template_problem(template: str) -> str | None:
    """Why ``calibrl.trainer.search_format.fill_template`` could not fill ``template``, with
    the fix (None when it can): no ``{query}``, a placeholder other than ``{query}``
    and ``{context}`` (conversions and format specs included), an unpaired brace."""
    placeholders = []  # each as written, e.g. "{query}", "{query!r}", "{0}"
    try:
        for _, name, spec, conversion in string.Formatter().parse(template):
            if name is not None:
                placeholders.append("{" + name + (f"!{conversion}" if conversion else "")
                                    + (f":{spec}" if spec else "") + "}")
    except ValueError as exc:
        return f"{exc}; write a literal brace as {{{{ or }}}}, the placeholders are {{query}} and {{context}}"
    unknown = sorted(set(placeholders) - {"{" + name + "}" for name in _TEMPLATE_FIELDS})
    if unknown:
        return (f"has the unknown placeholder {', '.join(unknown)}; only {{query}} (the question) and {{context}} "
                "(the task's context lines) are filled in, write a literal brace as {{ or }}")
    if "{query}" not in placeholders:
        return ("has no {query} placeholder; put {query} where the question goes (and optionally {context}), "
                "or leave it empty for the built-in template")
    return None


def _shorten(value: str, limit: int = 60) -> str:
    """``value`` as a repr, cut to about ``limit`` characters for error messages."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} chars)"


@dataclass
class GrpoAdvantage:
    """Group-relative advantages (TRL GRPOTrainer's scale_rewards)."""

    type: Literal["grpo"] = option("grpo", "Estimator name (registered in calibrl.trainer.advantages).")
    scale: Literal["none", "group", "batch"] = option("group", "Divide A = R - mean_g by the group or batch std.")
    step_credit: bool = option(
        False,
        "Search tasks: the tokens of search step k get the advantage of step k's dense reward against the "
        "group's step-k rewards (the answer keeps the trajectory's); needs reward.score_steps or w_steps > 0.",
    )

    # What the estimator needs of the rollouts besides rewards: None, or why it needs a kind's
    # multi-step records (TaskKind.multi_step), shown when the run's tasks do not have them.
    needs_multi_step: ClassVar[str | None] = None

    def params(self) -> dict[str, str | bool]:
        """Keyword parameters of the registered estimator."""
        return {"scale": self.scale, "step_credit": self.step_credit}

    def step_score_settings(self) -> None:
        """GRPO reads no step scores."""
        return None


@dataclass
class CalibAdvAdvantage:
    """CalibAdv (arXiv 2604.18235): calibrated negative advantages of intermediate search steps."""

    type: Literal["calibadv"] = option("calibadv", "Estimator name (registered in calibrl.trainer.advantages).")
    lambda_: float = option(1.0, "Answer rebalancing: positives scaled by N / (lambda * P); < 1 collapsed.")
    f1_threshold: float = option(
        0.7, "Silver documents come from a group's best well-formed rollouts when their F1 x format >= this."
    )
    use_gold: bool = option(False, "Use the tasks' gold document ids as the silver documents when present.")
    similarity_threshold: float = option(0.5, "A step whose think text is this similar to an earlier one scores 0.")

    needs_multi_step: ClassVar[str | None] = "CalibAdv calibrates multi-step trajectories"  # see GrpoAdvantage

    def params(self) -> dict[str, float]:
        """Keyword parameters of the registered estimator."""
        return {"lambda_": self.lambda_}

    def step_score_settings(self) -> "CalibAdvAdvantage":
        """Settings of the per-step scores this estimator reads (f1_threshold, use_gold,
        similarity_threshold)."""
        return self

    def validate(self) -> None:
        if not (self.lambda_ > 0 and math.isfinite(self.lambda_)):
            raise ConfigError(f"advantage.lambda_={self.lambda_}: must be > 0 (the authors use 1.0)")
        if not 0.0 <= self.f1_threshold <= 1.0:
            raise ConfigError(f"advantage.f1_threshold={self.f1_threshold}: must be in [0, 1]")
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ConfigError(f"advantage.similarity_threshold={self.similarity_threshold}: must be in [0, 1]")


@dataclass
class LossConfig:
    """The clipped policy loss (calibrl.trainer.losses.policy_loss)."""

    eps_low: float = option(0.2, "Lower clip: ratios below 1 - eps_low stop pushing negative advantages.")
    eps_high: float = option(0.2, "Upper clip: ratios above 1 + eps_high stop pushing positive ones (DAPO: 0.28).")
    beta: float = option(0.04, "Weight of the k3 KL penalty to the frozen reference; 0 skips the reference.")
    aggregation: Literal["sequence_mean", "token_mean", "constant"] = option(
        "sequence_mean", "Token aggregation: TRL grpo (sequence_mean), bnpo/dapo (token_mean), dr_grpo (constant)."
    )
    kl_ratio_correction: bool = option(
        False, "Weight the k3 KL term by the ratio r (TRL's use_bias_correction_kl); off keeps plain k3."
    )

    def validate(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ConfigError(f"loss.eps_low={self.eps_low}: must be in [0, 1) so that 1 - eps_low > 0")
        if not (self.eps_high >= 0 and math.isfinite(self.eps_high)):
            raise ConfigError(f"loss.eps_high={self.eps_high}: must be >= 0")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise ConfigError(f"loss.beta={self.beta}: must be >= 0 (0 = no KL term and no reference model)")


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule."""

    type: Literal["adamw"] = option("adamw", "Optimizer (AdamW is the one offered).")
    lr: float = option(1e-6, "Peak learning rate.")
    betas: list[float] = option(factory=lambda: [0.9, 0.999], doc="AdamW (beta1, beta2).")
    eps: float = option(1e-8, "AdamW epsilon.")
    weight_decay: float = option(0.0, "Decoupled weight decay.")
    schedule: Literal["constant", "linear", "cosine"] = option("constant", "Decay after warmup: none, linear, cosine.")
    warmup_steps: int = option(0, "Linear warmup from 0 to lr over this many steps.")
    min_lr_ratio: float = option(0.0, "linear/cosine decay ends at lr x this.")

    def validate(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"optimizer.lr={self.lr}: must be > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas={self.betas}: need two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ConfigError(f"optimizer.eps={self.eps}, optimizer.weight_decay={self.weight_decay}: need eps > 0, "
                              "weight_decay >= 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps={self.warmup_steps}: must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")


@dataclass
class EvalConfig:
    """Held-out evaluation during training (greedy decoding, as `calibrl eval` does)."""

    tasks: str = option("", "JSONL of held-out tasks, same kind as the training tasks ('' = no evaluation).")
    heldout_split: bool = option(
        False, "Evaluate the part of tasks.path that tasks.heldout_fraction holds out (instead of eval.tasks)."
    )
    every: int = option(0, "Evaluate every N steps (0 = only at the end); the last step is always evaluated.")
    on_start: bool = option(False, "Also evaluate the untrained policy, as step 0.")
    limit: int = option(0, "Evaluate the first N held-out tasks only (0 = all).")
    top_k: int = option(5, "Cut-off k of the rewriter's retrieval metrics (hit@k, recall@k, nDCG@k).")
    batch_size: int = option(32, "Held-out tasks generated together.")

    @property
    def enabled(self) -> bool:
        return bool(self.tasks.strip()) or self.heldout_split

    def validate(self) -> None:
        if self.tasks.strip() and self.heldout_split:
            raise ConfigError(
                f"eval.tasks={self.tasks} with eval.heldout_split=true: give one source of held-out tasks"
            )
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every}: must be >= 0 (0 = only at the end)")
        if self.limit < 0:
            raise ConfigError(f"eval.limit={self.limit}: must be >= 0 (0 = all held-out tasks)")
        for name in ("top_k", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name}={getattr(self, name)}: must be >= 1")

    def due(self, step: int, last_step: int) -> bool:
        """Whether the policy after ``step`` optimizer steps is evaluated."""
        if not self.enabled:
            return False
        if step == 0:
            return self.on_start
        return step == last_step or (self.every > 0 and step % self.every == 0)


@dataclass
class DistributedConfig:
    """Multi-process runs under torchrun (ignored in a single process)."""

    strategy: Literal["ddp", "fsdp"] = option(
        "ddp", "ddp: every rank holds the model, gradients are all-reduced; fsdp: FSDP2 shards weights, "
        "gradients and optimizer state (for models that do not fit one GPU). gloo on CPU, NCCL on GPU."
    )


@dataclass
class TrainConfig:
    """Everything `calibrl train` needs."""

    policy: PolicyConfig = option(factory=PolicyConfig, doc="The model being trained.")
    tasks: TasksConfig = option(factory=TasksConfig, doc="Training tasks.")
    services: ServicesConfig = option(factory=ServicesConfig, doc="Reward services.")
    reward: RewardConfig = option(factory=RewardConfig, doc="Reward blend (calibrl.trainer.rewards).")
    rollout: RolloutConfig = option(factory=RolloutConfig, doc="Sampling.")
    advantage: GrpoAdvantage | CalibAdvAdvantage = option(factory=GrpoAdvantage, doc="Advantage estimator.")
    loss: LossConfig = option(factory=LossConfig, doc="Policy loss.")
    optimizer: OptimizerConfig = option(factory=OptimizerConfig, doc="Optimizer and schedule.")
    health: HealthConfig = option(factory=HealthConfig, doc="Healthy bands; leaving one logs a warning.")
    distributed: DistributedConfig = option(factory=DistributedConfig, doc="torchrun settings.")
    eval: EvalConfig = option(factory=EvalConfig, doc="Held-out evaluation: heldout.jsonl and the trackers' table.")
    review: ReviewConfig = option(factory=ReviewConfig, doc="Review queue: recent rollouts sampled for expert "
                                  "review every N steps (calibrl.sme.queue).")
    steps: int = option(100, "Optimizer steps of the run.")
    gradient_accumulation_steps: int = option(
        1, "Micro-batches per optimizer step (the step's rollouts are split into this many backward passes)."
    )
    max_grad_norm: float = option(0.5, "Clip the global grad norm to this (0 disables clipping).")
    precision: Literal["auto", "fp32", "bf16"] = option(
        "auto", "auto: bf16 autocast on GPU, fp32 on CPU; bf16 forces autocast; fp32 disables it."
    )
    seed: int = option(0, "Seed of data order, sampling and every RNG (rank r uses seed + r for sampling).")
    output_dir: str = option("runs/train", "Where metrics.jsonl, tensorboard/ and checkpoints/ go.")
    checkpoint_every: int = option(50, "Write a checkpoint every N steps (0 = only at the end and on SIGTERM).")
    keep_checkpoints: int = option(3, "Keep the newest N checkpoints (0 = keep all).")
    report_to: list[str] = option(
        factory=lambda: ["tensorboard"],
        doc="Experiment trackers for metrics, config and tables: tensorboard, wandb, mlflow, trackio (several), or none.",
    )
    tracking_project: str = option("calibrl", "W&B / trackio project, MLflow experiment, that the run is filed under.")
    tensorboard: bool = option(True, "false drops 'tensorboard' from report_to (kept for older configs).")
    progress_bar: bool = option(True, "Show a tqdm progress bar on rank 0.")

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps}: must be >= 1")
        if self.gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps={self.gradient_accumulation_steps}: must be >= 1")
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        if self.gradient_accumulation_steps > rows:
            raise ConfigError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} > the step's "
                f"{rows} rollouts (prompts_per_step x group_size): lower it or raise prompts_per_step"
            )
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"max_grad_norm={self.max_grad_norm}: must be >= 0 (0 disables clipping)")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 0:
            raise ConfigError(
                f"checkpoint_every={self.checkpoint_every}, keep_checkpoints={self.keep_checkpoints}: must be >= 0"
            )
        if self.optimizer.warmup_steps > self.steps:
            raise ConfigError(
                f"optimizer.warmup_steps={self.optimizer.warmup_steps} > steps={self.steps}: the run would end "
                "before the learning rate reaches its peak; lower warmup_steps"
            )
        needs_multi_step = self.advantage.needs_multi_step
        if needs_multi_step and not self.tasks.may_be_multi_step():
            raise ConfigError(
                f"advantage.type={self.advantage.type} with tasks.kind={self.tasks.kind}: {needs_multi_step} "
                f"and {self.tasks.kind} rollouts have one step; use advantage.type=grpo, or a "
                f"multi-step tasks.kind ({', '.join(_multi_step_kinds())})"
            )
        if self.services.judge == NO_JUDGE and (self.reward.uses_rubric_for_rewrites or self.reward.uses_rubric_for_search):
            raise ConfigError(
                f"services.judge=none but reward.w_rubric={self.reward.w_rubric} / "
                f"reward.search_w_rubric={self.reward.search_w_rubric} need a judge: give a judge target, or set the "
                "rubric weights to 0 (or reward.binary_only=true)"
            )
        if self.rollout.dynamic_sampling and self.rollout.off_policy_steps:
            raise ConfigError(
                f"rollout.dynamic_sampling=true with rollout.off_policy_steps={self.rollout.off_policy_steps}: "
                "dynamic sampling waits for the rewards before it keeps a group, which removes the overlap one "
                "step off-policy exists for; set rollout.off_policy_steps=0 or rollout.dynamic_sampling=false"
            )
        if self.services.judge == NO_JUDGE and self.tasks.may_be_multi_step() and self.reward.uses_rubric_for_steps:
            raise ConfigError(
                f"services.judge=none but reward.step_w_rubric={self.reward.step_w_rubric} with step rewards on "
                "needs a judge serving reward.step_rubric_id: give a judge target, or set step_w_rubric to 0"
            )
        if getattr(self.advantage, "step_credit", False) and not (
            self.tasks.may_be_multi_step() and self.reward.scores_steps
        ):
            raise ConfigError(
                "advantage.step_credit=true needs multi-step tasks with step rewards: set tasks.kind to one of "
                f"{_multi_step_kinds()} and reward.score_steps=true (or reward.w_steps > 0)"
            )
        if self.rollout.engine == "vllm" and self.policy.device == "cpu":
            raise ConfigError("rollout.engine=vllm with policy.device=cpu: vLLM needs a GPU; use engine=transformers")
        if self.eval.heldout_split and self.tasks.heldout_fraction == 0:
            raise ConfigError(
                "eval.heldout_split=true but tasks.heldout_fraction=0 holds nothing out: set "
                "tasks.heldout_fraction (e.g. 0.1), or name a held-out file with eval.tasks"
            )
        if self.eval.enabled and self.distributed.strategy == "fsdp":
            raise ConfigError(
                "eval.tasks / eval.heldout_split with distributed.strategy=fsdp: a sharded policy cannot "
                "generate on one rank; evaluate the run's checkpoints afterwards with `calibrl eval --run-dir "
                "<output_dir> --tasks <held-out tasks> ...` (it adds the table to the run's trackers), or use "
                "distributed.strategy=ddp"
            )
        self._check_downweight()
        if not self.tracking_project.strip():
            raise ConfigError("tracking_project is empty: name the project the runs are filed under, e.g. calibrl")
        self.trackers()

    def _check_downweight(self) -> None:
        """review.on_alarm=downweight needs the drift check of review steps, and a rubric weight to lower."""
        if self.review.on_alarm == "downweight" and not (self.review.every_steps > 0 and self.review.drift):
            raise ConfigError(
                f"review.on_alarm=downweight with review.every_steps={self.review.every_steps}, review.drift="
                f"{str(self.review.drift).lower()}: the alarm comes from the drift check of a review step; set "
                "review.every_steps > 0 and review.drift=true"
            )
        if self.review.on_alarm == "downweight" and not (self.reward.uses_rubric_for_rewrites
                                                         or self.reward.uses_rubric_for_search):
            raise ConfigError(
                f"review.on_alarm=downweight with reward.w_rubric={self.reward.w_rubric}, search_w_rubric="
                f"{self.reward.search_w_rubric}: the reward has no rubric weight to lower; set one > 0 or use "
                "review.on_alarm=warn"
            )

    def trackers(self) -> list[str]:
        """The trackers to open: ``report_to``, checked (known, installed), less
        TensorBoard when ``tensorboard=false``."""
        names = check_report_to(self.report_to)
        return [n for n in names if self.tensorboard or n != "tensorboard"]

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.output_dir)

    def to_yaml(self) -> str:
        return yaml.safe_dump(to_dict(self), sort_keys=False)


def _multi_step_kinds() -> list[str]:
    return [name for name, kind in TASK_KINDS.items() if kind.multi_step]


def load_train_config(path: str | pathlib.Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load and validate a :class:`TrainConfig` (raises ConfigError naming the value and the fix)."""
    return load_config(TrainConfig, path, overrides)


__all__ = [
    "CHAT_TEMPLATE_CHOICES",
    "CalibAdvAdvantage",
    "DistributedConfig",
    "EvalConfig",
    "GrpoAdvantage",
    "LoraConfig",
    "LossConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "RolloutConfig",
    "ServicesConfig",
    "TasksConfig",
    "TrainConfig",
    "prompt_template_problem",
    "load_train_config",
    "resolve_prompt_template",
]
