"""The GRPO / CalibAdv training loop.

One function, :func:`train`, reads top to bottom. Each step::

    rollout     G samples per task, generated in chunks; each chunk's reward
                coroutine is submitted to a background event loop at once, so
                scoring overlaps the next chunk's generation. One step
                off-policy (``rollout.off_policy_steps=1``) the next step's
                rollouts are generated here too, before this step's update, so
                their scoring overlaps everything up to the next step's wait
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
    log         TRL-named metrics to JSONL + TensorBoard, health warnings, tqdm
    checkpoint  every ``checkpoint_every`` steps, at the end, and on SIGTERM

The retrieval and judge clients are injected: :func:`train` never opens a
network connection itself (``trainer.cli`` builds gRPC or in-process clients).

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
import math
import pathlib
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from calibrl.errors import CalibrlError, ConfigError, RewardError
from trainer import checkpoint as ckpt
from trainer import diagnostics as diag
from trainer import distributed as dist_util
from trainer.aio import BackgroundLoop
from trainer.clients import JudgeClient, RetrievalClient
from trainer.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """How a call to :func:`train` ended."""

    steps_done: int  # optimizer steps completed in total (resumed runs count earlier steps)
    stopped: str  # "completed", "sigterm" or "stop_after"
    last_checkpoint: pathlib.Path | None
    history: list[dict[str, float]] = field(default_factory=list)  # the metrics logged by this process


def train(
    config: TrainConfig,
    *,
    retrieval: RetrievalClient,
    judge: JudgeClient | None,
    resume: str | pathlib.Path | None = None,
    stop_after: int | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    background: BackgroundLoop | None = None,
) -> TrainResult:
    """Train the policy of ``config`` with rewards from ``retrieval`` and ``judge``.

    ``resume``: a checkpoint folder (or a run dir: its latest checkpoint).
    ``stop_after``: leave (with a checkpoint) after this many steps of this call,
    as a preempted job would. ``on_step(step, metrics)`` runs after each step.
    ``background``: the event loop the clients run on (gRPC clients bind to the
    loop of their first call); by default one is made for this call.
    Raises RewardError (after writing a checkpoint) when a reward cannot be computed.
    """
    import torch

    from trainer.advantages import AdvantageInputs, compute_advantages
    from trainer.engines import make_engine
    from trainer.policy import load_policy, make_reference, resolve_device
    from trainer.rewards import RewardModel

    # ------------------------------------------------------------------ setup
    ctx = dist_util.init_distributed(config.policy.device)
    device = str(resolve_device(dist_util.rank_device(config.policy.device, ctx)))
    _seed_everything(config.seed)  # identical on every rank: LoRA init must match
    policy = load_policy(
        config.policy.path,
        device=device,
        dtype=config.policy.dtype,
        lora=config.policy.lora.settings(),
        gradient_checkpointing=config.policy.gradient_checkpointing,
    )
    model, tokenizer = policy.model, policy.tokenizer
    reference = make_reference(policy) if config.loss.beta > 0 else None
    checkpoint_from = ckpt.find_checkpoint(resume) if resume else None
    if checkpoint_from is not None:
        ckpt.load_model_weights(checkpoint_from, model)
    if ctx.distributed and config.distributed.strategy == "ddp":
        _broadcast_parameters(model, ctx)
    if ctx.distributed and config.distributed.strategy == "fsdp":
        dist_util.apply_fsdp(model, ctx, mixed_precision=_use_bf16(config, device))
    engine = make_engine(config.rollout.engine, policy, **_engine_kwargs(config))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        eps=config.optimizer.eps,
        weight_decay=config.optimizer.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))

    tasks, kind = _load_training_tasks(config)
    if config.rollout.prompts_per_step % ctx.world_size:
        raise ConfigError(
            f"rollout.prompts_per_step={config.rollout.prompts_per_step} does not split over "
            f"{ctx.world_size} ranks: make it a multiple of the number of processes"
        )
    order = dist_util.TaskOrder(len(tasks), config.seed, shuffle=config.tasks.shuffle)
    state = ckpt.TrainState(world_size=ctx.world_size)
    if checkpoint_from is not None:
        state = ckpt.load_train_state(checkpoint_from)
        if state.world_size != ctx.world_size:
            raise ConfigError(
                f"checkpoint {checkpoint_from} was written by {state.world_size} processes, this run has "
                f"{ctx.world_size}: resume with --nproc_per_node {state.world_size}"
            )
        optimizer_state = ckpt.load_optimizer_and_schedule(checkpoint_from, optimizer, scheduler)
        if config.distributed.strategy == "fsdp" and ctx.distributed:
            dist_util.load_full_optimizer_state(model, optimizer, optimizer_state)
        else:
            optimizer.load_state_dict(optimizer_state)
        order.load_state(state.data_position)
        ckpt.load_rng(checkpoint_from, ctx.rank)
        engine.update_weights(model)
        log.info("resumed from %s at step %d", checkpoint_from, state.step)
    else:
        _seed_everything(config.seed + ctx.rank)  # sampling differs per rank

    rewards_model = RewardModel(config.reward, retrieval, judge)
    run_log = None
    if ctx.is_main:
        run_log = diag.RunLog(config.run_dir, tensorboard=config.tensorboard, resume_step=state.step)
    config_yaml = config.to_yaml()
    autocast = _autocast(config, device)
    stop_signal = _SignalFlag()
    progress = _progress_bar(config, ctx, initial=state.step)
    history: list[dict[str, float]] = []
    last_checkpoint: pathlib.Path | None = checkpoint_from
    stopped = "completed"
    steps_this_call = 0

    def save(reason: str, rng: dict[str, Any] | None = None, position: dict[str, int] | None = None,
             pending: _StepRollouts | None = None) -> pathlib.Path:
        """A checkpoint of the state after ``state.step`` steps; ``pending``: rollouts
        already taken from the data for the next step (kept, with their scores when
        they are in, so the resumed run trains on exactly them)."""
        state.reason = reason
        state.data_position = position if position is not None else order.state()
        full_model, full_optim = (None, None)
        if config.distributed.strategy == "fsdp" and ctx.distributed:
            full_model, full_optim = dist_util.full_state_dicts(model, optimizer)
        elif ctx.distributed:
            dist_util.check_in_sync(params, ctx)
        path = ckpt.save_checkpoint(
            ckpt.checkpoint_dir(config.run_dir, state.step),
            model=model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            config_yaml=config_yaml,
            rank=ctx.rank,
            rng=rng,
            pending=None if pending is None else pending.to_saved(),
            full_model_state=full_model,
            optimizer_state=full_optim,
        )
        if ctx.is_main:
            ckpt.prune_checkpoints(config.run_dir, config.keep_checkpoints)
        return path

    def score(batch: Any) -> Any:
        """The reward coroutine of a batch's rollouts."""
        scorer = rewards_model.score_search if kind == "search" else rewards_model.score_rewrites
        return scorer(batch.rollouts)

    def generate(for_step: int) -> _StepRollouts:
        """Take ``for_step``'s tasks and generate their rollouts in chunks, submitting
        each chunk's reward coroutine at once so scoring overlaps the next chunk."""
        started = time.perf_counter()
        step_tasks = [tasks[i] for i in dist_util.shard(order.take(config.rollout.prompts_per_step), ctx)]
        taken_to = order.state()
        chunk = config.rollout.chunk_size(len(step_tasks))
        chunks, futures = [], []
        for n, start in enumerate(range(0, len(step_tasks), chunk)):
            seed = _sampling_seed(config.seed, for_step, ctx.rank, n)
            part = _rollout(config, kind, engine, tokenizer, step_tasks[start : start + chunk], retrieval, background,
                            seed)
            chunks.append(part)
            futures.append(background.submit(score(part)))
        batch = concat_batches(chunks, _pad_id(tokenizer)).to(device)
        return _StepRollouts(for_step, batch, futures, taken_to, generation_s=time.perf_counter() - started)

    def behaviour_logprobs(batch: Any) -> Any:
        """``(B, L)`` log-probs of the sampled tokens under the current weights, in
        eval mode like the sampler (no LoRA dropout): the behaviour policy itself."""
        old = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
        was_training = model.training
        model.eval()
        try:
            for rows in _micro_batches(len(batch), config.gradient_accumulation_steps):
                micro = micro_batch(batch, None, rows)
                with torch.no_grad(), autocast:
                    logp, _ = completion_logprobs(model, micro, config.rollout.temperature)
                old[rows[0] : rows[-1] + 1, micro.start : micro.start + logp.shape[1]] = logp.float()
        finally:
            model.train(was_training)
        return old

    def fail(step: int, failure: CalibrlError | None, rng: dict[str, Any], position: dict[str, int],
             current: _StepRollouts | None) -> None:
        """Nothing half-scored is trained on: save the state as it was when this step
        began, with its rollouts if they exist (to be scored again; the data
        position is then the one just after their tasks), and stop. A resumed run
        retries the same step."""
        # Keep the rollouts only when every rank has its share: ranks must agree on
        # the data position, and a rank whose generation failed has nothing to keep.
        keep = not dist_util.any_rank(current is None, ctx)
        if keep:
            current.forget_scores()
            position = current.data_position
        path = save("reward_error", rng=rng, position=position, pending=current if keep else None)
        message = f"{failure}" if failure is not None else "a reward failed on another rank"
        raise RewardError(f"step {step}: {message}; checkpoint written to {path}, resume with --resume {path}")

    with contextlib.ExitStack() as stack:
        if background is None:
            background = stack.enter_context(BackgroundLoop(name="calibrl-rewards"))
        stack.enter_context(stop_signal)
        stack.callback(dist_util.close_distributed, ctx)
        if run_log is not None:
            stack.callback(run_log.close)
        if progress is not None:
            stack.callback(progress.close)
        pending = None
        if checkpoint_from is not None:
            pending = _restore_pending(checkpoint_from, ctx.rank, state.step + 1, background, score, device)
        while state.step < config.steps:
            step = state.step + 1
            step_start = time.perf_counter()
            rng_at_start, position_at_start = ckpt.rng_state(), order.state()

            # ---------------------------------------------------------- rollout
            # This step's rollouts: generated now, or (one step off-policy) in the
            # previous step, before its update. Off-policy, the next step's
            # rollouts are generated here too, so their scoring runs behind the
            # rest of this step and the whole of the next one's forward passes.
            current, upcoming, failure = pending, None, None
            pending = None
            try:
                if current is None:
                    current = generate(step)
                if config.rollout.off_policy_steps and step < config.steps:
                    upcoming = generate(step + 1)
            except CalibrlError as exc:
                failure = exc
            generation_s = time.perf_counter() - step_start
            if dist_util.any_rank(failure is not None, ctx):
                fail(step, failure, rng_at_start, position_at_start, current)

            # ---------------------------------------------------------- reference
            # Forward passes that need no reward run while the scores are computed:
            # the upcoming batch's behaviour log-probs (under the weights that
            # sampled it, before this step's update), the frozen reference's
            # log-probs, and the policy's forward pass of the first micro-batch
            # (peak memory is unchanged: one graph).
            overlap_start = time.perf_counter()
            if upcoming is not None:
                upcoming.batch.old_logp = behaviour_logprobs(upcoming.batch)
            batch = current.batch
            micro_batches = _micro_batches(len(batch), config.gradient_accumulation_steps)
            ref_logps = []
            for rows in micro_batches:
                ref_logp = None
                if reference is not None:
                    with torch.no_grad(), autocast:
                        ref_logp, _ = completion_logprobs(reference, micro_batch(batch, None, rows),
                                                          config.rollout.temperature)
                ref_logps.append(ref_logp)
            with autocast:
                first_forward = completion_logprobs(model, micro_batch(batch, None, micro_batches[0]),
                                                    config.rollout.temperature, with_entropy=True)
            overlap_s = time.perf_counter() - overlap_start

            # ---------------------------------------------------------- rewards
            wait_start = time.perf_counter()
            try:
                breakdowns = current.settle()
            except CalibrlError as exc:
                failure = exc
            reward_wait_s = time.perf_counter() - wait_start
            if dist_util.any_rank(failure is not None, ctx):
                fail(step, failure, rng_at_start, position_at_start, current)

            # ---------------------------------------------------------- advantages
            rewards = torch.tensor([b.total for b in breakdowns], dtype=torch.float32, device=device)
            step_scores = None
            settings = config.advantage.step_score_settings()
            if settings is not None and kind == "search":
                step_scores = search_step_scores(
                    batch.rollouts, batch.group_index, batch.segment_index, settings
                ).to(device)
            inputs = AdvantageInputs(
                rewards=rewards,
                group_index=batch.group_index,
                completion_mask=batch.completion_mask,
                segment_index=batch.segment_index,
                answer_mask=batch.answer_mask,
                step_scores=step_scores,
            )
            token_adv, advantage_metrics = compute_advantages(config.advantage.type, inputs, **config.advantage.params())

            # ---------------------------------------------------------- loss
            update_start = time.perf_counter()
            rows_total, tokens_total = dist_util.all_reduce_sum(
                [len(batch), float(batch.completion_mask.sum())], ctx
            )
            loss_metrics: list[tuple[float, dict[str, float]]] = []
            loss_value = 0.0
            for n, (rows, ref_logp) in enumerate(zip(micro_batches, ref_logps)):
                micro = micro_batch(batch, token_adv, rows)
                if n == 0:
                    logp, entropy = first_forward
                    first_forward = None  # the graph is freed by this micro-batch's backward
                else:
                    with autocast:
                        logp, entropy = completion_logprobs(model, micro, config.rollout.temperature, with_entropy=True)
                old_logp = logp.detach() if micro.old_logp is None else micro.old_logp
                loss, metrics = policy_loss_for(config, logp, old_logp, micro.token_adv, micro.mask, ref_logp)
                weight = _micro_batch_weight(
                    config.loss.aggregation, micro.mask, rows_total, tokens_total, ctx.world_size
                )
                (loss * weight).backward()
                metrics["entropy"] = entropy
                loss_metrics.append((float(micro.mask.sum()), metrics))
                loss_value += float(loss.detach()) * weight  # averaged over ranks below: the step's loss

            # ---------------------------------------------------------- step
            if config.distributed.strategy == "ddp":
                dist_util.all_reduce_gradients(params, ctx)
            max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            learning_rate = scheduler.get_last_lr()[0]
            if not apply_update(optimizer, grad_norm):
                state.skipped_updates += 1
                log.warning("step %d: grad_norm=%s is not finite: update skipped, weights unchanged", step, grad_norm)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            engine.update_weights(model)
            state.step = step
            pending = upcoming
            update_s = time.perf_counter() - update_start

            # ---------------------------------------------------------- log
            step_s = time.perf_counter() - step_start
            metrics = {
                "loss": loss_value,
                "grad_norm": grad_norm,
                "learning_rate": learning_rate,
                **advantage_metrics,
                **diag.component_metrics([b.components for b in breakdowns]),
                **diag.completion_metrics(batch.completion_mask),
                **_token_weighted_mean(loss_metrics),
                "timing/generation": generation_s,
                "timing/overlap_forward": overlap_s,
                "timing/reward_wait": reward_wait_s,
                "timing/update": update_s,
                "timing/step": step_s,
                "timing/reward_wait_share": reward_wait_s / step_s if step_s > 0 else 0.0,
                "rollout/staleness": 0.0 if batch.old_logp is None else 1.0,
            }
            if step_scores is not None:
                known = step_scores[~torch.isnan(step_scores)]
                metrics["calibadv/mean_step_score"] = float(known.mean()) if known.numel() else 0.0
            metrics = dist_util.reduce_metrics(metrics, ctx)
            warnings = diag.health_warnings(metrics, config.health)
            for warning in warnings:
                log.warning("step %d: %s", step, warning)
            state.warnings_total += len(warnings)
            metrics["health/warnings"] = float(len(warnings))
            metrics["health/warnings_total"] = float(state.warnings_total)
            metrics["health/skipped_updates_total"] = float(state.skipped_updates)
            if run_log is not None:
                run_log.write(step, metrics)
            history.append(metrics)
            if progress is not None:
                progress.set_postfix_str(diag.progress_postfix(metrics))
                progress.update(1)
            if on_step is not None:
                on_step(step, metrics)
            steps_this_call += 1

            # ---------------------------------------------------------- checkpoint
            stop_requested = dist_util.any_rank(stop_signal.raised, ctx)
            preempted = stop_after is not None and steps_this_call >= stop_after and state.step < config.steps
            if stop_requested or preempted:
                stopped = "sigterm" if stop_requested else "stop_after"
                last_checkpoint = save(stopped, pending=_settled(pending))
                break
            if state.step == config.steps:
                last_checkpoint = save("final")
            elif config.checkpoint_every and state.step % config.checkpoint_every == 0:
                last_checkpoint = save("interval", pending=_settled(pending))

    if stopped == "sigterm":
        log.warning("SIGTERM: stopped after step %d; checkpoint %s", state.step, last_checkpoint)
    return TrainResult(steps_done=state.step, stopped=stopped, last_checkpoint=last_checkpoint, history=history)


