"""Rubric versions served without a restart (calibrl.judge_server.rubric_store): a real judge
server on loopback with API keys, its rubric folder changed while two tenants call it."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc
import pytest

from calibrl.errors import FailedPrecondition, InvalidArgument, NotFound
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import load_rubric, parse_rubric
from calibrl.judge_server.rubric_store import RubricFolder, split_ref
from calibrl.judge_server.server import start
from calibrl.api.judge import JudgeItem
from calibrl.judge_server.authoring.validation import ValidationRecord, validation_path, write_record
from calibrl.serving import ServingConfig
from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc

MODEL_ID = "programmatic[hashed-ngrams]"
KEYS = {"team-a": "key-a", "team-b": "key-b", "ops": "key-ops"}

# Two versions of one rubric whose totals differ on every item below: version 1 weighs entity
# coverage, version 2 the length criterion, so a total says which version scored it.
V1 = """\
id: rewriter
version: "1"
tenants: ["*"]
criteria:
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.9}
  - {name: length, kind: programmatic, scorer: length, weight: 0.1}
"""
V2 = V1.replace('version: "1"', 'version: "2"').replace("weight: 0.9", "weight: 0.2").replace(
    "weight: 0.1", "weight: 0.8")
V3 = V1.replace('version: "1"', 'version: "3"').replace("weight: 0.9", "weight: 0.5").replace(
    "weight: 0.1", "weight: 0.5")

QUERIES = [("VTSAX expense ratio 2024", "expense ratio of VTSAX"),
           ("Vanguard 500 index fund minimum", "minimum investment Vanguard fund"),
           ("FZROX dividend yield", "FZROX yield dividends paid per year by the fund")]


def _validate(path, passed=True, model_id=MODEL_ID):
    rubric = load_rubric(path)
    write_record(validation_path(path), ValidationRecord(
        rubric_id=rubric.id, rubric_hash=rubric.hash, model_id=model_id, passed=passed,
        kappa=0.8 if passed else 0.2, min_kappa=0.6, pass_threshold=0.6, n_items=30, golden_sha256="0" * 64,
        reason="kappa 0.800 >= min_kappa 0.6" if passed else "kappa 0.200 < min_kappa 0.6"))
    return rubric


def _publish(folder, text, passed=True):
    """Write a new version the way the docs tell: validation record first, then the file by rename."""
    path = folder / "rewriter.yaml"
    staged = folder / "rewriter.yaml.next"
    staged.write_text(text)
    rubric = parse_rubric(text, str(path), folder)
    if passed is not None:
        write_record(validation_path(path), ValidationRecord(
            rubric_id=rubric.id, rubric_hash=rubric.hash, model_id=MODEL_ID, passed=passed,
            kappa=0.8 if passed else 0.2, min_kappa=0.6, pass_threshold=0.6, n_items=30, golden_sha256="0" * 64,
            reason="kappa 0.800 >= min_kappa 0.6" if passed else "kappa 0.200 < min_kappa 0.6"))
    staged.replace(path)
    return rubric


def _items():
    return [JudgeItem.make(q, o) for q, o in QUERIES]


def _expected(text):
    judge = Judge([parse_rubric(text)], JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True))
    return [s.total for s in judge.score("rewriter", _items())]


def _keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n" + "".join(
        f"  - {{name: {name}, key_sha256: {hashlib.sha256(key.encode()).hexdigest()}}}\n"
        for name, key in KEYS.items()))
    return path


async def _serve(tmp_path, retention_s=600.0, poll_s=0.05):
    folder, running = await start_judge(tmp_path, retention_s, poll_s)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    return folder, running, channel, judge_pb2_grpc.JudgeServiceStub(channel)


async def start_judge(tmp_path, retention_s=600.0, poll_s=0.05):
    """A judge server on a fresh rubric folder holding V1 (validated), API keys on, tenant ops an admin."""
    folder = tmp_path / "rubrics"
    folder.mkdir()
    (folder / "rewriter.yaml").write_text(V1)
    _validate(folder / "rewriter.yaml")
    config = JudgeServerConfig(rubrics=str(folder), judge=JudgeConfig(embedder="hashed-ngrams", cache_size=0),
                               serving=ServingConfig(port=0, grace_seconds=1.0,
                                                     api_keys_file=str(_keys_file(tmp_path))),
                               max_wait_ms=1.0, rubric_poll_s=poll_s, rubric_retention_s=retention_s,
                               rubric_admin_tenants=["ops"])
    return folder, await start(config)


def _md(tenant):
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def _request(rubric_id, rubric_hash=""):
    return pb.ScoreRequest(rubric_id=rubric_id, rubric_hash=rubric_hash,
                           items=[wire.item_to_proto(i) for i in _items()])


async def _wait_for(predicate, timeout_s=30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the poller did not pick up the change in time"
        await asyncio.sleep(0.02)


def test_refs_name_a_version_by_its_hash():
    assert split_ref("rewriter") == ("rewriter", "")
    assert split_ref("rewriter@ABCDEF12") == ("rewriter", "abcdef12")
    with pytest.raises(InvalidArgument, match=r"rubric_id: version 'abc' after '@' must be .* 8 to 64 hex"):
        split_ref("rewriter@abc")
    with pytest.raises(InvalidArgument, match="rubric_id: empty id before '@'"):
        split_ref("@abcdef12")


async def test_a_swap_under_two_tenants_loses_no_call_and_mixes_no_versions(tmp_path):
    folder, running, channel, stub = await _serve(tmp_path)
    v1, v2 = parse_rubric(V1), parse_rubric(V2)
    expected = {v1.hash: _expected(V1), v2.hash: _expected(V2)}
    assert expected[v1.hash] != expected[v2.hash]
    seen: list[tuple[str, str, str, list[float]]] = []
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def caller(tenant, ref):
        while not stop.is_set():
            try:
                response = await stub.Score(_request(ref), metadata=_md(tenant), timeout=10)
            except grpc.aio.AioRpcError as exc:  # a lost call
                failures.append(exc)
                continue
            seen.append((tenant, response.rubric_hash, response.rubric_version, [s.total for s in response.scores]))

    try:
        tasks = [asyncio.create_task(caller(t, "rewriter")) for t in ("team-a", "team-b") for _ in range(3)]
        tasks.append(asyncio.create_task(caller("team-b", f"rewriter@{v1.hash[:12]}")))  # a pinned trainer
        await _wait_for(lambda: len(seen) >= 30)
        _publish(folder, V2)
        await _wait_for(lambda: running.servicer.judge.versions.current("rewriter").rubric.hash == v2.hash)
        swapped_at = len(seen)
        await _wait_for(lambda: sum(1 for s in seen[swapped_at:] if s[1] == v2.hash) >= 30)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        await channel.close()
        await running.stop(0)
    assert failures == []
    for tenant, rubric_hash, label, totals in seen:
        assert rubric_hash in expected, rubric_hash
        assert totals == expected[rubric_hash]  # every item of one call by the version the response names
        assert label == {v1.hash: "1", v2.hash: "2"}[rubric_hash]
    for tenant in ("team-a", "team-b"):
        assert {h for t, h, _, _ in seen if t == tenant} == {v1.hash, v2.hash}


async def test_pinned_scores_are_bitwise_unchanged_across_the_swap(tmp_path):
    folder, running, channel, stub = await _serve(tmp_path)
    v1 = parse_rubric(V1)
    try:
        before = await stub.Score(_request(f"rewriter@{v1.hash[:8]}"), metadata=_md("team-a"))
        by_hash = await stub.Score(_request("rewriter", v1.hash), metadata=_md("team-a"))
        _publish(folder, V2)
        await _wait_for(lambda: running.servicer.judge.versions.current("rewriter").rubric.hash != v1.hash)
        after = await stub.Score(_request(f"rewriter@{v1.hash}"), metadata=_md("team-b"))
        after_by_hash = await stub.Score(_request("rewriter", v1.hash), metadata=_md("team-b"))
        current = await stub.Score(_request("rewriter"), metadata=_md("team-b"))
        listed = await stub.ListRubrics(pb.ListRubricsRequest(), metadata=_md("team-a"))
        old = await stub.GetRubric(pb.GetRubricRequest(rubric_id=f"rewriter@{v1.hash[:10]}"), metadata=_md("team-a"))
    finally:
        await channel.close()
        await running.stop(0)
    for response in (by_hash, after, after_by_hash):
        assert response.SerializeToString() == before.SerializeToString()
    assert current.rubric_hash != v1.hash and current.rubric_version == "2"
    (summary,) = listed.rubrics
    assert summary.version == "2"
    assert [(v.version, v.state) for v in summary.versions] == [("2", "current"), ("1", "retained")]
    assert summary.versions[1].retires_at > summary.versions[1].loaded_at
    assert old.hash == v1.hash and old.version == "1" and old.source_yaml == V1


async def test_an_invalid_version_is_refused_and_the_old_one_keeps_serving(tmp_path, caplog):
    folder, running, channel, stub = await _serve(tmp_path, poll_s=0)
    v1 = parse_rubric(V1)
    try:
        _publish(folder, V2, passed=False)  # a failed validation record
        caplog.set_level(logging.ERROR, logger="calibrl.judge_server.rubric_store")
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.ReloadRubrics(pb.ReloadRubricsRequest(), metadata=_md("team-a"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "tenant 'team-a' is not in rubric_admin_tenants" in denied.value.details()
        failed = await stub.ReloadRubrics(pb.ReloadRubricsRequest(), metadata=_md("ops"))
        served = await stub.Score(_request("rewriter"), metadata=_md("team-a"))
        _publish(folder, V3, passed=None)  # no validation record for this content
        missing = await stub.ReloadRubrics(pb.ReloadRubricsRequest(), metadata=_md("ops"))
        still = await stub.Score(_request("rewriter"), metadata=_md("team-b"))
        listed = await stub.ListRubrics(pb.ListRubricsRequest(), metadata=_md("team-a"))
        with pytest.raises(grpc.aio.AioRpcError) as pinned_refused:
            await stub.Score(_request(f"rewriter@{parse_rubric(V2).hash[:12]}"), metadata=_md("team-a"))
        _publish(folder, V3)  # now validated
        loaded = await stub.ReloadRubrics(pb.ReloadRubricsRequest(), metadata=_md("ops"))
        now = await stub.Score(_request("rewriter"), metadata=_md("team-a"))
    finally:
        await channel.close()
        await running.stop(0)
    (change,) = failed.changes
    assert (change.rubric_id, change.action, change.version) == ("rewriter", "refused", "2")
    assert "its validation for this model failed (kappa 0.200 < min_kappa 0.6)" in change.reason
    assert any("REFUSED" in r.getMessage() and "rewriter" in r.getMessage() for r in caplog.records)
    (change,) = missing.changes
    assert change.action == "refused" and "no validation record for this model" in change.reason
    assert served.rubric_hash == still.rubric_hash == v1.hash
    assert [s.total for s in still.scores] == _expected(V1)
    assert [(v.version, v.state) for v in listed.rubrics[0].versions] == [
        ("1", "current"), ("3", "refused"), ("2", "refused")]
    assert pinned_refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version " + parse_rubric(V2).hash[:12] + " was refused" in pinned_refused.value.details()
    assert [c.action for c in loaded.changes] == ["loaded"] and now.rubric_version == "3"


async def test_retention_expiry_retires_an_old_version_with_a_clear_not_found(tmp_path):
    folder, running, channel, stub = await _serve(tmp_path, retention_s=2.0)
    v1, v2 = parse_rubric(V1), parse_rubric(V2)
    try:
        _publish(folder, V2)
        await _wait_for(lambda: running.servicer.judge.versions.current("rewriter").rubric.hash == v2.hash)
        kept = await stub.Score(_request(f"rewriter@{v1.hash[:12]}"), metadata=_md("team-a"))
        await asyncio.sleep(2.2)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.Score(_request(f"rewriter@{v1.hash[:12]}"), metadata=_md("team-a"))
        with pytest.raises(grpc.aio.AioRpcError) as gone_by_hash:
            await stub.Score(_request("rewriter", v1.hash), metadata=_md("team-b"))
        current = await stub.Score(_request("rewriter"), metadata=_md("team-b"))
        listed = await stub.ListRubrics(pb.ListRubricsRequest(), metadata=_md("team-a"))
    finally:
        await channel.close()
        await running.stop(0)
    assert kept.rubric_hash == v1.hash
    for error in (gone.value, gone_by_hash.value):
        assert error.code() == grpc.StatusCode.NOT_FOUND
        details = error.details()
        assert f"rubric 'rewriter' version {v1.hash[:12]} was retired at " in details
        assert f"superseded by version {v2.hash[:12]}" in details and "rubric_retention_s=2 s" in details
    assert current.rubric_hash == v2.hash
    assert [(v.version, v.state) for v in listed.rubrics[0].versions] == [("2", "current"), ("1", "retired")]


def test_the_folder_refuses_a_broken_file_and_a_duplicate_id_and_retires_a_removed_one(tmp_path):
    folder = tmp_path / "rubrics"
    folder.mkdir()
    (folder / "rewriter.yaml").write_text(V1)
    _validate(folder / "rewriter.yaml")
    clock = [1000.0]
    judge = Judge.from_config(JudgeConfig(embedder="hashed-ngrams"), folder)
    judge.versions.clock = lambda: clock[0]
    judge.versions.retention_s = 60
    watched = RubricFolder(judge, folder)
    assert watched.reload() == []  # nothing changed since start
    (folder / "rewriter.yaml").write_text(V2.replace("criteria:", "criteria: [oops"))
    (change,) = watched.reload()
    assert change.action == "refused" and "rewriter.yaml:" in change.reason and "(syntax)" in change.reason
    assert watched.reload() == []  # refused once, not again every poll
    (folder / "rewriter.yaml").write_text(V1)
    (folder / "copy.yaml").write_text(V2)
    _validate(folder / "copy.yaml")
    (change,) = watched.reload()
    assert change.action == "refused" and "is already used by" in change.reason
    assert judge.resolve("rewriter").hash == parse_rubric(V1).hash
    (folder / "copy.yaml").unlink()
    (folder / "rewriter.yaml").unlink()
    (change,) = watched.reload()
    assert change.action == "removed"
    with pytest.raises(NotFound, match="rubric 'rewriter' has no current version: its file was removed"):
        judge.resolve("rewriter")
    assert judge.resolve("rewriter@" + parse_rubric(V1).hash[:8]).version == "1"  # pinned: still served
    clock[0] += 61
    (change,) = watched.reload()
    assert change.action == "retired"
    with pytest.raises(NotFound, match=r"version \w{12} was retired at .*: its file was removed at"):
        judge.resolve("rewriter@" + parse_rubric(V1).hash[:8])


def test_a_new_id_without_validation_is_visible_but_refused_like_at_start(tmp_path):
    folder = tmp_path / "rubrics"
    folder.mkdir()
    judge = Judge.from_config(JudgeConfig(embedder="hashed-ngrams"), folder)
    watched = RubricFolder(judge, folder)
    (folder / "rewriter.yaml").write_text(V1)
    (change,) = watched.reload()
    assert change.action == "refused"
    with pytest.raises(FailedPrecondition, match="no validation record for this model"):
        judge.resolve("rewriter")
    _validate(folder / "rewriter.yaml")
    (change,) = watched.reload()
    assert change.action == "loaded" and judge.resolve("rewriter").version == "1"
