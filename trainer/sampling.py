"""Stage 1 of a step: tasks -> rollouts, with their scoring already under way.

:class:`RolloutSampler` takes a step's tasks from the :class:`~calibrl.trainer.distributed.TaskOrder`
(this rank's shard), generates their rollouts in chunks with the task kind's rollout
function, and submits each chunk's reward coroutine to the background event loop as
soon as the chunk exists, so scoring overlaps the next chunk's generation. The result
is a :class:`~calibrl.trainer.scoring.PendingBatch`: one right-padded
:class:`~calibrl.trainer.rollout.RolloutBatch` on the training device plus its reward futures.
With ``rollout.dynamic_sampling`` (DAPO) it samples rounds of tasks and waits for
their scores itself, keeping the groups whose rewards differ
(``calibrl.trainer.dynamic_sampling``); its batch then arrives already scored.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from calibrl.trainer import distributed as dist_util
from calibrl.trainer.dynamic_sampling import enough_kept, select_groups, select_rows
from calibrl.trainer.policy import pad_token_id
from calibrl.trainer.handoff import PendingBatch
from calibrl.trainer.rollout import RolloutBatch
from calibrl.trainer.scoring import ScoreFn
from calibrl.trainer.task_kinds import RolloutSettings, TaskKind

if TYPE_CHECKING:  # pragma: no cover
    import concurrent.futures

    import torch
    from transformers import PreTrainedTokenizerBase
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.clients import RetrievalClient
    from calibrl.trainer.config import TrainConfig
    from calibrl.trainer.engines import GenerationEngine
    from calibrl.trainer.rewards import RewardBreakdown
    from calibrl.trainer.rollout import RolloutBatch
    from calibrl.trainer.tasks import Task


class RolloutSampler:
    """Samples the rollouts of one step and starts their scoring (one job: generation)."""

    def __init__(self, config: "TrainConfig", kind: TaskKind, engine: "GenerationEngine",
                 tokenizer: "PreTrainedTokenizerBase",
                 tasks: Sequence["Task"], order: dist_util.TaskOrder, ctx: dist_util.DistContext,
                 retrieval: "RetrievalClient", background: "BackgroundLoop", score: ScoreFn, device: str) -> None:
        self.config, self.kind, self.engine, self.tokenizer = config, kind, engine, tokenizer
        self.tasks, self.order, self.ctx = tasks, order, ctx
        self.retrieval, self.background, self.score, self.device = retrieval, background, score, device

    def sample(self, for_step: int) -> PendingBatch:
        """Take ``for_step``'s tasks and generate their rollouts in chunks, submitting
        each chunk's reward coroutine at once so scoring overlaps the next chunk.
        With ``rollout.dynamic_sampling`` the rewards are waited for here and only
        groups whose rewards differ are kept (:meth:`sample_dynamic`)."""
        if self.config.rollout.dynamic_sampling:
            return self.sample_dynamic(for_step)
        started = time.perf_counter()
        chunks, futures = self._generate_round(for_step, first_chunk=0)
        batch = concat_batches(chunks, pad_token_id(self.tokenizer)).to(self.device)
        return PendingBatch(for_step, batch, tuple(futures), self.order.state(),
                            generation_s=time.perf_counter() - started)

    def sample_dynamic(self, for_step: int) -> PendingBatch:
        """DAPO dynamic sampling (``calibrl.trainer.dynamic_sampling`` states the rule):
        rounds of ``prompts_per_step`` fresh tasks, each scored before the next, until
        this rank holds as many groups with differing rewards as its share of the
        batch (on every rank) or ``rollout.max_sampling_rounds`` rounds were sampled.
        Raises the first reward failure (nothing half-scored is kept)."""
        import torch

        started = time.perf_counter()
        parts: list[RolloutBatch] = []
        breakdowns: list[RewardBreakdown] = []
        rounds, wanted = 0, 0
        while True:
            chunks, futures = self._generate_round(for_step, first_chunk=len(parts))
            rounds += 1
            for part, future in zip(chunks, futures):
                parts.append(part)
                breakdowns.extend(future.result())  # a CalibrlError here stops the step, as in scoring
            if rounds == 1:
                wanted = sum(len(set(part.group_index.tolist())) for part in chunks)
            merged = concat_batches(parts, pad_token_id(self.tokenizer))
            group_rows = _rows_by_group(merged.group_index.tolist())
            group_rewards = [[breakdowns[r].total for r in rows] for rows in group_rows]
            # Every rank samples the same number of rounds, so the data order stays one stream.
            short = dist_util.any_rank(not enough_kept(group_rewards, wanted), self.ctx)
            if not short or rounds >= self.config.rollout.max_sampling_rounds:
                break
        selection = select_groups(group_rewards, wanted)
        rows = [r for g in selection.groups for r in group_rows[g]]
        selected = select_rows(merged, rows)
        batch = replace(selected, group_index=torch.unique(selected.group_index, return_inverse=True)[1])
        metrics = {
            "sampling/rounds": float(rounds),
            "sampling/kept_groups": float(len(selection.kept)),
            "sampling/filled_groups": float(len(selection.filled)),
            "sampling/extra_rollouts": float(len(merged) - len(batch)),
        }
        return PendingBatch(for_step, batch.to(self.device), (), self.order.state(),
                            breakdowns=[breakdowns[r] for r in rows], generation_s=time.perf_counter() - started,
                            sampling_metrics=metrics)

    def _generate_round(self, for_step: int, first_chunk: int) -> tuple[
            list["RolloutBatch"], list["concurrent.futures.Future[list[RewardBreakdown]]"]]:
        """Take ``prompts_per_step`` tasks (this rank's shard), generate them in chunks
        numbered from ``first_chunk`` (the chunk number seeds the sampling) and submit
        each chunk's scoring at once; returns the chunks and their reward futures."""
        config = self.config
        taken = self.order.take(config.rollout.prompts_per_step)
        step_tasks = [self.tasks[i] for i in dist_util.shard(taken, self.ctx)]
        chunk = config.rollout.chunk_size(len(step_tasks))
        chunks, futures = [], []
        for n, start in enumerate(range(0, len(step_tasks), chunk)):
            seed = sampling_seed(config.seed, for_step, self.ctx.rank, first_chunk + n)
            settings = rollout_settings(config, self.kind, seed)
            part = self.kind.rollout(self.engine, self.tokenizer, step_tasks[start : start + chunk], settings,
                                     self.retrieval, self.background.run)
            chunks.append(part)
            futures.append(self.background.submit(self.score(part)))
        return chunks, futures


def _rows_by_group(group_index: list[int]) -> list[list[int]]:
    """Row numbers of each group, groups in order of first appearance."""
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(group_index):
        rows.setdefault(group, []).append(row)
    return list(rows.values())


def rollout_settings(config: "TrainConfig", kind: TaskKind, seed: int) -> RolloutSettings:
    """The training rollouts' sampling options (``rollout.*``) for task kind ``kind``."""
    r = config.rollout
    return RolloutSettings(
        group_size=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
        prompt_template=r.template_for(kind.name), chat_template=r.chat_template_flag(), seed=seed,
        max_turns=r.max_turns, search_top_k=r.search_top_k, max_obs_tokens=r.max_obs_tokens,
    )


def sampling_seed(seed: int, step: int, rank: int, chunk: int) -> int:
    """A generation seed unique to (run seed, step, rank, chunk), so sampling does not
    depend on how much of the global RNG other code consumed."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, rank, chunk]).generate_state(1)[0])


def concat_batches(batches: Sequence["RolloutBatch"], pad_id: int) -> "RolloutBatch":
    """One RolloutBatch from several (right-padded to the longest row; group ids
    offset so groups of different chunks never merge)."""
    import torch

    if len(batches) == 1:
        return batches[0]
    width = max(b.input_ids.shape[1] for b in batches)

    def pad(tensor: torch.Tensor, value: int | bool) -> torch.Tensor:
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


__all__ = ["RolloutSampler", "concat_batches", "rollout_settings", "sampling_seed"]
