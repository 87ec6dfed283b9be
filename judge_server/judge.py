"""The judge core: many rubrics, one backend, a result cache. No gRPC here.

``Judge.score(rubric_id, items)`` is what the servicer and the trainer's in-process
client call. Per item it returns every criterion's score in [0, 1] (rubric order),
the weighted total (:func:`calibrl.api.judge.aggregate`), the rubric hash and the
model id. Programmatic criteria are scored here with every backend; LLM criteria go
to the LLM backend, so a ``programmatic`` judge refuses rubrics that have any.

A rubric is served only when a passing validation record binds its hash to the
model id that scores it (:meth:`Judge.scorer_id`), unless ``allow_unvalidated`` is set
or the rubric is listed in ``unvalidated_rubrics``. A rubric without LLM criteria is
scored the same by every backend, so its scorer id is the programmatic judge's
(``programmatic[<embedder>]``) on any server: one validation of it serves beside any
LLM rubric, in one server. Tenancy: a rubric lists the
tenants that may use it (``Rubric.visible_to``); ``tenant=None`` means no
authentication is configured and every rubric is visible.
"""

from __future__ import annotations

import contextlib

import logging
import math
import pathlib
import threading
from typing import Sequence

from calibrl import telemetry
from calibrl.errors import ConfigError, FailedPrecondition, InvalidArgument, ResourceExhausted, RewardError
from calibrl.judge_server import programmatic
from calibrl.judge_server.backends import LLMBackend, parse_spec
from calibrl.judge_server.cache import ResultCache, cache_key
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.prompts import PromptOptions
from calibrl.judge_server.rubric import Rubric, load_rubric_dir
from calibrl.api.judge import CriterionScore, ItemScore, JudgeItem, aggregate
from calibrl.judge_server.rubric_store import RubricStatus, RubricVersions
from calibrl.judge_server.validation_records import ValidationRecord, find_record, read_records, validation_path

log = logging.getLogger(__name__)

EMBEDDER_IDS = {"minilm": "minilm-l6-v2", "hashed-ngrams": "hashed-ngrams"}


def load_llm(config: JudgeConfig) -> LLMBackend | None:
    """Build the LLM backend a judge SPEC names (None for ``programmatic``)."""
    spec = parse_spec(config.backend)
    options = PromptOptions(max_docs=config.max_docs, max_doc_chars=config.max_doc_chars)
    if spec.backend == "programmatic":
        return None
    if spec.backend == "transformers":
        from calibrl.judge_server.backends.hf import TransformersJudge

        return TransformersJudge(
            spec.model_path, device=config.device, dtype=config.dtype, mode=config.llm_mode,
            max_items_per_forward=config.max_items_per_forward, prompt_options=options,
            use_chat_template=config.use_chat_template, max_new_tokens=config.max_new_tokens,
        )
    from calibrl.judge_server.backends.vllm_backend import VLLMJudge

    return VLLMJudge(
        spec.model_path, prompt_options=options, use_chat_template=config.use_chat_template,
        tensor_parallel_size=config.vllm_tensor_parallel_size,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization, dtype=config.dtype,
        batch_invariant=config.vllm_batch_invariant,
    )


