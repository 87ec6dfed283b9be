"""Step metrics, health warnings and the run log (JSONL + TensorBoard).

Metric names follow TRL's GRPOTrainer where TRL has one (``reward``,
``reward_std``, ``rewards/<component>/mean``, ``frac_reward_zero_std``, ``kl``,
``entropy``, ``clip_ratio/...``, ``grad_norm``, ``completions/mean_length``,
``learning_rate``), so dashboards built for TRL read calibrl runs unchanged.
``reward``, ``reward_std`` and ``frac_reward_zero_std`` (the fraction of groups
with all-equal rewards) come from the advantage estimator
(``calibrl.trainer.advantages.reward_metrics``).
Our own additions are namespaced: ``calibadv/*`` (from the advantage
estimator), ``sampling/*`` (dynamic sampling), ``rewards/judge_*`` (judge vs
retrieval disagreement), ``search/*`` (a search agent's collapse signals: well-formed
rate, searches per trajectory, repeated searches), ``steps/*`` (per-step dense
rewards, when scored), ``policy/ref_ppl`` (perplexity of the generated tokens under
the frozen reference, when one is loaded: ``calibrl.trainer.update.reference_perplexity``),
``timing/*`` (seconds per phase), ``health/*`` (warnings).

Everything here is plain Python over tensors already on the CPU; nothing
imports torch at module import time.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from calibrl import tracking
from calibrl.config import option
from calibrl.errors import ConfigError
from calibrl.trainer.alarms import BAND_ALARMS

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from calibrl.tracking import Tracker
    from calibrl.trainer.rewards import RewardBreakdown

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- metrics of one step


def component_metrics(components: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``rewards/<name>/std`` for every reward component."""
    names = sorted({name for comp in components for name in comp})
    metrics: dict[str, float] = {}
    for name in names:
        values = [float(comp[name]) for comp in components if name in comp]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        metrics[f"rewards/{name}/mean"] = mean
        metrics[f"rewards/{name}/std"] = math.sqrt(var)
    return metrics


def completion_metrics(completion_mask: "torch.Tensor", truncated: Sequence[bool] | None = None) -> dict[str, float]:
    """``completions/{mean,min,max}_length`` (generated tokens per rollout, observations
    excluded) and ``completions/clipped_ratio`` when truncation flags are given."""
    lengths = completion_mask.detach().sum(dim=1).float().cpu()
    metrics = {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
    }
    if truncated is not None:
        metrics["completions/clipped_ratio"] = float(sum(bool(t) for t in truncated)) / max(1, len(truncated))
    return metrics


def judge_retrieval_disagreement(breakdowns: Sequence["RewardBreakdown"], rubric_high: float) -> dict[str, float]:
    """How often the judge and retrieval disagree, over the rollouts that have both a
    retrieval result and a rubric score (rewrites scored with a rubric; others are
    left out, and with none of them nothing is returned):

    * ``rewards/judge_high_retrieval_miss``: share whose rubric total is >= ``rubric_high``
      while retrieval missed every gold document in the top k (``hit`` false): the judge
      likes a rewrite that does not find the answer, the sign of a gamed judge;
    * ``rewards/judge_low_retrieval_hit``: share whose retrieval hit a gold document while
      the rubric total is < ``rubric_high``;
    * ``rewards/judge_retrieval_disagreement``: their sum;
    * ``rewards/judge_retrieval_pairs``: how many rollouts were compared.

    ``breakdowns``: ``calibrl.trainer.rewards.RewardBreakdown`` (``retrieval``, ``rubric``)."""
    pairs = [(b.retrieval.hit, b.rubric.total) for b in breakdowns
             if b.retrieval is not None and b.rubric is not None]
    if not pairs:
        return {}
    high_miss = sum(1 for hit, total in pairs if not hit and total >= rubric_high) / len(pairs)
    low_hit = sum(1 for hit, total in pairs if hit and total < rubric_high) / len(pairs)
    return {
        "rewards/judge_high_retrieval_miss": high_miss,
        "rewards/judge_low_retrieval_hit": low_hit,
        "rewards/judge_retrieval_disagreement": high_miss + low_hit,
        "rewards/judge_retrieval_pairs": float(len(pairs)),
    }


# --------------------------------------------------------------------------- health bands