# =============================================================================== pieces of the loop


def policy_loss_for(config: TrainConfig, logp: Any, old_logp: Any, token_adv: Any, mask: Any, ref_logp: Any):
    """``trainer.losses.policy_loss`` with the run's loss settings."""
    from trainer.losses import policy_loss

    return policy_loss(
        logp,
        old_logp,
        token_adv,
        mask,
        ref_logp=ref_logp,
        beta=config.loss.beta,
        eps_low=config.loss.eps_low,
        eps_high=config.loss.eps_high,
        aggregation=config.loss.aggregation,
        max_completion_length=max_completion_tokens(config),
    )


def apply_update(optimizer: Any, grad_norm: float) -> bool:
    """``optimizer.step()`` unless the (all-reduced, pre-clip) gradient norm is NaN or
    infinite: one such step would poison AdamW's moments for good. Every rank sees
    the same norm, so every rank skips together. Returns whether it stepped."""
    if not math.isfinite(grad_norm):
        return False
    optimizer.step()
    return True


def max_completion_tokens(config: TrainConfig) -> int:
    """The Dr. GRPO constant: the most tokens a rollout can generate."""
    per_turn = config.rollout.max_new_tokens
    return per_turn * config.rollout.max_turns if _is_search_config(config) else per_turn


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at scheduler step ``n`` (0-based optimizer steps):
    linear warmup over ``warmup_steps``, then constant, linear or cosine decay to
    ``min_lr_ratio`` at the last step."""
    opt = config.optimizer
    warmup, total, floor = opt.warmup_steps, config.steps, opt.min_lr_ratio

    def multiplier(n: int) -> float:
        if warmup and n < warmup:
            return (n + 1) / warmup
        if opt.schedule == "constant":
            return 1.0
        span = max(1, total - warmup - 1)
        progress = min(1.0, (n - warmup) / span)
        if opt.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def concat_batches(batches: Sequence[Any], pad_id: int) -> Any:
    """One RolloutBatch from several (right-padded to the longest row; group ids
    offset so groups of different chunks never merge)."""
    import torch

    from trainer.rollout import RolloutBatch

    if len(batches) == 1:
        return batches[0]
    width = max(b.input_ids.shape[1] for b in batches)

    def pad(tensor: Any, value: Any) -> Any:
        extra = width - tensor.shape[1]
        if extra == 0:
            return tensor
        filler = torch.full((tensor.shape[0], extra), value, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, filler], dim=1)

    group_index, offset = [], 0
    for b in batches:
        group_index.append(b.group_index + offset)
        offset += int(b.group_index.max()) + 1
    return RolloutBatch(
        input_ids=torch.cat([pad(b.input_ids, pad_id) for b in batches]),
        attention_mask=torch.cat([pad(b.attention_mask, 0) for b in batches]),
        completion_mask=torch.cat([pad(b.completion_mask, False) for b in batches]),
        segment_index=torch.cat([pad(b.segment_index, -1) for b in batches]),
        answer_mask=torch.cat([pad(b.answer_mask, False) for b in batches]),
        group_index=torch.cat(group_index),
        completion_texts=[t for b in batches for t in b.completion_texts],
        rollouts=[r for b in batches for r in b.rollouts],
        prompt_lengths=[n for b in batches for n in b.prompt_lengths],
    )


def search_step_scores(rollouts: Sequence[Any], group_index: Any, segment_index: Any, settings: Any) -> Any:
    """CalibAdv step scores ``(B, S)`` of a batch of search rollouts.

    rollouts: B SearchRollouts; group_index: (B,) their groups; segment_index:
    (B, T). Silver documents are chosen per group (``settings.f1_threshold``,
    ``settings.use_gold``); step k of a rollout is its generated segment k. Slots
    without a search step (the answer segment, unused turns) are NaN: the
    estimator reads only intermediate segments."""
    import torch

    from calibrl.text import token_f1
    from trainer.calibadv import SearchStep, select_silver_docs, step_scores

    slots = max(1, int(segment_index.max()) + 1)
    scores = torch.full((len(rollouts), slots), float("nan"), dtype=torch.float32)
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_index.tolist()):
        groups.setdefault(int(group), []).append(row)
    for rows in groups.values():
        steps = [[SearchStep(s.think, tuple(s.result.doc_ids)) for s in rollouts[r].steps] for r in rows]
        well_formed = [rollouts[r].well_formed for r in rows]
        # CalibAdv rule 1: silver docs rank rollouts by F1 x format, whatever the training reward blends.
        rewards = [token_f1(rollouts[r].answer, rollouts[r].task.answers) if ok and rollouts[r].answer else 0.0
                   for r, ok in zip(rows, well_formed)]
        task = rollouts[rows[0]].task
        silver = select_silver_docs(rewards, steps, task.gold_doc_ids, settings.f1_threshold, settings.use_gold,
                                    well_formed=well_formed)
        for r, rollout_steps in zip(rows, steps):
            values = step_scores(rollout_steps, silver, rollouts[r].well_formed, settings.similarity_threshold)
            for k, value in enumerate(values[:slots]):
                scores[r, k] = value
    return scores


# =============================================================================== rollouts between steps


@dataclass
class _StepRollouts:
    """One step's rollouts from generation to update: the batch (with its
    behaviour log-probs ``batch.old_logp`` when it was sampled before the last
    update) and its reward futures, one per generation chunk, until settled."""

    step: int
    batch: Any  # RolloutBatch on the training device
    futures: list[Any]  # concurrent futures of list[RewardBreakdown], in chunk order
    data_position: dict[str, int]  # TaskOrder.state() just after this step's tasks were taken
    breakdowns: list[Any] | None = None  # one per row once every future is in
    generation_s: float = 0.0

    def settle(self) -> list[Any]:
        """The rows' rewards, waiting for the futures; raises the first failure."""
        if self.breakdowns is None:
            breakdowns, failure = [], None
            for future in self.futures:
                try:
                    breakdowns.extend(future.result())
                except CalibrlError as exc:
                    failure = failure or exc
            if failure is not None:
                raise failure
            self.breakdowns, self.futures = breakdowns, []
        return self.breakdowns

    def forget_scores(self) -> None:
        """Drop the scores (a resumed run asks for them again)."""
        self.breakdowns, self.futures = None, []

    def to_saved(self) -> dict[str, Any]:
        """What a checkpoint stores of it (tensors on the CPU; scores when settled)."""
        return {"step": self.step, "batch": self.batch.to("cpu"), "breakdowns": self.breakdowns,
                "data_position": self.data_position}


