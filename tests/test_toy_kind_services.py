"""A third task kind, defined in this file alone (one module, one ``register_task_kind`` call,
no file under ``trainer/`` edited), trained for two steps by ``calibrl train`` against both REAL
services: a retrieval server over the tiny index and a judge server with the programmatic
rubric, grpc.aio on loopback port 0.

The toy kind ``lookup``: the policy writes a search query for a task's text; the reward is
half the retrieval service's recall@k of the query for the task's gold documents and half the
judge's rubric total of the query. Its tasks are the rewrite records, read as ``lookup`` tasks
(``tasks.kind=lookup``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest
import torch

from calibrl.api.judge import JudgeItem
from calibrl.api.retrieval import ScoreItem
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.rewards import RewardBreakdown, RewardModel, weighted_total
from calibrl.trainer.rollout import RolloutBatch, assemble_rows, decode_completion, encode_prompt
from calibrl.trainer.search_format import fill_template
from calibrl.trainer.task_kinds import TASK_KINDS, RolloutSettings, TaskKind, register_task_kind
from calibrl.trainer.tasks import Task
from tests.test_trainer_support import one_torch_thread, train_against_real_services, trainer_world  # noqa: F401

WEIGHTS = {"recall": 0.5, "rubric": 0.5}


@dataclass(frozen=True)
class LookupRollout:
    task: Task
    query: str  # the completion's first line


def rollout_lookups(engine, tokenizer, tasks: Sequence[Task], settings: RolloutSettings, retrieval,
                    run_async) -> RolloutBatch:
    prompts = [encode_prompt(tokenizer, fill_template(settings.prompt_template, t.query), chat_template=False)
               for t in tasks]
    requests = [p for p in prompts for _ in range(settings.group_size)]
    completions = engine.generate(requests, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                  top_p=settings.top_p, stop_strings=("\n",), seed=settings.seed)
    texts = [decode_completion(tokenizer, c) for c in completions]
    rollouts = [LookupRollout(tasks[i // settings.group_size], text.split("\n", 1)[0].strip())
                for i, text in enumerate(texts)]
    rows = [[(p, False), (c, True)] for p, c in zip(requests, completions)]
    return RolloutBatch(**assemble_rows(rows, pad_id=tokenizer.pad_token_id or 0),
                        group_index=torch.arange(len(tasks)).repeat_interleave(settings.group_size),
                        completion_texts=texts, rollouts=rollouts, prompt_lengths=[len(p) for p in requests])


async def score_lookups(rewards: RewardModel, rollouts: Sequence[LookupRollout]) -> list[RewardBreakdown]:
    """Both services, once each for the batch, retried as a whole by the reward model."""

    async def attempt() -> list[RewardBreakdown]:
        # An empty query is sent as the task's text: the toy keeps every row scorable.
        queries = [rewards.output_text(r.query) or r.task.query for r in rollouts]
        found = await rewards.retrieve([ScoreItem(q, r.task.gold_doc_ids) for q, r in zip(queries, rollouts)],
                                       include_text=False)
        judged = await rewards.judge_items([JudgeItem(r.task.query, q) for q, r in zip(queries, rollouts)])
        out = []
        for score, rubric in zip(found, judged):
            components = {"recall": score.recall, "rubric": rubric.total}
            out.append(RewardBreakdown(weighted_total(components, WEIGHTS), components, score, rubric))
        return out

    return await rewards.with_retries(attempt, f"{len(rollouts)} lookups")


def evaluate_lookups(engine, tokenizer, tasks, retrieval, settings, run_async, template, chat_template):
    raise NotImplementedError("the toy kind is trained here, not evaluated")


LOOKUP = TaskKind(name="lookup", builtin_template="Find documents about: {query}\nQuery:", rollout=rollout_lookups,
                  score=score_lookups, evaluate=evaluate_lookups, metric_names=("recall",),
                  max_completion_tokens=lambda rollout: rollout.max_new_tokens,
                  required={"gold_doc_ids": "a lookup task needs its gold documents"})


@pytest.fixture
def lookup_kind():
    register_task_kind(LOOKUP)
    yield LOOKUP
    TASK_KINDS.pop(LOOKUP.name, None)


def test_a_kind_defined_outside_the_trainer_trains_against_both_real_services(lookup_kind, trainer_world,
                                                                               tmp_path, capsys):
    code, _ = train_against_real_services(trainer_world, tmp_path, "steps=2", "tasks.kind=lookup")
    assert code == 0, capsys.readouterr().err
    records = read_log(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # The kind's own reward ran, with an answer from each service.
        assert 0.0 <= record["rewards/recall/mean"] <= 1.0
        assert 0.0 < record["rewards/rubric/mean"] <= 1.0
        # float32 mean of the rewards vs float64 means of the components: abs 1e-6 is ~17 float32 ulp of 1.
        assert record["reward"] == pytest.approx(
            0.5 * record["rewards/recall/mean"] + 0.5 * record["rewards/rubric/mean"], abs=1e-6)
        assert not any(key.startswith(("search/", "steps/")) for key in record)  # no other kind's step metrics