class Judge:
    """Scores items with rubrics (see module doc)."""

    def __init__(
        self,
        rubrics: Sequence[Rubric],
        config: JudgeConfig | None = None,
        *,
        llm: LLMBackend | None = None,
        validations: Sequence[ValidationRecord] = (),
        cache: ResultCache | None = None,
    ) -> None:
        self.config = config or JudgeConfig()
        self.llm = llm
        backend_id = llm.model_id if llm is not None else "programmatic"
        self.model_id = f"{backend_id}[{EMBEDDER_IDS[self.config.embedder]}]"
        self.programmatic_id = f"programmatic[{EMBEDDER_IDS[self.config.embedder]}]"
        self.cache = cache if cache is not None else ResultCache(self.config.cache_size, self.config.cache_path or None)
        self._embedder = None
        self._embedder_lock = threading.Lock()
        self._compute_lock = threading.Lock()
        statuses: dict[str, RubricStatus] = {}
        for rubric in rubrics:
            if rubric.id in statuses:
                raise ConfigError(f"two rubrics share the id {rubric.id!r}")
            statuses[rubric.id] = self._check(rubric, find_record(validations, rubric.hash, self.scorer_id(rubric)))
        # every version of every rubric: current, retained for pinned callers, retired, refused
        self.versions = RubricVersions(statuses.values())

    @classmethod
    def from_config(cls, config: JudgeConfig, rubrics_dir: str | pathlib.Path) -> "Judge":
        """Load every rubric of a folder with its validation records, and the backend."""
        rubrics = load_rubric_dir(rubrics_dir)
        records: list[ValidationRecord] = []
        for rubric in rubrics:
            records.extend(read_records(validation_path(rubric.source_path)))
        return cls(rubrics, config, llm=load_llm(config), validations=records)

    # ------------------------------------------------------------------ rubrics

    def scorer_id(self, rubric: Rubric) -> str:
        """The model id that scores ``rubric``: this judge's, or the programmatic judge's
        when the rubric has no LLM criteria (its scores do not depend on the backend)."""
        return self.model_id if rubric.llm_criteria else self.programmatic_id

    def _check(self, rubric: Rubric, record: ValidationRecord | None) -> RubricStatus:
        if rubric.llm_criteria and self.llm is None:
            names = [c.name for c in rubric.llm_criteria]
            return RubricStatus(rubric, record, False,
                                f"rubric {rubric.id!r} has LLM criteria {names} but the judge backend is "
                                f"'programmatic' (no LLM); serve it with a transformers: or vllm: judge")
        if self.llm is not None:
            try:
                self.llm.check_rubric(rubric)
            except ConfigError as exc:
                return RubricStatus(rubric, record, False, f"rubric {rubric.id!r} cannot be scored by "
                                    f"{self.model_id!r}: {exc}")
        if record is not None and record.passed:
            return RubricStatus(rubric, record, True, f"validated: {record.reason}")
        why = (f"its validation for this model failed ({record.reason})" if record is not None
               else "no validation record for this model")
        judge_spec = self.config.backend if rubric.llm_criteria else "programmatic"
        reason = (f"rubric {rubric.id!r} (hash {rubric.hash}) is not validated for judge model "
                  f"{self.scorer_id(rubric)!r}: {why}. Run 'calibrl rubric validate --rubric "
                  f"{rubric.source_path or '<file>'} --golden <golden.jsonl> --judge {judge_spec}' or start the "
                  f"judge with --allow-unvalidated (or judge.unvalidated_rubrics={rubric.id})")
        if self.config.allow_unvalidated:
            return RubricStatus(rubric, record, True, "UNVALIDATED, served because allow_unvalidated is set: " + why)
        if rubric.id in self.config.unvalidated_rubrics:
            return RubricStatus(rubric, record, True,
                                "UNVALIDATED, served because judge.unvalidated_rubrics lists it: " + why)
        return RubricStatus(rubric, record, False, reason)

    def rubric_status(self, rubric: Rubric, record: ValidationRecord | None) -> RubricStatus:
        """Whether this judge may serve ``rubric`` with validation ``record`` (a candidate version)."""
        return self._check(rubric, record)

    def statuses(self, tenant: str | None = None) -> list[RubricStatus]:
        """The current version of every rubric ``tenant`` may see, by id."""
        return [s for s in self.versions.statuses() if s.rubric.visible_to(tenant)]

    def status(self, rubric_id: str, tenant: str | None = None, rubric_hash: str = "") -> RubricStatus:
        """The version ``rubric_id`` names: ``id`` (current) or ``id@version`` (pinned; see
        calibrl.judge_server.rubric_store); ``rubric_hash`` pins by the full hash."""
        return self.versions.lookup(rubric_id, tenant, rubric_hash)

    def resolve(self, rubric_id: str, tenant: str | None = None, rubric_hash: str = "") -> Rubric:
        """The rubric to score with, or the error that says why it cannot be used."""
        status = self.status(rubric_id, tenant, rubric_hash)
        if not status.usable:
            raise FailedPrecondition(status.reason)
        return status.rubric

    def rubric_by_hash(self, rubric_hash: str) -> Rubric:
        return self.versions.by_hash(rubric_hash)

    # ------------------------------------------------------------------ scoring

    def check_items(self, items: Sequence[JudgeItem]) -> None:
        """Reject an empty, oversized or malformed batch with the field and the limit."""
        config = self.config
        if not items:
            raise InvalidArgument("items", "empty batch; send at least one item")
        if len(items) > config.max_batch_size:
            raise ResourceExhausted(f"items: {len(items)} items in one request, limit max_batch_size="
                                    f"{config.max_batch_size}; split the batch")
        total_chars = 0
        for i, item in enumerate(items):
            if not item.output.strip():
                raise InvalidArgument(f"items[{i}].output", "empty; there is nothing to judge")
            if not item.query.strip():
                raise InvalidArgument(f"items[{i}].query", "empty; criteria compare the output with the query")
            for name in ("query", "output"):
                length = len(getattr(item, name))
                if length > config.max_text_chars:
                    raise ResourceExhausted(f"items[{i}].{name}: {length} characters, limit max_text_chars="
                                            f"{config.max_text_chars}")
            for name in ("retrieved_texts", "retrieved_doc_ids"):
                count = len(getattr(item, name))
                if count > config.max_retrieved:
                    raise ResourceExhausted(f"items[{i}].{name}: {count} entries, limit max_retrieved="
                                            f"{config.max_retrieved}")
            for j, text in enumerate(item.retrieved_texts):
                if len(text) > config.max_text_chars:
                    raise ResourceExhausted(f"items[{i}].retrieved_texts[{j}]: {len(text)} characters, limit "
                                            f"max_text_chars={config.max_text_chars}")
            for j, doc_id in enumerate(item.retrieved_doc_ids):
                if len(doc_id) > config.max_id_chars:
                    raise ResourceExhausted(f"items[{i}].retrieved_doc_ids[{j}]: {len(doc_id)} characters, limit "
                                            f"max_id_chars={config.max_id_chars}")
            if len(item.context) > config.max_context_entries:
                raise ResourceExhausted(f"items[{i}].context: {len(item.context)} entries, limit "
                                        f"max_context_entries={config.max_context_entries}")
            context_chars = sum(len(key) + len(value) for key, value in item.context)
            if context_chars > config.max_context_chars:
                raise ResourceExhausted(f"items[{i}].context: {context_chars} characters (keys and values), limit "
                                        f"max_context_chars={config.max_context_chars}")
            total_chars += (len(item.query) + len(item.output) + context_chars + sum(map(len, item.retrieved_texts))
                            + sum(map(len, item.retrieved_doc_ids)))
        if total_chars > config.max_request_chars:
            raise ResourceExhausted(f"items: {total_chars} characters in one request, limit max_request_chars="
                                    f"{config.max_request_chars}; split the batch")

    def score(self, rubric_id: str, items: Sequence[JudgeItem], tenant: str | None = None,
              rubric_hash: str = "") -> list[ItemScore]:
        """Score ``items`` with one rubric (cached results are marked ``cached``)."""
        rubric = self.resolve(rubric_id, tenant, rubric_hash)
        self.check_items(items)
        results, missing = self.lookup(rubric, items)
        if missing:
            unique = list(dict.fromkeys(items[i] for i in missing))
            computed = dict(zip(unique, self.compute(rubric, unique)))
            for i in missing:
                results[i] = computed[items[i]]
        return results  # type: ignore[return-value]

    def lookup(self, rubric: Rubric, items: Sequence[JudgeItem]) -> tuple[list[ItemScore | None], list[int]]:
        """Cached scores (None where missing) and the indices still to compute."""
        results: list[ItemScore | None] = [None] * len(items)
        missing = []
        scorer_id = self.scorer_id(rubric)
        for i, item in enumerate(items):
            hit = None
            if self.cache.enabled:
                key = cache_key(rubric.hash, scorer_id, item)
                hit = self.cache.get(key, rubric.id, rubric.hash, scorer_id)
                telemetry.record("cache", 1, result="miss" if hit is None else "hit", rubric=rubric.id)
            if hit is None:
                missing.append(i)
            else:
                results[i] = hit
        return results, missing

    def compute(self, rubric: Rubric, items: Sequence[JudgeItem], *, record: bool = True) -> list[ItemScore]:
        """Score ``items`` (no cache lookup) and store the results in the cache; ``record=False``
        (the server's start-up probe, which no caller asked for) neither counts the batch in the
        metrics nor stores the scores."""
        if not items:
            return []
        if record:
            telemetry.record("judge_batch_size", len(items), rubric=rubric.id)
        scorer_id = self.scorer_id(rubric)
        # one LLM backend runs one batch at a time; programmatic scorers are pure functions
        # and the embedder takes its own turns, so their batches may run side by side
        with self._compute_lock if rubric.llm_criteria else contextlib.nullcontext():
            columns: dict[str, list[float]] = {}
            context = programmatic.ScorerContext(glossary=rubric.glossary, embed=None)
            for criterion in rubric.criteria:
                if criterion.kind != "programmatic":
                    continue
                spec = programmatic.SCORERS[criterion.scorer]
                if spec.needs_embedder and context.embed is None:
                    context = programmatic.ScorerContext(rubric.glossary, self._embed)
                columns[criterion.name] = spec.fn(items, programmatic.full_params(criterion.scorer, criterion.params),
                                                  context)
            if rubric.llm_criteria:
                if self.llm is None:
                    raise FailedPrecondition(f"rubric {rubric.id!r} has LLM criteria and this judge has no LLM")
                rows = self.llm.score(items, rubric.llm_criteria, rubric.instructions)
                for c, criterion in enumerate(rubric.llm_criteria):
                    columns[criterion.name] = [row[c] for row in rows]
        results = []
        for i, item in enumerate(items):
            criteria = []
            for criterion in rubric.criteria:
                value = float(columns[criterion.name][i])
                if not math.isfinite(value) or not -1e-6 <= value <= 1 + 1e-6:
                    raise RewardError(f"items[{i}]: criterion {criterion.name!r} produced {value!r}, outside [0, 1]")
                criteria.append(CriterionScore(criterion.name, min(1.0, max(0.0, value)), criterion.weight,
                                               criterion.penalty))
            score = ItemScore(tuple(criteria), aggregate(criteria), rubric.id, rubric.hash, scorer_id)
            if self.cache.enabled and record:
                self.cache.put(cache_key(rubric.hash, scorer_id, item), score)
            results.append(score)
        return results

    def _embed(self, texts: list[str]):
        with self._embedder_lock:
            if self._embedder is None:
                from calibrl.embedding import load_embedder

                self._embedder = load_embedder(self.config.embedder, self.config.embedder_device,
                                               self.config.embedder_backend, self.config.embedder_cache_size)
        return self._embedder.encode(texts)

    def close(self) -> None:
        self.cache.close()
