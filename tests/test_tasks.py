import json

import pytest

from calibrl.errors import ConfigError, InvalidArgument
from calibrl.trainer.tasks import Task, load_tasks, split_tasks, write_tasks


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_rewrite_format_round_trips(tmp_path):
    path = _write(tmp_path / "rewrite.jsonl", [
        {"id": "r1", "query": " cheap flights paris ", "gold_doc_ids": ["d1", "d2", "d1"],
         "context": {"domain": "travel", "priority": 2}},
        "",
        {"id": 7, "query": "visa rules", "gold_doc_ids": ["d9"], "answers": ["90 days"]},
    ])
    tasks = load_tasks(path)
    assert tasks == [
        Task("r1", "rewrite", "cheap flights paris", ("d1", "d2"), (), (("domain", "travel"), ("priority", "2"))),
        Task("7", "rewrite", "visa rules", ("d9",), ("90 days",), ()),
    ]
    assert tasks[0].context_dict() == {"domain": "travel", "priority": "2"}
    write_tasks(tasks, tmp_path / "again.jsonl")
    assert load_tasks(tmp_path / "again.jsonl") == tasks


def test_search_format_and_kind_conversion(tmp_path):
    path = _write(tmp_path / "search.jsonl", [
        {"id": "q1", "question": "Who wrote Dune?", "answers": ["Frank Herbert"], "gold_doc_ids": ["Dune"]},
    ])
    (task,) = load_tasks(path)
    assert (task.kind, task.query, task.answers, task.gold_doc_ids) == (
        "search", "Who wrote Dune?", ("Frank Herbert",), ("Dune",))
    (as_rewrite,) = load_tasks(path, kind="rewrite")
    assert as_rewrite.kind == "rewrite" and as_rewrite.gold_doc_ids == ("Dune",)


def test_hotpotqa_format(hotpotqa_path):
    tasks = load_tasks(hotpotqa_path, fmt="hotpotqa")
    assert len(tasks) == 400
    assert all(t.kind == "search" and len(t.gold_doc_ids) == 2 and t.answers for t in tasks)
    first = json.loads(hotpotqa_path.read_text().splitlines()[0])
    assert tasks[0].task_id == first["question_id"]
    assert tasks[0].answers == tuple(first["answers_objects"][0]["spans"])
    assert set(tasks[0].gold_doc_ids) == {c["title"] for c in first["contexts"] if c["is_supporting"]}
    # auto-detection gives the same tasks; kind="rewrite" reuses the supporting titles as retrieval targets
    assert load_tasks(hotpotqa_path) == tasks
    assert {t.kind for t in load_tasks(hotpotqa_path, kind="rewrite")} == {"rewrite"}


@pytest.mark.parametrize(
    "record, message",
    [
        ('{"id": "a", "query": ', "2: not valid JSON"),
        ('["a"]', "2: expected a JSON object"),
        ({"id": "a", "text": "x"}, "2: query: missing"),  # the format is fixed by the first record
        ({"id": "a", "query": "x"}, "2: gold_doc_ids: missing"),
        ({"id": "a", "query": "x", "gold_doc_ids": "d1"}, "2: gold_doc_ids: must be a list of strings"),
        ({"id": "a", "query": "x", "gold_doc_ids": ["d1", 3]}, "2: gold_doc_ids[1]: must be a non-empty string"),
        ({"id": "a", "query": "", "gold_doc_ids": ["d1"]}, "2: query: must be a non-empty string"),
        ({"id": "a", "query": "x", "gold_doc_ids": []}, "2: gold_doc_ids: a rewrite task needs at least one"),
        ({"id": "a", "query": "x", "gold_doc_ids": ["d"], "context": {"k": [1]}}, "2: context.k: must be"),
        ({"id": "ok", "query": "x", "gold_doc_ids": ["d"]}, "2: id: duplicate task id 'ok' (first at line 1)"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path, record, message):
    path = _write(tmp_path / "bad.jsonl", [{"id": "ok", "query": "fine", "gold_doc_ids": ["d"]}, record])
    with pytest.raises(InvalidArgument) as info:
        load_tasks(path, fmt="auto")
    assert f"bad.jsonl:{message}" in str(info.value)


def test_search_task_needs_answers_and_file_errors(tmp_path):
    path = _write(tmp_path / "s.jsonl", [{"id": "a", "query": "x", "gold_doc_ids": ["d"]}])
    with pytest.raises(InvalidArgument, match="s.jsonl:1: answers: a search task needs at least one gold answer"):
        load_tasks(path, kind="search")
    with pytest.raises(InvalidArgument, match="u.jsonl:1: cannot tell the task format from keys"):
        load_tasks(_write(tmp_path / "u.jsonl", [{"id": "a", "text": "x"}]))
    with pytest.raises(ConfigError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="holds no tasks"):
        load_tasks(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(InvalidArgument, match="fmt: 'csv' is not one of"):
        load_tasks(path, fmt="csv")
    with pytest.raises(InvalidArgument, match="kind: 'qa' is not one of"):
        load_tasks(path, kind="qa")


def test_split_is_deterministic_and_disjoint():
    tasks = [Task(f"t{i}", "rewrite", f"q{i}", ("d",)) for i in range(50)]
    train, heldout = split_tasks(tasks, 0.2, seed=3)
    assert len(heldout) == 10 and len(train) == 40
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in heldout})
    assert sorted(train + heldout, key=lambda t: int(t.task_id[1:])) == tasks
    assert [t.task_id for t in train] == sorted((t.task_id for t in train), key=lambda s: int(s[1:]))
    assert split_tasks(tasks, 0.2, seed=3) == (train, heldout)
    assert split_tasks(tasks, 0.2, seed=4)[1] != heldout
    assert split_tasks(tasks, 0.0, seed=0) == (tasks, [])
    assert len(split_tasks(tasks[:3], 0.01, seed=0)[1]) == 1  # a positive fraction holds out at least one
    with pytest.raises(InvalidArgument, match="heldout_fraction"):
        split_tasks(tasks, 1.0, seed=0)
