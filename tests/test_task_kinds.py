"""A third task kind registered in this test alone (no library code edited): its record
format, required field and writer load and save its tasks; the training loop trains it
for a real step; ``calibrl eval`` evaluates the checkpoint with its metrics and columns;
and the kind-dependent checks read the kind's properties instead of its name.

The toy kind ``label``: name the label of a short text. A rollout is one completion of
the prompt; its reward is the share of the gold label's characters the completion's
first line contains (a dense signal a random policy can move).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Sequence

import pytest
import torch

from calibrl.errors import ConfigError, InvalidArgument
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.config import load_train_config
from calibrl.trainer.eval import EvalSettings, evaluate_models, format_table
from calibrl.trainer.loop import train
from calibrl.trainer.rewards import RewardBreakdown
from calibrl.trainer.rollout import RolloutBatch, assemble_rows, decode_completion, encode_prompt
from calibrl.trainer.search_format import fill_template
from calibrl.trainer.task_kinds import TASK_KINDS, RecordFormat, RolloutSettings, TaskKind, register_task_kind
from calibrl.trainer.tasks import Task, load_tasks, record_strings, record_text, write_tasks
from tests.test_trainer_support import one_torch_thread, trainer_world  # noqa: F401  (fixtures)

LABELS = [("a tower in paris", "landmark"), ("a drug from mould", "medicine"), ("an opera by mozart", "music"),
          ("a hormone of the pancreas", "medicine"), ("a bridge over a bay", "landmark"),
          ("a symphony in d minor", "music"), ("a vaccine for smallpox", "medicine"), ("a wall in china", "landmark")]


@dataclass(frozen=True)
class LabelRollout:
    task: Task
    label: str  # the completion's first line


def label_overlap(label: str, gold: str) -> float:
    """Share of the gold label's distinct characters found in ``label``, in [0, 1]."""
    return len(set(label) & set(gold)) / len(set(gold))


def rollout_labels(engine, tokenizer, tasks: Sequence[Task], settings: RolloutSettings, retrieval,
                   run_async) -> RolloutBatch:
    prompts = [encode_prompt(tokenizer, fill_template(settings.prompt_template, t.query), chat_template=False)
               for t in tasks]
    requests = [p for p in prompts for _ in range(settings.group_size)]
    completions = engine.generate(requests, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                  top_p=settings.top_p, stop_strings=("\n",), seed=settings.seed)
    texts = [decode_completion(tokenizer, c) for c in completions]
    rollouts = [LabelRollout(tasks[i // settings.group_size], text.split("\n", 1)[0].strip())
                for i, text in enumerate(texts)]
    rows = [[(p, False), (c, True)] for p, c in zip(requests, completions)]
    return RolloutBatch(**assemble_rows(rows, pad_id=tokenizer.pad_token_id or 0),
                        group_index=torch.arange(len(tasks)).repeat_interleave(settings.group_size),
                        completion_texts=texts, rollouts=rollouts, prompt_lengths=[len(p) for p in requests])


async def score_labels(rewards, rollouts: Sequence[LabelRollout]) -> list[RewardBreakdown]:
    scores = [label_overlap(r.label, r.task.answers[0]) for r in rollouts]
    return [RewardBreakdown(total=s, components={"overlap": s}) for s in scores]


def evaluate_labels(engine, tokenizer, tasks, retrieval, settings: EvalSettings, run_async, template,
                    chat_template) -> dict[str, float]:
    greedy = RolloutSettings(group_size=1, max_new_tokens=settings.max_new_tokens, temperature=0.0, top_p=1.0,
                             prompt_template=template, chat_template=chat_template)
    rollouts = rollout_labels(engine, tokenizer, tasks, greedy, retrieval, run_async).rollouts
    return {"label_overlap": sum(label_overlap(r.label, r.task.answers[0]) for r in rollouts) / len(rollouts),
            "exact": sum(r.label == r.task.answers[0] for r in rollouts) / len(rollouts)}


def parse_label_record(record, where: str) -> Task:
    return Task(record_text(record, "id", where), "label", record_text(record, "text", where),
                answers=record_strings(record, "label", where, required=False))


LABEL = TaskKind(
    name="label", builtin_template="Text: {query}\nLabel:", rollout=rollout_labels, score=score_labels,
    evaluate=evaluate_labels, metric_names=("label_overlap", "exact"),
    max_completion_tokens=lambda rollout: rollout.max_new_tokens,
    formats=(RecordFormat("labelled", "text", parse_label_record),),
    required={"answers": "a label task needs its label"},
    write_record=lambda task: {"id": task.task_id, "text": task.query, "label": list(task.answers)},
)


@pytest.fixture(scope="module")
def label_kind():
    register_task_kind(LABEL)
    yield LABEL
    TASK_KINDS.pop(LABEL.name, None)


@pytest.fixture(scope="module")
def label_tasks(label_kind, tmp_path_factory) -> tuple[list[Task], object]:
    tasks = [Task(f"l{i}", "label", text, answers=(label,)) for i, (text, label) in enumerate(LABELS)]
    path = tmp_path_factory.mktemp("label-tasks") / "labels.jsonl"
    write_tasks(tasks, path)
    return tasks, path


def test_the_kinds_record_format_loads_and_writes_its_tasks(label_tasks, tmp_path):
    tasks, path = label_tasks
    assert json.loads(path.read_text().splitlines()[0]) == {"id": "l0", "text": "a tower in paris",
                                                            "label": ["landmark"]}
    assert load_tasks(path) == tasks  # fmt=auto finds the kind's format by its key
    assert load_tasks(path, fmt="labelled") == tasks
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "text": "no label here"}) + "\n")
    with pytest.raises(InvalidArgument, match="bad.jsonl:1: answers: a label task needs its label"):
        load_tasks(bad)
    # A built-in kind's records can be read as the new kind, which then requires its own field.
    search = tmp_path / "search.jsonl"
    search.write_text(json.dumps({"id": "q", "question": "who?", "answers": ["me"]}) + "\n")
    assert load_tasks(search, kind="label") == [Task("q", "label", "who?", answers=("me",))]


