"""Experts back in the loop during training: the review queue.

Every ``review.every_steps`` steps the trainer turns the rollouts of its recent steps into
sample-input items (:mod:`calibrl.sme.items`: the query, the output, what it retrieved, the
retrieval outcome, the judge's total and the version of the rubric that gave it) and picks
``review.n`` of them with the SME sampler (:func:`calibrl.sme.sample.choose_sample`: the items
the judge is least sure of, those where judge and retrieval disagree, and representatives of
the rest). They are appended to the queue, ``<review folder>/queue.jsonl``, which experts grade
with::

    calibrl sme review --sample RUN/review/queue.jsonl --out RUN/review/feedback.jsonl

The graded items are feedback records (``calibrl rubric distill`` reads them), so the next
rubric version is distilled from the old feedback plus these, validated, and picked up by the
judge server. On every review step the queue's items graded so far are scored by the run's
judge and compared with the experts (:mod:`calibrl.sme.drift`; ``drift/*`` metrics,
``review/drift.jsonl``): below the gate a warning names the criteria that disagree, and with
``review.on_alarm=stop`` the run stops after the step with a checkpoint, with
``review.on_alarm=downweight`` the rubric's weight in the reward is lowered from the next step on
(:mod:`calibrl.trainer.rubric_weight`); ``calibrl sme drift`` does the same check outside a run. An item's id is ``s<step>-<task id>-<rollout index>``, unique in
the run; a queue file that already holds an id (a resumed run) keeps its record and skips the
new one, so nothing an expert may already have graded is replaced.
"""

from __future__ import annotations

import collections
import logging
import math
import pathlib
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from calibrl.config import option
from calibrl.errors import ConfigError
from calibrl.sme.items import SampleItem

log = logging.getLogger(__name__)

QUEUE_FILE = "queue.jsonl"
FEEDBACK_FILE = "feedback.jsonl"


