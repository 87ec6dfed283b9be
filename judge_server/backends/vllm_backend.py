"""The vLLM judge backend (``gpu`` extra): a thin adapter over the shared prompt
encoding (``backends.encoding``) and score extraction (``calibrl.judge_server.prompts``).

Every item x criterion prompt goes to ``vllm.LLM.generate`` as token ids with
``max_tokens=1``; automatic prefix caching computes an item's shared prefix once.
The engine runs with ``logprobs_mode="processed_logprobs"`` and each request allows
only the answer tokens, so the returned log-probabilities are exactly those of the
answers (renormalised over them, which leaves P(yes)/(P(yes)+P(no)) and the 1-5
expectation unchanged).

Batch invariance: by default the engine runs in vLLM's batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``, documented by vLLM as beta, on NVIDIA GPUs of compute
capability 8.0 or newer and on some AMD and Intel accelerators; see vLLM's "Batch
Invariance" page), which swaps in kernels whose reductions do not depend on the batch.
vLLM reads the variable once per process, so it is set here before vLLM is imported;
when vLLM was already imported without it, the judge refuses to start rather than
serve scores that depend on the batch. ``vllm_batch_invariant=false`` turns it off.
Whether the mode is bitwise invariant together with prefix caching and
``processed_logprobs`` for a given model is vLLM's claim, not checked by us: no
machine we test on can run vLLM (docs/results/hardware.md).

vLLM is imported only here, only when a ``vllm:`` judge is built: CPU installs never
touch it. Not exercised by the CPU test suite (docs/results/hardware.md).
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import TYPE_CHECKING, Sequence

from calibrl.errors import ConfigError, RewardError
from calibrl.judge_server import prompts
from calibrl.judge_server.backends import model_id_for
from calibrl.judge_server.backends.encoding import PromptEncoder
from calibrl.judge_server.rubric import Criterion, Rubric
from calibrl.api.judge import JudgeItem

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def enable_batch_invariance() -> None:
    """Ask vLLM for batch-invariant kernels; it must happen before vLLM is imported (module doc)."""
    if os.environ.get(BATCH_INVARIANT_ENV) == "1":
        return
    if "vllm" in sys.modules:
        raise ConfigError(
            f"vllm_batch_invariant=true, but vLLM was imported before {BATCH_INVARIANT_ENV}=1 was set; "
            f"export {BATCH_INVARIANT_ENV}=1 before starting the process, or set vllm_batch_invariant=false")
    os.environ[BATCH_INVARIANT_ENV] = "1"


def import_vllm() -> "ModuleType":
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(
            "judge backend 'vllm' needs the vllm package, which is not installed "
            f"({exc}). Install the GPU extra on a CUDA machine (pip install 'calibrl[gpu]') or use "
            "'transformers:<model folder>' instead."
        ) from None
    return vllm


class VLLMJudge:
    def __init__(
        self,
        path: str | pathlib.Path,
        *,
        prompt_options: prompts.PromptOptions = prompts.PromptOptions(),
        use_chat_template: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        if batch_invariant:
            enable_batch_invariance()
        vllm = import_vllm()
        folder = pathlib.Path(path)
        self.model_id = model_id_for("vllm", folder)
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(folder),
            dtype=dtype,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        tokenizer = self.llm.get_tokenizer()
        max_length = getattr(self.llm.llm_engine.model_config, "max_model_len", None)
        self.encoder = PromptEncoder(tokenizer, prompt_options, use_chat_template, max_length)

    def check_rubric(self, rubric: Rubric) -> None:
        if any(c.scale == "likert_1_5" for c in rubric.llm_criteria) and not all(self.encoder.answer_tokens.digits):
            raise ConfigError(f"rubric {rubric.id!r} has 1-5 questions but the judge tokenizer has no "
                              "single-token digits 1-5")

    def score(self, items: Sequence[JudgeItem], criteria: Sequence[Criterion], instructions: str) -> list[list[float]]:
        if not items or not criteria:
            return [[] for _ in items]
        encoded = self.encoder.encode(items, criteria, instructions)
        tokens = self.encoder.answer_tokens
        params = {}
        for scale in {c.scale for c in criteria}:
            allowed = list(tokens.for_scale(scale))
            params[scale] = self._vllm.SamplingParams(
                max_tokens=1, temperature=0.0, logprobs=len(allowed), allowed_token_ids=allowed)
        requests, sampling = [], []
        for prefix in encoded.prefix_ids:
            for criterion, suffix in zip(criteria, encoded.suffix_ids):
                requests.append({"prompt_token_ids": prefix + suffix})
                sampling.append(params[criterion.scale])
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        rows: list[list[float]] = []
        for b in range(len(items)):
            row = []
            for c, criterion in enumerate(criteria):
                completion = outputs[b * len(criteria) + c].outputs[0]
                if not completion.logprobs:
                    raise RewardError(f"items[{b}]: vLLM returned no logprobs for criterion {criterion.name!r}")
                top = {int(k): float(v.logprob) for k, v in completion.logprobs[0].items()}
                try:
                    row.append(prompts.score_from_logprob_map(criterion, top, tokens))
                except ValueError as exc:
                    raise RewardError(f"items[{b}]: {exc}") from None
            rows.append(row)
        return rows