def _settled(rollouts: _StepRollouts | None) -> _StepRollouts | None:
    """``rollouts`` with its scores waited for, so a checkpoint keeps them; a score
    that fails now is left out and asked for again by the resumed run."""
    if rollouts is not None:
        try:
            rollouts.settle()
        except CalibrlError as exc:
            log.warning("rollouts of step %d: %s; the resumed run scores them again", rollouts.step, exc)
            rollouts.forget_scores()
    return rollouts


def _restore_pending(checkpoint: pathlib.Path, rank: int, next_step: int, background: BackgroundLoop,
                     score: Callable[[Any], Any], device: str) -> _StepRollouts | None:
    """The rollouts a checkpoint holds for its next step (None when it holds none),
    with their scoring resubmitted when the checkpoint has no scores for them."""
    saved = ckpt.load_pending(checkpoint, rank)
    if saved is None:
        return None
    if saved["step"] != next_step:
        raise ConfigError(
            f"{checkpoint}: pending_rank{rank}.pt holds rollouts of step {saved['step']}, but the run resumes at "
            f"step {next_step}; the checkpoint was altered, resume from an untouched one"
        )
    rollouts = _StepRollouts(saved["step"], saved["batch"].to(device), [], saved["data_position"],
                             saved["breakdowns"])
    if rollouts.breakdowns is None:
        rollouts.futures = [background.submit(score(rollouts.batch))]
    return rollouts


