"""Configuration of the judge (in-process) and of the judge server (one config per process).

Load with ``calibrl.config.load_config(JudgeServerConfig, path, overrides)``; overrides
are dotted, e.g. ``judge.backend=transformers:/models/judge judge.cache_size=0
serving.port=50052``. ``calibrl serve judge --help`` lists every field.
"""

from __future__ import annotations

from dataclasses import dataclass

# JudgeConfig is shared with the trainer's in-process judge, so it lives in the core (calibrl.api).
from calibrl.api.judge_config import JudgeConfig
from calibrl.config import option
from calibrl.errors import ConfigError
from calibrl.serving import ServingConfig


def _judge_serving() -> ServingConfig:
    # a judge item is scored alone (batch-invariant), so larger units cost little fairness
    return ServingConfig(port=50052, max_unit_cost_s=0.1)


@dataclass
class JudgeServerConfig:
    """The judge server process: rubrics folder, judge, batching and network."""

    rubrics: str = option("", "Folder of rubric YAML files (each with its <file>.validation.json).")
    judge: JudgeConfig = option(factory=JudgeConfig, doc="The judge: backend, limits, cache.")
    serving: ServingConfig = option(factory=_judge_serving, doc="Network settings.")
    max_wait_ms: float = option(5.0, "How long a batch waits for concurrent callers to join.")
    max_batch_items: int = option(
        16, "Most items scored together in one batch (all callers); a large request is split, so other "
            "callers wait for at most one such batch.")
    max_queue_items: int = option(4096, "Items waiting to be scored before RESOURCE_EXHAUSTED.")
    torch_threads: int = option(
        0, "CPU threads of the judge's models (torch.set_num_threads; ONNX Runtime uses as many), set at start; "
           "0 keeps torch's default. Scores may depend on it: docs/concepts/encoders.md.")
    rubric_poll_s: float = option(
        5.0, "Seconds between rereads of the rubrics folder: a changed rubric file with a passing validation "
             "record becomes its id's current version without a restart; 0 turns the poller off (the "
             "ReloadRubrics admin call still rereads it). See docs/concepts/rubric-lifecycle.md.")
    rubric_retention_s: float = option(
        600.0, "Seconds a superseded rubric version stays servable to callers that pin it (id@version); "
               "then it is retired (NOT_FOUND saying so). 0 retires it at once.")
    rubric_state_dir: str = option(
        "none", "Folder where the served rubric versions (current, retained with their retention clock, retired) are "
                "kept so they survive a restart, one folder per server; 'none' keeps them in memory only. The "
                "server never writes into the rubrics folder. See docs/concepts/rubric-lifecycle.md.")
    rubric_admin_tenants: list[str] = option(
        factory=list, doc="Tenants (of serving.api_keys_file) that may call ReloadRubrics; without API keys "
        "the call is refused.")

    def validate(self) -> None:
        if not self.rubrics:
            raise ConfigError("rubrics: required, the folder of rubric files (--rubrics DIR)")
        if self.torch_threads < 0:
            raise ConfigError(f"torch_threads={self.torch_threads}: must be >= 0 (0 keeps torch's default)")
        if self.rubric_poll_s < 0 or self.rubric_retention_s < 0:
            raise ConfigError(f"rubric_poll_s={self.rubric_poll_s}, rubric_retention_s={self.rubric_retention_s}: "
                              "must be >= 0 (0 turns the poller off / retires at once)")
        if not self.rubric_state_dir.strip():
            raise ConfigError("rubric_state_dir='': give the folder that keeps the served rubric versions across "
                              "a restart, or 'none' (the default) to keep them in memory only")
        if self.max_wait_ms < 0:
            raise ConfigError(f"max_wait_ms={self.max_wait_ms}: must be >= 0")
        if self.max_batch_items <= 0 or self.max_queue_items <= 0:
            raise ConfigError(f"max_batch_items={self.max_batch_items}, max_queue_items={self.max_queue_items}: "
                              "must be > 0")
        if self.max_queue_items < self.judge.max_batch_size:
            raise ConfigError(f"max_queue_items={self.max_queue_items} < judge.max_batch_size="
                              f"{self.judge.max_batch_size}: one full request could never be queued")
