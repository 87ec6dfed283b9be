"""The GRPO / CalibAdv training loop.

:func:`train` builds the run and :meth:`_Loop.step` reads top to bottom. Each step::

    rollout     G samples per task, generated in chunks; each chunk's reward
                coroutine is submitted to a background event loop at once, so
                scoring overlaps the next chunk's generation. One step
                off-policy (``rollout.off_policy_steps=1``) the next step's
                rollouts are generated here too, before this step's update, so
                their scoring overlaps everything up to the next step's wait
                With ``rollout.dynamic_sampling`` (DAPO) rounds of tasks are
                sampled and scored here until the batch holds enough groups
                whose rewards differ (``calibrl.trainer.dynamic_sampling``)
    reference   the frozen reference's log-probs, the first micro-batch's
                forward pass and (off-policy) the next batch's behaviour
                log-probs: they need no reward, so they hide scoring latency
    rewards     wait for the scores; a reward that could not be computed stops
                the run (checkpoint first) and is never trained on as 0
    advantages  per-token advantages from the registered estimator named by
                ``advantage.type`` (the loop is algorithm-blind)
    loss        clipped surrogate + k3 KL to the frozen reference, over
                ``gradient_accumulation_steps`` micro-batches
    step        gradient all-reduce (multi-process), grad-norm clip, AdamW, schedule
    log         TRL-named metrics to JSONL + the report_to trackers, health warnings, tqdm
    checkpoint  every ``checkpoint_every`` steps, at the end, and on SIGTERM
    held-out    every ``eval.every`` steps and at the end, greedy, on rank 0
                (``calibrl.trainer.heldout``: heldout.jsonl, ``eval/*``, the table)

Each phase is a stage with a typed hand-off, in its own module::

    calibrl.trainer.sampling        tasks -> PendingBatch (RolloutBatch + reward futures)
    calibrl.trainer.scoring         PendingBatch -> ScoredBatch (one RewardBreakdown per row)
    calibrl.trainer.training_batch  ScoredBatch -> TrainingBatch (token advantages)
    calibrl.trainer.update          TrainingBatch -> one optimizer update (PolicyUpdate)

and the run's other jobs are small objects: ``calibrl.trainer.pipeline`` (on- or one
step off-policy), ``calibrl.trainer.run_checkpoints`` (checkpoints with pending
rollouts), ``calibrl.trainer.stop_signal`` (SIGTERM), ``calibrl.trainer.step_log`` (metrics),
``calibrl.trainer.run_setup`` (building and resuming the run). The task kind
(``calibrl.trainer.task_kinds``) supplies the rollout function and the reward; the
advantage registry supplies the estimator and whatever it reads from the batch.

The retrieval and judge clients are injected: :func:`train` never opens a
network connection itself (``calibrl.trainer.cli`` builds gRPC or in-process clients).
See docs/design.md for the data flow of a step.

Departures from TRL's GRPOTrainer, on purpose:

* One optimizer update per batch of rollouts (TRL's ``num_iterations=1``):
  ``old_logp`` is the detached current log-probability, so the ratio is 1 in
  value and the clip only matters through its gradient, exactly as in TRL.
  One step off-policy, a batch is trained by the weights one update after
  those that sampled it: ``old_logp`` is then its behaviour log-probability,
  computed before that update, and the clipped ratio corrects for the lag.
  A checkpoint keeps such a batch (``pending_rank<r>.pt``), so resuming is
  still exact.
* The loss of each micro-batch is weighted by its share of the step's rows
  (``sequence_mean``, ``constant``) or trained tokens (``token_mean``) across
  micro-batches and ranks, so accumulation and world size never change the
  objective. TRL divides by the number of accumulation steps instead.
* Rewards that fail raise; TRL would turn a missing reward into NaN and a 0
  advantage.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Coroutine, NoReturn

from calibrl.errors import CalibrlError, RewardError
from calibrl.trainer import checkpoint as ckpt
from calibrl.trainer.alarms import SKIPPED_UPDATE
from calibrl.trainer import distributed as dist_util
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.clients import JudgeClient, RetrievalClient
from calibrl.trainer.config import TrainConfig
from calibrl.trainer.heldout import HeldoutEvaluator, load_heldout_tasks
from calibrl.trainer.pipeline import RolloutPipeline
from calibrl.trainer.rewards import RewardModel
from calibrl.trainer.run_checkpoints import Checkpointer
from calibrl.trainer.rubric_weight import RubricWeight
from calibrl.trainer.run_setup import build_run
from calibrl.trainer.sampling import RolloutSampler
from calibrl.trainer.scoring import PendingBatch, restore_pending, settled
from calibrl.trainer.step_log import rank_step_metrics, StepLog, StepTimes
from calibrl.trainer.stop_signal import StopSignal
from calibrl.trainer.training_batch import to_training_batch
from calibrl.trainer.update import PolicyUpdate, autocast_for

if TYPE_CHECKING:  # pragma: no cover
    from calibrl import tracking
    from calibrl.trainer.heldout import HeldoutEvaluator
    from calibrl.trainer.pipeline import RolloutPipeline
    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.rollout import RolloutBatch
    from calibrl.trainer.run_checkpoints import Checkpointer
    from calibrl.trainer.run_setup import TrainingRun
    from calibrl.trainer.step_log import StepLog
    from calibrl.trainer.stop_signal import StopSignal
    from calibrl.trainer.update import PolicyUpdate

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """How a call to :func:`train` ended."""

    steps_done: int  # optimizer steps completed in total (resumed runs count earlier steps)
    stopped: str  # "completed", "sigterm" or "stop_after"
    last_checkpoint: pathlib.Path | None
    history: list[dict[str, float]] = field(default_factory=list)  # the metrics logged by this process
    # (step, held-out metrics) of every evaluation of the run so far (eval.*; rank 0), earlier processes' included
    heldout: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


def train(
    config: TrainConfig,
    *,
    retrieval: RetrievalClient,
    judge: JudgeClient | None,
    resume: str | pathlib.Path | None = None,
    stop_after: int | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    background: BackgroundLoop | None = None,
    tracker: "tracking.Tracker | None" = None,
) -> TrainResult:
    """Train the policy of ``config`` with rewards from ``retrieval`` and ``judge``.

    ``resume``: a checkpoint folder (or a run dir: its latest checkpoint).
    ``stop_after``: leave (with a checkpoint) after this many steps of this call,
    as a preempted job would. ``on_step(step, metrics)`` runs after each step.
    ``background``: the event loop the clients run on (gRPC clients bind to the
    loop of their first call); by default one is made for this call.
    ``tracker``: experiment trackers to log to (``calibrl.tracking.open_trackers``),
    left open for the caller to add to and close; by default ``config.report_to``'s
    are opened and closed here.
    Raises RewardError (after writing a checkpoint) when a reward cannot be computed.
    """
    run = build_run(config, resume)
    ctx, model, tokenizer = run.ctx, run.policy.model, run.policy.tokenizer
    reward_model = RewardModel(config.reward, retrieval, judge)
    step_log = StepLog(config, ctx, run.state.step, on_step, tracker)
    updater = PolicyUpdate(config, model, run.reference, run.optimizer, run.scheduler, ctx,
                           autocast_for(config, run.device), run.kind.max_completion_tokens(config.rollout))
    checkpointer = Checkpointer(config, ctx, model, tokenizer, run.optimizer, run.scheduler, run.order)
    stop_signal = StopSignal()

    def score(batch: "RolloutBatch") -> "Coroutine[Any, Any, list[RewardBreakdown]]":
        """The reward coroutine of a batch's rollouts."""
        return run.kind.score(reward_model, batch.rollouts)

    with contextlib.ExitStack() as stack:
        if background is None:
            background = stack.enter_context(BackgroundLoop(name="calibrl-rewards"))
        stack.enter_context(stop_signal)
        stack.callback(dist_util.close_distributed, ctx)
        stack.callback(step_log.close)
        sampler = RolloutSampler(config, run.kind, run.engine, tokenizer, run.tasks, run.order, ctx, retrieval,
                                 background, score, run.device)
        pending = None
        if run.checkpoint_from is not None:
            pending = restore_pending(run.checkpoint_from, ctx.rank, run.state.step + 1, background, score, run.device)
        pipeline = RolloutPipeline(sampler, config.rollout.off_policy_steps, config.steps, pending)
        step_log.review.attach(judge, config.reward.rubric_id, background.run, stop_signal)  # its drift check
        heldout = None
        if config.eval.enabled:
            tasks, source = load_heldout_tasks(config, run.kind.name)
            heldout = HeldoutEvaluator(config, tasks, source, retrieval, background.run, step_log.tracker,
                                       is_main=ctx.is_main, resume_step=run.state.step)
        rubric_weight = RubricWeight(config, run.kind.name, run.state, ctx, step_log.rubric_versions)
        loop = _Loop(config, run, pipeline, updater, checkpointer, step_log, stop_signal, rubric_weight, heldout)
        stopped, last_checkpoint = loop.run_steps(stop_after)
        heldout_curve = heldout.finish(stopped) if heldout is not None else []
    if stopped == "sigterm":
        log.warning("SIGTERM: stopped after step %d; checkpoint %s", run.state.step, last_checkpoint)
    return TrainResult(steps_done=run.state.step, stopped=stopped, last_checkpoint=last_checkpoint,
                       history=step_log.history, heldout=heldout_curve)