@dataclass
class HealthConfig:
    """Healthy bands of the stability signals; leaving one logs a warning (the band alarms of
    ``calibrl.trainer.alarms``)."""

    max_frac_reward_zero_std: float = option(
        0.6, "Warn when more than this fraction of groups have zero reward variance (no signal)."
    )
    min_reward_std: float = option(0.02, "Warn when the batch reward std falls below this (reward collapse).")
    max_reward_std: float = option(1e9, "Warn when the batch reward std rises above this (reward scale drift).")
    kl_target: float = option(0.5, "Warn when kl to the reference passes this (policy drifting away).")
    max_grad_norm_warn: float = option(1e3, "Warn when the pre-clip grad norm passes this (instability).")
    rubric_high: float = option(
        0.5, "Judge vs retrieval: a rubric total >= this counts as the judge approving a rewrite."
    )
    max_judge_retrieval_disagreement: float = option(
        0.3, "Warn when more than this share of rewrites has judge and retrieval disagreeing (either direction)."
    )

    def validate(self) -> None:
        if not 0.0 <= self.max_frac_reward_zero_std <= 1.0:
            raise ConfigError(
                f"health.max_frac_reward_zero_std={self.max_frac_reward_zero_std}: must be in [0, 1]"
            )
        if self.min_reward_std < 0 or self.max_reward_std < self.min_reward_std:
            raise ConfigError(
                f"health.min_reward_std={self.min_reward_std}, health.max_reward_std={self.max_reward_std}: "
                "need 0 <= min_reward_std <= max_reward_std"
            )
        if self.kl_target <= 0:
            raise ConfigError(f"health.kl_target={self.kl_target}: must be > 0")
        if not 0.0 <= self.rubric_high <= 1.0:
            raise ConfigError(f"health.rubric_high={self.rubric_high}: must be in [0, 1] (rubric totals are)")
        if not 0.0 <= self.max_judge_retrieval_disagreement <= 1.0:
            raise ConfigError(
                f"health.max_judge_retrieval_disagreement={self.max_judge_retrieval_disagreement}: must be in [0, 1]"
            )


def health_warnings(metrics: Mapping[str, float], bands: HealthConfig) -> list[str]:
    """One message per signal that left its healthy band this step: the band alarms of
    ``calibrl.trainer.alarms.BAND_ALARMS``, in their order."""
    warnings: list[str] = []
    for alarm in BAND_ALARMS:
        value = metrics.get(alarm.metric)
        if value is not None and alarm.fires(value, bands):
            warnings.append(alarm.warning(value, bands, metrics))
    return warnings


# --------------------------------------------------------------------------- the run log


class RunLog:
    """Writes one JSON object per step to ``metrics.jsonl`` under ``output_dir`` and the
    same scalars to the experiment trackers (``calibrl.tracking``; by default just
    TensorBoard in ``tensorboard/``). Only rank 0 creates one.

    ``tracker`` replaces the default trackers; :meth:`close` closes it when
    ``close_tracker`` (a caller that logs more to it, e.g. a held-out table, closes it).
    ``resume_step`` > 0 continues a run from that step: records of later steps
    (logged after the checkpoint a crashed run resumes from) are dropped from
    ``metrics.jsonl`` and TensorBoard, so every step appears once."""

    def __init__(self, output_dir: str | pathlib.Path, tensorboard: bool = True, resume_step: int = 0,
                 tracker: "Tracker | None" = None, close_tracker: bool = False) -> None:
        self.output_dir = pathlib.Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        kept: list[str] = []
        if resume_step > 0 and self.jsonl_path.exists():
            with self.jsonl_path.open(encoding="utf-8") as handle:
                kept = [line for line in handle if line.strip() and json.loads(line)["step"] <= resume_step]
        self._jsonl = self.jsonl_path.open("w", encoding="utf-8")
        self._jsonl.writelines(kept)
        self._jsonl.flush()
        self._owns_tracker = tracker is None or close_tracker
        if tracker is None:
            tracker = tracking.open_trackers(["tensorboard"] if tensorboard else [], self.output_dir,
                                             resume_step=resume_step)
        self.tracker: Tracker | None = tracker

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: _json_number(v) for k, v in sorted(metrics.items())}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self.tracker.log_metrics(metrics, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._owns_tracker and self.tracker is not None:
            self.tracker.close()
        self.tracker = None


def _json_number(value: float) -> float | str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of dropping the key
    return value


def read_log(path: str | pathlib.Path) -> list[dict[str, float | str]]:
    """The records of a run's ``metrics.jsonl``, in order (a missing file: none); a NaN or
    infinite metric reads back as its text (``"nan"``)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def progress_postfix(metrics: Mapping[str, float], keys: Iterable[str] = ("reward", "kl", "grad_norm")) -> str:
    """The short text shown after the tqdm bar."""
    parts = [f"{k}={metrics[k]:.3g}" for k in keys if k in metrics]
    return " ".join(parts)