# =============================================================================== helpers


def _rollout(config: TrainConfig, kind: str, engine: Any, tokenizer: Any, tasks: Sequence[Any], retrieval: Any,
             background: BackgroundLoop, seed: int) -> Any:
    from trainer.rollout import rollout_rewrites, rollout_search

    r = config.rollout
    prompt = {"prompt_template": r.template_for(kind), "chat_template": r.chat_template_flag()}
    if kind == "search":
        return rollout_search(
            engine, tokenizer, tasks, group_size=r.group_size, retrieval=retrieval, run_async=background.run,
            max_turns=r.max_turns, top_k=r.search_top_k, max_new_tokens_per_turn=r.max_new_tokens,
            max_obs_tokens=r.max_obs_tokens, temperature=r.temperature, top_p=r.top_p, seed=seed, **prompt,
        )
    return rollout_rewrites(
        engine, tokenizer, tasks, group_size=r.group_size, max_new_tokens=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, seed=seed, **prompt,
    )


def _load_training_tasks(config: TrainConfig) -> tuple[list[Any], str]:
    from trainer.tasks import load_tasks, split_tasks

    kind = None if config.tasks.kind == "auto" else config.tasks.kind
    tasks = load_tasks(config.tasks.path, kind=kind, fmt=config.tasks.format)
    if config.tasks.limit:
        tasks = tasks[: config.tasks.limit]
    if config.tasks.heldout_fraction > 0:
        tasks, _ = split_tasks(tasks, config.tasks.heldout_fraction, config.seed)
    kinds = {t.kind for t in tasks}
    if len(kinds) != 1:
        raise ConfigError(f"tasks.path={config.tasks.path}: mixes task kinds {sorted(kinds)}; train one agent at a time")
    kind = kinds.pop()
    if kind == "rewrite" and config.advantage.type == "calibadv":
        raise ConfigError(
            f"advantage.type=calibadv but {config.tasks.path} holds rewrite tasks: CalibAdv calibrates multi-step "
            "search trajectories; use advantage.type=grpo"
        )
    return tasks, kind


