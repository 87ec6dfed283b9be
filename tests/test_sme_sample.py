"""calibrl sme sample: the item format and representative sampling."""

import json
import subprocess
import sys

import numpy as np
import pytest

from calibrl.errors import ConfigError
from calibrl.sme.items import ItemError, SampleItem, parse_item, read_items, write_items
from calibrl.sme.sample import SampleOptions, _shares, choose_sample, kmeans
from tests.sme_fixtures import feedback_items


def blobs(n_blobs=5, per_blob=20, dim=8, seed=0):
    """Well separated clusters of unit vectors; blob b is around axis b."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for b in range(n_blobs):
        centre = np.zeros(dim)
        centre[b] = 1.0
        points = centre + 0.05 * rng.standard_normal((per_blob, dim))
        rows.append(points / np.linalg.norm(points, axis=1, keepdims=True))
        labels += [b] * per_blob
    return np.vstack(rows), labels


def plain_items(count, outcome=None, totals=None):
    items = []
    for i in range(count):
        signals = () if outcome is None else (("hit", float(outcome(i) == "hit")),)
        items.append(SampleItem(id=f"i{i}", query=f"q{i}", output=f"o{i}", signals=signals,
                                judge_total=None if totals is None else totals[i]))
    return items


def test_representatives_cover_every_cluster():
    vectors, labels = blobs()
    result = choose_sample(plain_items(len(labels)), SampleOptions(n=5, seed=0), vectors=vectors)
    chosen = {labels[int(item.id[1:])] for item in result.items}
    assert chosen == {0, 1, 2, 3, 4}  # one per blob: every region of the task space is seen
    assert result.coverage.clusters_covered == 5 and result.coverage.clusters == 5
    assert all(item.reasons[0].startswith("representative: medoid of cluster") for item in result.items)


def test_outcome_strata_share_the_budget():
    vectors, _ = blobs(n_blobs=5, per_blob=20)
    items = plain_items(100, outcome=lambda i: "miss" if i % 5 == 0 else "hit")  # 80 hit, 20 miss
    result = choose_sample(items, SampleOptions(n=10), vectors=vectors)
    assert result.coverage.outcome_chosen == {"hit": 8, "miss": 2}
    assert result.coverage.outcome_all == {"hit": 80, "miss": 20}
    # A stratum too small for its proportional share still gets one item.
    items = plain_items(100, outcome=lambda i: "miss" if i == 7 else "hit")
    result = choose_sample(items, SampleOptions(n=4), vectors=vectors)
    assert result.coverage.outcome_chosen == {"hit": 3, "miss": 1}


def test_judge_unsure_and_disagreements_get_their_share():
    vectors, _ = blobs(n_blobs=4, per_blob=10)
    totals = [0.95] * 40
    totals[3], totals[17], totals[25] = 0.61, 0.55, 0.7  # near the 0.6 threshold, in that order of closeness
    totals[30] = 0.99  # the judge passes it, retrieval misses it
    items = plain_items(40, outcome=lambda i: "miss" if i in (30, 31) else "hit", totals=totals)
    totals[31] = 0.0
    items[31] = SampleItem(id="i31", query="q31", output="o31", signals=(("hit", 0.0),), judge_total=0.0)
    result = choose_sample(items, SampleOptions(n=10, uncertain_share=0.2, disagree_share=0.1), vectors=vectors)
    reasons = {item.id: item.reasons[0] for item in result.items}
    assert reasons["i3"].startswith("judge unsure: total 0.610") and reasons["i17"].startswith("judge unsure")
    assert "i25" not in reasons or not reasons["i25"].startswith("judge unsure")  # only 2 unsure slots
    assert reasons["i30"] == "judge and retrieval disagree: judge pass (total 0.990) but retrieval miss"
    assert len(result.items) == 10
    assert result.coverage.by_reason == {"judge and retrieval disagree": 1, "judge unsure": 2, "representative": 7}


def test_deterministic_for_a_seed_and_all_items_when_n_is_large():
    items = feedback_items(60)
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((60, 16))
    first = choose_sample(items, SampleOptions(n=12, seed=4), vectors=vectors)
    second = choose_sample(items, SampleOptions(n=12, seed=4), vectors=vectors)
    assert [i.to_json() for i in first.items] == [i.to_json() for i in second.items]
    assert len({i.id for i in first.items}) == 12
    everything = choose_sample(items[:7], SampleOptions(n=50), vectors=vectors[:7])
    assert sorted(i.id for i in everything.items) == sorted(i.id for i in items[:7])


def test_shares_split_by_size_and_respect_caps():
    assert _shares({"hit": 80, "miss": 20}, 10) == {"hit": 8, "miss": 2}
    assert _shares({"hit": 99, "miss": 1}, 5) == {"hit": 4, "miss": 1}
    assert _shares({"hit": 2, "miss": 30}, 10) == {"hit": 1, "miss": 9}
    assert _shares({"a": 2, "b": 2}, 10) == {"a": 2, "b": 2}
    for sizes, budget in (({"a": 5, "b": 7, "c": 1}, 6), ({"a": 1, "b": 1, "c": 1}, 2), ({"a": 50}, 3)):
        shares = _shares(sizes, budget)
        assert sum(shares.values()) == min(budget, sum(sizes.values()))
        assert all(0 <= shares[s] <= sizes[s] for s in sizes)


def test_kmeans_finds_separated_blobs_and_survives_duplicates():
    vectors, labels = blobs(n_blobs=3, per_blob=15)
    found, centres = kmeans(vectors, 3, seed=0)
    assert centres.shape == (3, 8)
    groups = {tuple(sorted({found[i] for i in range(len(labels)) if labels[i] == b})) for b in range(3)}
    assert len(groups) == 3 and all(len(g) == 1 for g in groups)  # each blob is one cluster
    same = np.ones((6, 4))
    found, centres = kmeans(same, 3, seed=0)
    assert len(found) == 6  # identical points: no crash, every point labelled


def test_item_format_round_trip_and_errors(tmp_path):
    items = feedback_items(5)
    path = tmp_path / "items.jsonl"
    write_items(path, items)
    assert read_items(path) == items
    assert parse_item({"query": "a", "output": "b"}).id.startswith("item-")  # id from the content
    bad = [
        ({"query": "a"}, "output: required"),
        ({"query": "a", "output": "b", "grade": 3}, "grade: unknown field"),
        ({"query": "a", "output": "b", "judge_total": 1.5}, "judge_total: expected a number in [0, 1]"),
        ({"query": "a", "output": "b", "signals": {"hit": "yes"}}, "signals.hit: expected a finite number"),
        ({"query": "a", "output": "b", "id": "x@y"}, "id: 'x@y' contains '@'"),
        ({"query": "a", "output": "b", "retrieved_doc_ids": ["d1"], "retrieved_texts": ["t", "u"]},
         "retrieved_texts: 2 texts for 1 retrieved_doc_ids"),
    ]
    for number, (record, message) in enumerate(bad, start=1):
        path.write_text('{"query": "fine", "output": "fine", "id": "ok"}\n' + json.dumps(record) + "\n")
        with pytest.raises(ItemError) as error:
            read_items(path)
        assert f"{path}:2: {message}" in str(error.value), (number, str(error.value))
    path.write_text('{"query": "a", "output": "b", "id": "x"}\n\n{"query": "c", "output": "d", "id": "x"}\n')
    with pytest.raises(ItemError, match=r":3: id: 'x' already used on line 1"):
        read_items(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_items(tmp_path / "missing.jsonl")


def test_cli_with_minilm_is_deterministic_and_explains_each_choice(tmp_path):
    items = feedback_items(60)
    source = tmp_path / "eval_items.jsonl"
    write_items(source, items)
    outputs = []
    for run in range(2):
        out = tmp_path / f"sample{run}.jsonl"
        done = subprocess.run([sys.executable, "-m", "calibrl.cli", "sme", "sample", "--rollouts", str(source),
                               "--n", "12", "--out", str(out), "--seed", "1"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append((out.read_bytes(), done.stdout))
    assert outputs[0][0] == outputs[1][0]
    chosen = read_items(tmp_path / "sample0.jsonl")
    assert len(chosen) == 12 and all(item.reasons for item in chosen)
    stdout = outputs[0][1]
    assert "chose 12 of 60 items" in stdout and "clusters covered:" in stdout and "outcome mix, sample:" in stdout
    for item in chosen:
        assert f"  {item.id}: {item.reasons[0]}" in stdout
    bad = subprocess.run([sys.executable, "-m", "calibrl.cli", "sme", "sample", "--rollouts", str(source),
                          "--n", "0", "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "n=0: must be >= 1" in bad.stderr