def test_a_clashing_record_format_is_refused(label_kind):
    clash = TaskKind("other", "{query}", rollout_labels, score_labels, evaluate_labels, (), lambda r: 1,
                     formats=(RecordFormat("other", "question", parse_label_record),))
    with pytest.raises(ConfigError, match="record format 'other' .* clashes with the registered format 'search'"):
        register_task_kind(clash)
    assert "other" not in TASK_KINDS


def test_the_kinds_properties_drive_the_config_checks(label_kind, trainer_world, tmp_path):
    base = trainer_world.overrides(tmp_path, judge=False)
    assert load_train_config(None, [*base, "tasks.kind=label"]).tasks.kind == "label"
    with pytest.raises(ConfigError, match=r"calibadv with tasks.kind=label: .* use advantage.type=grpo, or a "
                                          r"multi-step tasks.kind \(search\)"):
        load_train_config(None, [*base, "tasks.kind=label", "advantage.type=calibadv"])
    with pytest.raises(ConfigError, match=r"tasks.kind: 'labels' is not one of \['auto', 'rewrite', 'search', 'label'\]"):
        load_train_config(None, [*base, "tasks.kind=labels"])
    with pytest.raises(ConfigError, match=r"tasks.format: 'csv' is not one of \['auto', .*'labelled'\]"):
        load_train_config(None, [*base, "tasks.format=csv"])


def test_a_third_kind_trains_and_evaluates_through_the_registry(label_tasks, trainer_world, tmp_path):
    tasks, path = label_tasks
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, f"tasks.path={path}", "steps=1", "rollout.max_new_tokens=4", "optimizer.lr=5e-2", judge=False))
    result = train(config, retrieval=retrieval, judge=None)
    assert result.stopped == "completed" and result.steps_done == 1
    (logged,) = result.history
    assert 0.0 <= logged["reward"] <= 1.0 and math.isfinite(logged["loss"])
    # The kind's reward was used. Tolerance: pytest.approx's 1e-6 relative, since "reward" is a float32
    # tensor mean and the component mean a Python float64 mean of the same values (float32 rounding ~6e-8).
    assert logged["rewards/overlap/mean"] == pytest.approx(logged["reward"])
    from calibrl.trainer.checkpoint import find_checkpoint

    checkpoint = find_checkpoint(tmp_path)
    with BackgroundLoop() as loop:
        rows = evaluate_models([str(trainer_world.policy_dir), str(checkpoint)], tasks, retrieval,
                               EvalSettings(max_new_tokens=4, device="cpu"), run_async=loop.run,
                               names=["base", "trained"])
        with pytest.raises(ConfigError, match="raw-query baseline applies to \\['rewrite'\\] tasks only, not label"):
            evaluate_models([], tasks, retrieval, EvalSettings(device="cpu"), run_async=loop.run,
                            raw_query_baseline=True)
    assert [(r.name, r.kind, r.num_tasks) for r in rows] == [("base", "label", 8), ("trained", "label", 8)]
    for row in rows:
        assert set(row.metrics) == {"label_overlap", "exact"}
        assert 0.0 <= row.metrics["exact"] <= row.metrics["label_overlap"] <= 1.0  # an exact label overlaps fully
        assert row.prompt["template"] == "Text: {query}\nLabel:"  # the kind's built-in template, from config.yaml
    assert format_table(rows).splitlines()[0].split() == ["model", "tasks", "label_overlap", "exact", "prompt"]