@dataclass
class ReviewConfig:
    """The trainer's review queue (calibrl.sme.queue): recent rollouts sampled for expert review."""

    every_steps: int = option(0, "Every N steps, sample recent rollouts into the review queue (0: no queue).")
    n: int = option(16, "Items sampled per review round.")
    window_steps: int = option(0, "Rollouts of the last this many steps form the pool a round samples from "
                                  "(0: every_steps).")
    max_pool: int = option(4096, "Most rollouts kept for a round (the newest).")
    folder: str = option("", "Folder of queue.jsonl (and where 'calibrl sme review' writes feedback.jsonl); "
                             "default <output_dir>/review.")
    embedder: Literal["minilm", "hashed-ngrams"] = option(
        "minilm", "Embedder of the sampler's k-means over query and output (hashed-ngrams: no model load).")
    seed: int = option(0, "Seed of the sampler (each round adds its step).")
    pass_threshold: float = option(0.6, "Judge pass = rubric total >= this (the sampler's judge-unsure band).")
    margin: float = option(0.15, "Judge unsure = |total - pass_threshold| <= this.")
    uncertain_share: float = option(0.2, "Share of n for judge-unsure rollouts.")
    disagree_share: float = option(0.2, "Share of n for judge-vs-retrieval disagreements.")
    drift: bool = option(
        True, "On each review step, score the queue's items the experts have graded so far (feedback.jsonl) and "
              "log the judge's agreement with them (drift/* metrics; calibrl.sme.drift).")
    drift_min_items: int = option(10, "Fewest graded items for a drift verdict.")
    min_kappa: float = option(0.6, "The drift gate: least Cohen's kappa of judge vs experts on the graded items.")
    drift_gate: Literal["estimate", "lower_bound", "upper_bound"] = option(
        "estimate", "What must reach min_kappa: the kappa's estimate; its 95% interval's lower bound (an alarm "
                    "unless the agreement is shown); or its upper bound (an alarm only when the whole interval is "
                    "below min_kappa: a few grades that disagree by chance raise none).")
    on_alarm: Literal["warn", "stop", "downweight"] = option(
        "warn", "Below the drift gate: warn (naming the criteria that disagree); stop: also stop the run after the "
                "step with a checkpoint, as SIGTERM does (resume it once the next rubric version is served); "
                "downweight: also multiply the rubric's weight in the blended reward by downweight_factor from the "
                "next step on, until a step is scored by another rubric version (calibrl.trainer.rubric_weight).")
    downweight_factor: float = option(
        0.25, "With on_alarm=downweight: what the rubric's weight (reward.w_rubric, reward.search_w_rubric) is "
              "multiplied by after an alarm, in [0, 1) (0 drops the rubric from the reward).")

    def validate(self) -> None:
        for name in ("every_steps", "window_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"review.{name}={getattr(self, name)}: must be >= 0 (0: see its help)")
        if self.drift_min_items < 2:
            raise ConfigError(f"review.drift_min_items={self.drift_min_items}: must be >= 2")
        if not -1.0 <= self.min_kappa <= 1.0:
            raise ConfigError(f"review.min_kappa={self.min_kappa}: must be in [-1, 1]")
        if not (math.isfinite(self.downweight_factor) and 0.0 <= self.downweight_factor < 1.0):
            raise ConfigError(f"review.downweight_factor={self.downweight_factor}: must be in [0, 1) (the rubric's "
                              "weight is multiplied by it after a drift alarm; 1 would change nothing)")
        if self.n < 1 or self.max_pool < 1:
            raise ConfigError(f"review.n={self.n}, review.max_pool={self.max_pool}: must be >= 1")
        try:
            self.sample_options(0).validate()
        except ConfigError as exc:
            raise ConfigError(f"review.{exc}") from None

    def sample_options(self, step: int) -> Any:
        from calibrl.sme.sample import SampleOptions

        return SampleOptions(n=self.n, seed=self.seed + step, pass_threshold=self.pass_threshold, margin=self.margin,
                             uncertain_share=self.uncertain_share, disagree_share=self.disagree_share)


def rollout_item(step: int, index: int, rollout: Any, breakdown: Any) -> SampleItem | None:
    """One training rollout as a sample-input item (None for an empty output: nothing to grade).

    A one-output rollout (its one text field, e.g. a query rewrite): the query, the output, the
    documents it retrieved and the retrieval signals of its reward. A trajectory (``rollout.steps``):
    the question, the trajectory as text (``search: ... | answer: ...``) and every document it
    retrieved."""
    import dataclasses

    task = rollout.task
    signals: dict[str, float] = {}
    documents: dict[str, str] = {}
    if getattr(rollout, "steps", None) is not None:  # a multi-step trajectory
        parts = [f"search: {s.query}" for s in rollout.steps]
        parts.append(f"answer: {(rollout.answer or '').strip()}" if rollout.answer is not None else "(no answer)")
        output = " | ".join(parts)
        for s in rollout.steps:
            for hit in s.result.hits:
                documents.setdefault(hit.doc_id, hit.text)
        if task.gold_doc_ids:
            signals["hit"] = float(bool(set(task.gold_doc_ids) & set(documents)))
        signals["well_formed"] = float(rollout.well_formed)
    else:  # one output: the rollout's text field, scored with the retrieval of its reward
        texts = [getattr(rollout, f.name) for f in dataclasses.fields(rollout)
                 if f.name != "task" and isinstance(getattr(rollout, f.name), str)]
        if len(texts) != 1:
            raise ConfigError(f"review queue: a {type(rollout).__name__} has {len(texts)} text fields; expected "
                              "one output, or steps")
        output = texts[0].strip()
        retrieval = getattr(breakdown, "retrieval", None)
        if retrieval is not None:
            for hit in retrieval.hits:
                documents.setdefault(hit.doc_id, hit.text)
            signals.update(hit=float(retrieval.hit), mrr=float(retrieval.mrr), recall=float(retrieval.recall),
                           ndcg=float(retrieval.ndcg))
    if not output:
        return None
    rubric = getattr(breakdown, "rubric", None)
    context = dict(task.context)
    return SampleItem(
        id=f"s{step}-{task.task_id}-{index}".replace("@", "_"), query=task.query, output=output,
        retrieved_doc_ids=tuple(documents),
        retrieved_texts=tuple(documents.values()) if documents and all(documents.values()) else (),
        gold_doc_ids=tuple(task.gold_doc_ids), signals=tuple(sorted(signals.items())),
        judge_total=float(rubric.total) if rubric is not None else None,
        model=f"step_{step}" + (f" rubric {rubric.rubric_id}@{rubric.rubric_hash[:12]}"
                                if rubric is not None and rubric.rubric_hash else ""),
        context=tuple(sorted(context.items())))


class ReviewQueue:
    """Collects a run's rollouts and, every ``every_steps`` steps, queues a sample for review."""

    def __init__(self, config: ReviewConfig, output_dir: str | pathlib.Path, write: bool = True) -> None:
        self.config = config
        self.folder = pathlib.Path(config.folder) if config.folder else pathlib.Path(output_dir) / "review"
        self.path = self.folder / QUEUE_FILE
        self.write = write  # rank 0 writes; the other ranks keep nothing
        self._pool: collections.deque[tuple[int, SampleItem]] = collections.deque(maxlen=config.max_pool)
        self._embed = None
        self._judge: Any = None  # attach(): the run's judge client, for the drift check
        self._rubric_id = ""
        self._run_async: Any = None
        self._stop_signal: Any = None
        self.last_drift: Any = None  # the latest DriftReport
        self.alarm_step = 0  # the last step whose drift check raised the alarm (0: none)
        self.alarm_hash = ""  # the rubric version that drift check scored with

    def attach(self, judge: Any, rubric_id: str, run_async: Any, stop_signal: Any = None) -> None:
        """The run's judge client and rubric (``reward.rubric_id``), how to run a coroutine, and the
        run's stop flag (an object with ``raised``, set by ``review.on_alarm=stop``: the run stops
        after the step with a checkpoint, as on SIGTERM)."""
        self._judge, self._rubric_id, self._run_async, self._stop_signal = judge, rubric_id, run_async, stop_signal

    @property
    def enabled(self) -> bool:
        return self.config.every_steps > 0 and self.write

    def observe(self, step: int, rollouts: Sequence[Any], breakdowns: Sequence[Any]) -> dict[str, float]:
        """Add a step's rollouts to the pool; on a review step, queue a sample. Returns the step's
        ``review/*`` metrics (none when the queue is off or it is not a review step)."""
        if not self.enabled:
            return {}
        for index, (rollout, breakdown) in enumerate(zip(rollouts, breakdowns)):
            item = rollout_item(step, index, rollout, breakdown)
            if item is not None:
                self._pool.append((step, item))
        if step % self.config.every_steps:
            return {}
        window = self.config.window_steps or self.config.every_steps
        pool = [item for seen, item in self._pool if seen > step - window]
        if not pool:
            log.warning("step %d: review queue: no rollout with an output in the last %d steps", step, window)
            return {"review/queued": 0.0}
        added = self._queue(step, pool)
        log.info("step %d: review queue: %d of %d recent rollouts queued for review in %s", step, added, len(pool),
                 self.path)
        metrics = {"review/queued": float(added), "review/queue_size": float(len(self.read()))}
        metrics.update(self.check_drift(step))
        return metrics

    def check_drift(self, step: int) -> dict[str, float]:
        """The drift report of the queue's graded items (``drift/*`` metrics; none without grades or a judge).
        Below the gate: a warning naming the criteria that disagree, ``review/drift.jsonl``, and with
        ``on_alarm=stop`` the run stops after this step."""
        import json

        from calibrl.judge_server.authoring.feedback import read_feedback
        from calibrl.sme.drift import DriftOptions, drift_report
        from calibrl.sme.store import split_feedback_id

        feedback = self.folder / FEEDBACK_FILE
        if not (self.config.drift and self._judge is not None and self._rubric_id and feedback.exists()):
            return {}
        queued = {item.id for item in self.read()}
        records = [r for r in read_feedback(feedback) if (split_feedback_id(r.id) or ("",))[0] in queued]
        if not records:
            return {}
        scores = self._run_async(self._judge.score(self._rubric_id, [r.to_item() for r in records]))
        rubric = self._run_async(_rubric_of(self._judge, scores[0].rubric_id, scores[0].rubric_hash))
        options = DriftOptions(min_kappa=self.config.min_kappa, pass_threshold=self.config.pass_threshold,
                               min_items=self.config.drift_min_items, min_items_name="review.drift_min_items",
                               gate=self.config.drift_gate)
        report = drift_report(rubric, records, scores, options, scores[0].model_id)
        self.last_drift = report
        with (self.folder / "drift.jsonl").open("a", encoding="utf-8") as out:
            out.write(json.dumps({"step": step, **report.to_json()}, sort_keys=True) + "\n")
        if report.alarm:
            log.warning("step %d: %s", step, report.reason)
            self.alarm_step, self.alarm_hash = step, scores[0].rubric_hash
            if self.config.on_alarm == "stop" and self._stop_signal is not None:
                log.warning("step %d: review.on_alarm=stop: the run stops after this step (checkpoint written)", step)
                self._stop_signal.raised = True
        return report.metrics()

    def _queue(self, step: int, pool: list[SampleItem]) -> int:
        from calibrl.sme.items import write_items
        from calibrl.sme.sample import choose_sample

        result = choose_sample(pool, self.config.sample_options(step), embed=self._embedder())
        existing = self.read()
        known = {item.id for item in existing}
        new = [item for item in result.items if item.id not in known]
        self.folder.mkdir(parents=True, exist_ok=True)
        write_items(self.path, [*existing, *new])
        return len(new)

    def read(self) -> list[SampleItem]:
        """The queue's items so far (none before the first round)."""
        from calibrl.sme.items import read_items

        return read_items(self.path) if self.path.exists() and self.path.stat().st_size else []

    def _embedder(self) -> Any:
        if self._embed is None:
            from calibrl.embedding import load_embedder

            embedder = load_embedder(self.config.embedder, "cpu")
            self._embed = lambda texts: embedder.encode(texts)
        return self._embed


async def _rubric_of(judge: Any, rubric_id: str, rubric_hash: str) -> Any:
    """The rubric version ``rubric_hash`` of ``rubric_id``: from an in-process judge, or parsed from
    the served file (GetRubric's ``source_yaml``) of a gRPC one."""
    from calibrl.judge_server.rubric import parse_rubric

    inner = getattr(judge, "judge", None)
    if inner is not None and hasattr(inner, "rubric_by_hash"):
        return inner.rubric_by_hash(rubric_hash)
    source = await judge.rubric_source(f"{rubric_id}@{rubric_hash}")
    return parse_rubric(source, f"{rubric_id}@{rubric_hash[:12]} (GetRubric)")