@dataclass
class _Loop:
    """The parts one step uses; :meth:`run_steps` is the loop itself."""

    config: TrainConfig
    run: "TrainingRun"
    pipeline: "RolloutPipeline"
    updater: "PolicyUpdate"
    checkpointer: "Checkpointer"
    step_log: "StepLog"
    stop_signal: "StopSignal"
    rubric_weight: "RubricWeight"  # review.on_alarm=downweight: the rubric's weight, lowered after a drift alarm
    heldout: "HeldoutEvaluator | None" = None

    def run_steps(self, stop_after: int | None) -> tuple[str, pathlib.Path | None]:
        """Steps until ``config.steps``, a SIGTERM or ``stop_after``; returns (why it
        stopped, the last checkpoint written)."""
        config, state, ctx = self.config, self.run.state, self.run.ctx
        last_checkpoint, steps_this_call = self.run.checkpoint_from, 0
        self.evaluate_heldout(state.step)  # step 0 (eval.on_start), or a due one a stopped run left undone
        while state.step < config.steps:
            self.step(state.step + 1)
            steps_this_call += 1
            # ---------------------------------------------------------- checkpoint
            stop_requested = dist_util.any_rank(self.stop_signal.raised, ctx)
            preempted = stop_after is not None and steps_this_call >= stop_after and state.step < config.steps
            if stop_requested or preempted:
                stopped = "sigterm" if stop_requested else "stop_after"
                return stopped, self.checkpointer.save(state, stopped, pending=settled(self.pipeline.pending))
            if state.step == config.steps:
                last_checkpoint = self.checkpointer.save(state, "final")
            elif config.checkpoint_every and state.step % config.checkpoint_every == 0:
                last_checkpoint = self.checkpointer.save(state, "interval", pending=settled(self.pipeline.pending))
            # ---------------------------------------------------------- held-out evaluation
            self.evaluate_heldout(state.step)
        return "completed", last_checkpoint

    def evaluate_heldout(self, step: int) -> None:
        """The held-out evaluation of the policy after ``step`` steps, when ``eval.*`` asks for one
        (rank 0 evaluates; the other ranks go on to the next collective and wait there)."""
        if self.heldout is not None:
            self.heldout.evaluate_if_due(step, self.run.policy)

    def step(self, step: int) -> None:
        """One step: rollout -> reference forward -> rewards -> advantages -> update -> log."""
        run, state, ctx, times = self.run, self.run.state, self.run.ctx, StepTimes()
        step_start = time.perf_counter()
        rng_at_start, position_at_start = ckpt.rng_state(), run.order.state()

        # -------------------------------------------------------------- rollout
        rollouts = self.pipeline.take(step)
        times.generation = time.perf_counter() - step_start
        if dist_util.any_rank(rollouts.failure is not None, ctx):
            self.stop_for_failure(step, rollouts.failure, rng_at_start, position_at_start, rollouts.current)

        # -------------------------------------------------------------- reference
        # Forward passes that need no reward run while the scores are computed: the
        # upcoming batch's behaviour log-probs (under the weights that sampled it,
        # before this step's update), the reference's, the first micro-batch's.
        overlap_start = time.perf_counter()
        rollouts = rollouts.with_upcoming_behaviour(self.updater.behaviour_logprobs)
        early = self.updater.forward_without_rewards(rollouts.current.batch)
        times.overlap_forward = time.perf_counter() - overlap_start

        # -------------------------------------------------------------- rewards
        wait_start, scored, failure = time.perf_counter(), None, None
        try:
            scored = rollouts.current.scored()
        except CalibrlError as exc:
            failure = exc
        times.reward_wait = time.perf_counter() - wait_start
        if dist_util.any_rank(failure is not None, ctx):
            self.stop_for_failure(step, failure, rng_at_start, position_at_start, rollouts.current)
        scored, weight_metrics = self.rubric_weight.blend(scored)  # lowered after a drift alarm

        # -------------------------------------------------------------- advantages
        training = to_training_batch(scored, self.config.advantage)

        # -------------------------------------------------------------- update
        update_start = time.perf_counter()
        result = self.updater.apply(training, early)
        if not result.stepped:
            state.skipped_updates += 1
            log.warning("step %d: %s", step, SKIPPED_UPDATE.warning(result.metrics["grad_norm"], None, {}))
        run.engine.update_weights(run.policy.model)
        state.step = step
        self.pipeline.keep(rollouts.upcoming)
        times.update = time.perf_counter() - update_start

        # -------------------------------------------------------------- log
        times.step = time.perf_counter() - step_start
        metrics = rank_step_metrics(training, result, times, self.config.health, rollouts.current.sampling_metrics)
        metrics.update(weight_metrics | self.step_log.observe_rollouts(step, training))  # rubric versions, review
        self.rubric_weight.after_step(step, self.step_log.review, scored)  # a drift alarm: lower the weight
        self.step_log.record(step, metrics, state)

    def stop_for_failure(self, step: int, failure: CalibrlError | None, rng: ckpt.RngState,
                         position: dict[str, int], current: PendingBatch | None) -> NoReturn:
        """Nothing half-scored is trained on: save the state as it was when this step
        began, with its rollouts if they exist (to be scored again; the data
        position is then the one just after their tasks), and stop. A resumed run
        retries the same step."""
        # Keep the rollouts only when every rank has its share: ranks must agree on
        # the data position, and a rank whose generation failed has nothing to keep.
        keep = not dist_util.any_rank(current is None, self.run.ctx)
        if keep:
            current = current.without_scores()
            position = current.data_position
        path = self.checkpointer.save(self.run.state, "reward_error", rng=rng, position=position,
                                      pending=current if keep else None)
        message = f"{failure}" if failure is not None else "a reward failed on another rank"
        raise RewardError(f"step {step}: {message}; checkpoint written to {path}, resume with --resume {path}")


__all__ = ["TrainResult", "train"]
