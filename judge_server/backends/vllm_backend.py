"""The vLLM judge backend (``gpu`` extra): a thin adapter over the shared prompt
encoding (``backends.encoding``) and score extraction (``judge_server.prompts``).

Every item x criterion prompt goes to ``vllm.LLM.generate`` as token ids with
``max_tokens=1``; automatic prefix caching computes an item's shared prefix once.
The engine runs with ``logprobs_mode="processed_logprobs"`` and each request allows
only the answer tokens, so the returned log-probabilities are exactly those of the
answers (renormalised over them, which leaves P(yes)/(P(yes)+P(no)) and the 1-5
expectation unchanged).

vLLM is imported only here, only when a ``vllm:`` judge is built: CPU installs never
touch it. Not exercised by the CPU test suite (see README: verified hardware).
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

from calibrl.errors import ConfigError, RewardError
from judge_server import prompts
from judge_server.backends import model_id_for
from judge_server.backends.encoding import PromptEncoder
from judge_server.rubric import Criterion, Rubric
from judge_server.types import JudgeItem


def import_vllm() -> Any:
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
    ) -> None:
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
