"""calibrl sme review: the feedback store, reviewer agreement and the web app (Flask test
client for the pages; a real server on loopback for the address and token rules)."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("flask", reason="the review page needs Flask: pip install 'calibrl[sme]'")

from calibrl.errors import ConfigError
from calibrl.sme.agreement import pairwise
from calibrl.sme.app import ReviewSettings, create_app, serve
from calibrl.sme.store import FeedbackStore, check_reviewer, split_feedback_id
from calibrl.judge_server import cli as judge_cli
from calibrl.judge_server import metrics
from calibrl.judge_server.authoring.feedback import FeedbackRecord, read_feedback
from tests.sme_fixtures import write_rubric, write_sample


def answer(item, reviewer, grade=None, verdict=None, tags=(), notes=""):
    return FeedbackRecord(id=f"{item.id}@{reviewer}", query=item.query, output=item.output, grade=grade,
                          verdict=verdict, error_tags=tuple(tags), notes=notes, gold_doc_ids=item.gold_doc_ids)


# --------------------------------------------------------------------------- store


def test_store_saves_at_once_replaces_and_resumes(tmp_path):
    items = write_sample(tmp_path / "sample.jsonl", 4)
    out = tmp_path / "feedback.jsonl"
    foreign = FeedbackRecord(id="older-17", query="kept query", output="kept output", grade=2)
    out.write_text(json.dumps(foreign.to_json()) + "\n")
    store = FeedbackStore(out, [i.id for i in items])
    store.save(items[0].id, "alice", answer(items[0], "alice", grade=5))
    assert [r.id for r in read_feedback(out)] == ["older-17", f"{items[0].id}@alice"]  # on disk before returning
    store.save(items[1].id, "bob", answer(items[1], "bob", verdict="fail", tags=["missing_entity"]))
    store.save(items[0].id, "alice", answer(items[0], "alice", grade=2, notes="changed my mind"))
    records = read_feedback(out)
    assert [r.id for r in records] == ["older-17", f"{items[0].id}@alice", f"{items[1].id}@bob"]
    assert records[1].grade == 2 and records[1].notes == "changed my mind"  # replaced, not duplicated
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    again = FeedbackStore(out, [i.id for i in items])  # a restart
    assert again.graded_by("alice") == {items[0].id} and again.reviewers() == ["alice", "bob"]
    assert again.kept() == [foreign]
    again.save(items[2].id, "alice", answer(items[2], "alice", grade=4))
    assert read_feedback(out)[0] == foreign  # what the user had is still there


def test_store_refuses_a_malformed_file_and_bad_names(tmp_path):
    items = write_sample(tmp_path / "sample.jsonl", 2)
    out = tmp_path / "feedback.jsonl"
    out.write_text('{"query": "q", "output": "o", "grade": 3}\n{"query": "q", "output": "o", "grade": 9}\n')
    with pytest.raises(ConfigError, match=r"feedback.jsonl:2: grade: must be an integer 1..5"):
        FeedbackStore(out, [i.id for i in items])
    assert out.read_text().count("\n") == 2  # left as it was
    for name in ("", "a b", "x" * 41, "al@ice", "-lead"):
        with pytest.raises(ConfigError, match="reviewer"):
            check_reviewer(name)
    assert check_reviewer(" alice.b-2 ") == "alice.b-2"
    assert split_feedback_id("rw-1@alice") == ("rw-1", "alice") and split_feedback_id("plain-id") is None


def test_feedback_is_read_by_rubric_distill_unchanged(tmp_path):
    items = write_sample(tmp_path / "sample.jsonl", 12)
    out = tmp_path / "feedback.jsonl"
    store = FeedbackStore(out, [i.id for i in items])
    for n, item in enumerate(items):
        tags = ["missing_entity"] if n % 3 == 0 else (["vague"] if n % 3 == 1 else [])
        store.save(item.id, "alice", answer(item, "alice", grade=2 if tags else 5, tags=tags))
    before = out.read_bytes()
    # distillation's reader gets exactly the records the page saved
    assert read_feedback(out) == [a.record for a in store.answers()]
    code = judge_cli.distill(["--feedback", str(out), "--out", str(tmp_path / "r.yaml"),
                              "--golden-out", str(tmp_path / "g.jsonl"), "--golden-fraction", "0",
                              "--criteria", "programmatic"])
    assert code == 0
    assert out.read_bytes() == before
    text = (tmp_path / "r.yaml").read_text()
    assert "entity_coverage" in text and "specificity" in text  # both tags became criteria


def test_pairwise_agreement_matches_cohen_kappa(tmp_path):
    items = write_sample(tmp_path / "sample.jsonl", 8)
    store = FeedbackStore(tmp_path / "f.jsonl", [i.id for i in items])
    alice = [5, 5, 2, 1, 4, 2, 5, 3]
    bob = [4, 5, 2, 4, 5, 1, 2, None]
    for item, a, b in zip(items, alice, bob):
        store.save(item.id, "alice", answer(item, "alice", grade=a))
        if b is not None:
            store.save(item.id, "bob", answer(item, "bob", grade=b))
    store.save(items[0].id, "carol", answer(items[0], "carol", verdict="pass"))
    pairs = {(p.first, p.second): p for p in pairwise(store.answers())}
    ab = pairs[("alice", "bob")]
    expected = metrics.cohen_kappa(["pass" if g >= 4 else "fail" for g in alice[:7]],
                                   ["pass" if g >= 4 else "fail" for g in bob[:7]], ["pass", "fail"])
    assert ab.n_common == 7 and ab.kappa == pytest.approx(expected)
    assert -1.0 <= ab.kappa_low <= ab.kappa <= ab.kappa_high <= 1.0  # its bootstrap interval
    assert ab.grade_kappa == pytest.approx(metrics.quadratic_weighted_kappa(alice[:7], bob[:7]))
    assert [d.item_id for d in ab.disagreements] == [items[3].id, items[6].id]  # pass/fail differ
    assert ab.disagreements[0].first == "fail, grade 1" and ab.disagreements[0].second == "pass, grade 4"
    # One common item, both "pass": chance agreement is 1, so kappa is undefined (None), not a number.
    assert pairs[("alice", "carol")].n_common == 1 and pairs[("alice", "carol")].kappa is None
    assert pairs[("alice", "carol")].kappa_low is None
    assert pairs[("alice", "carol")].disagreements == []
    assert set(pairs) == {("alice", "bob"), ("alice", "carol"), ("bob", "carol")}


# --------------------------------------------------------------------------- pages


@pytest.fixture()
def review_app(tmp_path):
    items = write_sample(tmp_path / "sample.jsonl", 5)
    rubric, golden = write_rubric(tmp_path)
    settings = ReviewSettings(sample=tmp_path / "sample.jsonl", out=tmp_path / "feedback.jsonl", rubric=rubric)
    app = create_app(settings)
    return app, items, settings


def login(client, name="alice"):
    response = client.post("/reviewer", data={"name": name, "next": "/review"})
    assert response.status_code == 302


def test_review_flow_writes_each_answer_and_moves_on(review_app):
    app, items, settings = review_app
    client = app.test_client()
    response = client.get("/review")
    assert response.status_code == 302 and response.headers["Location"].startswith("/reviewer")
    login(client)
    response = client.get("/review")
    assert response.headers["Location"].endswith("/item/1")
    page = client.get("/item/1").get_data(as_text=True)
    assert items[0].query in page and items[0].output in page and "0 / 5 graded by alice" in page
    assert 'class="badge gold">gold</span>' in page  # the gold document is marked
    assert "entities" in page and "missing_entity" in page  # the rubric's criteria and taxonomy
    response = client.post("/item/1", data={"grade": "2", "tags": ["missing_entity"], "free_tags": "Wrong Year, odd",
                                            "notes": "dropped the ticker"})
    assert response.status_code == 302 and response.headers["Location"].endswith(f"/item/2?saved={items[0].id}")
    saved = read_feedback(settings.out)
    assert saved[0].id == f"{items[0].id}@alice" and saved[0].grade == 2
    assert saved[0].error_tags == ("missing_entity", "odd", "wrong_year") and saved[0].notes == "dropped the ticker"
    assert saved[0].retrieved_doc_ids == items[0].retrieved_doc_ids and saved[0].context == items[0].context
    client.post("/item/3", data={"verdict": "pass"})
    # Next ungraded after item 3 is 4; after the last one the page wraps round to item 2.
    assert client.post("/item/4", data={"grade": "5"}).headers["Location"].endswith("/item/5?saved=" + items[3].id)
    client.post("/item/5", data={"grade": "4"})
    assert client.get("/review").headers["Location"].endswith("/item/2")
    assert client.post("/item/2", data={"grade": "3"}).headers["Location"].startswith("/review")
    assert "has graded all 5 items" in client.get("/review").get_data(as_text=True)
    page = client.get("/item/1").get_data(as_text=True)  # a graded item shows the saved answer
    assert "You graded this item already" in page and 'value="2" checked' in page and "wrong_year" in page
    assert len(read_feedback(settings.out)) == 5


def test_bad_answers_name_the_field_and_keep_the_input(review_app):
    app, items, settings = review_app
    client = app.test_client()
    login(client)
    cases = [
        ({"notes": "only notes"}, "give a grade (1-5), a verdict (pass/fail) or both"),
        ({"grade": "7"}, "grade must be 1-5, got &#39;7&#39;"),
        ({"verdict": "maybe"}, "verdict must be pass or fail"),
        ({"grade": "3", "notes": "x" * 10_001}, "notes may have at most 10000 characters, got 10001"),
        ({"grade": "3", "free_tags": "y" * 65}, "a tag may have at most 64 characters"),
    ]
    for form, message in cases:
        response = client.post("/item/1", data=form)
        assert response.status_code == 400
        assert message in response.get_data(as_text=True), message
    response = client.post("/item/1", data={"notes": "keep me"})
    assert "keep me</textarea>" in response.get_data(as_text=True)  # nothing typed is lost
    assert not settings.out.exists()
    assert client.get("/item/99").status_code == 404
    assert client.get("/healthz").get_json() == {"status": "ok", "items": 5}  # still serving
    assert client.post("/reviewer", data={"name": "bad name"}).status_code == 400


def test_agreement_page_shows_kappa_and_disagreements(review_app):
    app, items, settings = review_app
    alice, bob = app.test_client(), app.test_client()
    login(alice, "alice")
    login(bob, "bob")
    assert "No two reviewers" in alice.get("/agreement").get_data(as_text=True)
    for n, (a, b) in enumerate([(5, 5), (2, 2), (5, 1), (1, 1)], start=1):
        alice.post(f"/item/{n}", data={"grade": str(a)})
        bob.post(f"/item/{n}", data={"grade": str(b)})
    page = alice.get("/agreement").get_data(as_text=True)
    expected = metrics.cohen_kappa(["pass", "fail", "pass", "fail"], ["pass", "fail", "fail", "fail"],
                                   ["pass", "fail"])
    assert "alice vs bob" in page and f"{expected:.3f}" in page
    assert re.search(rf'href="/item/3">{items[2].id}</a></td><td>pass, grade 5</td><td>fail, grade 1', page)


def test_rubric_page_shows_validation_and_golden_disagreements(tmp_path):
    write_sample(tmp_path / "sample.jsonl", 3)
    rubric, golden = write_rubric(tmp_path)
    golden_path = tmp_path / "golden.jsonl"
    from calibrl.judge_server.authoring.feedback import write_feedback

    write_feedback(golden_path, golden)
    code = judge_cli.validate(["--rubric", str(rubric), "--golden", str(golden_path), "--judge", "programmatic",
                               "embedder=hashed-ngrams"])
    assert code in (0, 1)
    record = json.loads((tmp_path / "sme-test.yaml.validation.json").read_text())["records"][0]
    settings = ReviewSettings(sample=tmp_path / "sample.jsonl", out=tmp_path / "f.jsonl", rubric=rubric,
                              golden=golden_path, judge_overrides=["embedder=hashed-ngrams"])
    client = create_app(settings).test_client()
    page = client.get("/rubric").get_data(as_text=True)
    assert f"{record['kappa']:.3f}" in page and ("Gate PASSED" if record["passed"] else "Gate FAILED") in page
    matrix = record["metrics"]["pass_fail"]["confusion"]["matrix"]
    assert f'<th>pass</th><td class="num">{matrix[0][0]}</td><td class="num">{matrix[0][1]}</td>' in page
    for name, c in record["metrics"]["criteria"].items():
        assert f"<td>{name}</td>" in page
    disagreeing = matrix[0][1] + matrix[1][0]  # the golden rows listed are exactly the off-diagonal cells
    assert page.count("<tr><td>", page.index("golden-disagreements")) == disagreeing
    empty = create_app(ReviewSettings(sample=tmp_path / "sample.jsonl", out=tmp_path / "f.jsonl",
                                      rubric=rubric, validation=tmp_path / "none.json")).test_client()
    assert "No validation record for this rubric version yet" in empty.get("/rubric").get_data(as_text=True)


# --------------------------------------------------------------------------- address and token


def test_non_loopback_address_needs_a_token(tmp_path):
    write_sample(tmp_path / "sample.jsonl", 2)
    settings = ReviewSettings(sample=tmp_path / "sample.jsonl", out=tmp_path / "f.jsonl", host="0.0.0.0", port=0)
    with pytest.raises(ConfigError, match="not a loopback address: serving the review page there needs --token"):
        serve(settings)
    done = subprocess.run([sys.executable, "-m", "calibrl.cli", "sme", "review", "--sample",
                           str(tmp_path / "sample.jsonl"), "--out", str(tmp_path / "f.jsonl"), "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "CALIBRL_SME_TOKEN": ""})
    assert done.returncode == 2 and "needs --token" in done.stderr


def test_token_is_required_on_every_request(tmp_path):
    write_sample(tmp_path / "sample.jsonl", 2)
    token = "s3cret-token-0123456789"
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl.cli", "sme", "review", "--sample", str(tmp_path / "sample.jsonl"),
         "--out", str(tmp_path / "f.jsonl"), "--port", "0", "--token", token],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+/)\?token=" + token, line).group(1)
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(url + "agreement", timeout=10)
        assert error.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(url + "agreement",
                                                          headers={"Authorization": "Bearer wrong-token"}), timeout=10)
        ok = urllib.request.urlopen(urllib.request.Request(url + "agreement",
                                                           headers={"Authorization": f"Bearer {token}"}), timeout=10)
        assert ok.status == 200 and "Agreement between reviewers" in ok.read().decode()
        assert urllib.request.urlopen(url + "healthz", timeout=10).status == 200  # probes need no token
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