def _is_search_config(config: TrainConfig) -> bool:
    return config.tasks.kind == "search" or config.advantage.type == "calibadv" or config.tasks.format in (
        "search", "hotpotqa")


def _sampling_seed(seed: int, step: int, rank: int, chunk: int) -> int:
    """A generation seed unique to (run seed, step, rank, chunk), so sampling does not
    depend on how much of the global RNG other code consumed."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, rank, chunk]).generate_state(1)[0])


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _broadcast_parameters(model: Any, ctx: dist_util.DistContext) -> None:
    import torch.distributed as dist

    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


def _engine_kwargs(config: TrainConfig) -> dict[str, Any]:
    if config.rollout.engine == "transformers" and config.rollout.generation_batch_size:
        return {"max_batch_size": config.rollout.generation_batch_size}
    return {}


def _use_bf16(config: TrainConfig, device: str) -> bool:
    if config.precision == "bf16":
        return True
    return config.precision == "auto" and device.startswith("cuda")


def _autocast(config: TrainConfig, device: str) -> Any:
    import torch

    if not _use_bf16(config, device):
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def _pad_id(tokenizer: Any) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


def _micro_batches(rows: int, parts: int) -> list[list[int]]:
    """Row indices of ``parts`` near-equal contiguous micro-batches (empty ones dropped)."""
    parts = min(parts, rows)
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts) if bounds[i + 1] > bounds[i]]


@dataclass
class MicroBatch:
    """Rows of the step's batch, cut to their longest row; the loss-side tensors
    start at ``start``, the first column holding a generated token of any row."""

    input_ids: Any  # (b, L)
    attention_mask: Any  # (b, L)
    start: int
    mask: Any  # (b, L - start) completion_mask
    token_adv: Any  # (b, L - start), or None before advantages exist
    old_logp: Any = None  # (b, L - start) behaviour log-probs of a stale batch, else None


def micro_batch(batch: Any, token_adv: Any, rows: list[int]) -> MicroBatch:
    rows_slice = slice(rows[0], rows[-1] + 1)
    attn = batch.attention_mask[rows_slice]
    width = int(attn.sum(dim=1).max())
    mask = batch.completion_mask[rows_slice, :width]
    generated = mask.any(dim=0).nonzero()
    start = max(1, int(generated[0])) if generated.numel() else width - 1
    return MicroBatch(
        input_ids=batch.input_ids[rows_slice, :width],
        attention_mask=attn[:, :width],
        start=start,
        mask=mask[:, start:],
        token_adv=None if token_adv is None else token_adv[rows_slice, start:width],
        old_logp=None if batch.old_logp is None else batch.old_logp[rows_slice, start:width],
    )


def completion_logprobs(model: Any, micro: MicroBatch, temperature: float,
                        with_entropy: bool = False) -> tuple[Any, float | None]:
    """Log-probabilities ``(b, L - start)`` of the micro-batch's tokens from column
    ``start`` on, and (optionally) the mean entropy over its generated tokens.

    Like ``trainer.policy.token_logprobs`` (same positions, same temperature
    scaling), but the model projects only the last ``L - start + 1`` positions to
    the vocabulary (``logits_to_keep``, as TRL does): the prompt's hidden states
    are computed, its logits are not. Log-probs and entropy come from the pure
    functions of ``trainer.losses``."""
    from trainer.losses import masked_entropy_from_logits, token_logprobs

    keep = micro.input_ids.shape[1] - micro.start + 1
    position_ids = (micro.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    inputs = dict(input_ids=micro.input_ids, attention_mask=micro.attention_mask, position_ids=position_ids,
                  use_cache=False)
    if _accepts_logits_to_keep(model):
        inputs["logits_to_keep"] = keep
    logits = model(**inputs).logits[:, -keep:-1, :]
    logp = token_logprobs(logits, micro.input_ids[:, micro.start :], temperature=temperature)
    entropy = None
    if with_entropy:
        entropy = masked_entropy_from_logits(logits.detach(), micro.mask, temperature=temperature)[1]
    return logp, entropy


def _accepts_logits_to_keep(model: Any) -> bool:
    import inspect

    target = getattr(model, "_peft_model", model)  # the LoRA reference wraps the peft policy
    if hasattr(target, "get_base_model"):
        target = target.get_base_model()
    try:
        return "logits_to_keep" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def _micro_batch_weight(aggregation: str, mask: Any, rows_total: float, tokens_total: float, world: int) -> float:
    """Factor that turns a micro-batch's aggregated loss into its exact share of the
    step's loss (times world size, since gradients are averaged over ranks)."""
    if aggregation == "token_mean":
        return float(mask.sum()) * world / max(tokens_total, 1.0)
    return mask.shape[0] * world / rows_total


def _token_weighted_mean(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    total = sum(tokens for tokens, _ in parts)
    names = sorted({name for _, metrics in parts for name in metrics if name != "policy_loss"})
    out = {}
    for name in names:
        values = [(tokens, metrics[name]) for tokens, metrics in parts if name in metrics]
        out[name] = sum(t * v for t, v in values) / total if total else 0.0
    return out


def _progress_bar(config: TrainConfig, ctx: dist_util.DistContext, initial: int) -> Any:
    if not (config.progress_bar and ctx.is_main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=initial, desc="train", unit="step", dynamic_ncols=True)


class _SignalFlag:
    """Sets ``raised`` on SIGTERM while active (main thread only); the loop then
    finishes its step, writes a checkpoint and returns."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: finishing this step, then writing a checkpoint")
        self.raised = True

    def __enter__(self) -> "_SignalFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
