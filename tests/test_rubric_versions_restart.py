"""Rubric versions survive a judge restart (calibrl.judge_server.version_store): a real judge
server on loopback is stopped and a new one started on the same rubric folder; a caller pinned to
a superseded version keeps being scored by it, bit for bit, until its persisted retention ends."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
import pytest

from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.judge import Judge
from calibrl.judge_server.rubric import parse_rubric
from calibrl.judge_server.server import start
from calibrl.errors import ConfigError
from calibrl.judge_server.version_store import VersionStore
from calibrl.serving import ServingConfig
from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc
from tests.test_rubric_versions import V1, V2, V3, _items, _publish, _validate

RETENTION_S = 12.0


def _state_dir(folder):
    return folder.parent / "rubric-state"  # beside the rubric folder, never inside it


def _config(folder, retention_s=RETENTION_S, state_dir=None):
    state = str(_state_dir(folder)) if state_dir is None else state_dir
    return JudgeServerConfig(rubrics=str(folder), judge=JudgeConfig(embedder="hashed-ngrams", cache_size=0),
                             serving=ServingConfig(port=0, grace_seconds=1.0), max_wait_ms=1.0, rubric_poll_s=0,
                             rubric_retention_s=retention_s, rubric_state_dir=state)


async def _score(port, ref):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = judge_pb2_grpc.JudgeServiceStub(channel)
        response = await stub.Score(pb.ScoreRequest(rubric_id=ref, items=[wire.item_to_proto(i) for i in _items()]))
        return response.rubric_hash, [s.total for s in response.scores]


async def _versions(port, rubric_id="rewriter"):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        rubric = await judge_pb2_grpc.JudgeServiceStub(channel).GetRubric(pb.GetRubricRequest(rubric_id=rubric_id))
        return {v.hash: (v.state, v.retires_at, v.loaded_at) for v in rubric.versions}


def _folder(tmp_path):
    folder = tmp_path / "rubrics"
    folder.mkdir()
    (folder / "rewriter.yaml").write_text(V1)
    _validate(folder / "rewriter.yaml")
    return folder


async def test_a_pinned_version_keeps_serving_across_a_restart_until_its_retention_ends(tmp_path):
    folder = _folder(tmp_path)
    v1, v2 = parse_rubric(V1), parse_rubric(V2)
    first = await start(_config(folder))
    try:
        hash_before, totals_v1 = await _score(first.port, "rewriter")
        assert hash_before == v1.hash
        _publish(folder, V2)
        (change,) = first.servicer.rubric_folder.reload()
        assert change.action == "loaded" and change.hash == v2.hash
        before = await _versions(first.port)
        assert before[v1.hash][0] == "retained" and before[v2.hash][0] == "current"
    finally:
        await first.stop(grace=1.0)
    user_files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    second = await start(_config(folder))  # a new process would do the same: nothing is kept in memory
    try:
        assert await _score(second.port, f"rewriter@{v1.hash[:12]}") == (v1.hash, totals_v1)  # bit for bit
        assert (await _score(second.port, "rewriter"))[0] == v2.hash
        after = await _versions(second.port)
        assert after[v1.hash] == before[v1.hash]  # still retained, the retention clock not restarted
        assert after[v2.hash][2] == before[v2.hash][2]  # the current version keeps its load time
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == user_files
        wait = before[v1.hash][1] - time.time() + 0.2
        assert wait > 0, "the restart took longer than the retention time; raise RETENTION_S"
        await asyncio.sleep(wait)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _score(second.port, f"rewriter@{v1.hash[:12]}")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "was retired at" in error.value.details() and "superseded by version" in error.value.details()
    finally:
        await second.stop(grace=1.0)

    third = await start(_config(folder))  # retired stays retired, with its reason
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _score(third.port, f"rewriter@{v1.hash[:12]}")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND and "was retired at" in error.value.details()
        assert not (_state_dir(folder) / f"{v1.hash}.yaml").exists()  # a retired version's copy is not kept
    finally:
        await third.stop(grace=1.0)


async def test_a_file_changed_while_the_server_was_down_is_reconciled(tmp_path):
    """Down, the file got a version that fails validation: the persisted version keeps serving and
    the new one is refused. Then a validated one: it is current and the persisted one is retained."""
    folder = _folder(tmp_path)
    v1, v2, v3 = parse_rubric(V1), parse_rubric(V2), parse_rubric(V3)
    first = await start(_config(folder))
    await first.stop(grace=1.0)

    _publish(folder, V2, passed=False)
    second = await start(_config(folder))
    try:
        assert (await _score(second.port, "rewriter"))[0] == v1.hash
        versions = await _versions(second.port)
        assert versions[v1.hash][0] == "current" and versions[v2.hash][0] == "refused"
    finally:
        await second.stop(grace=1.0)

    _publish(folder, V3)
    third = await start(_config(folder))
    try:
        assert (await _score(third.port, "rewriter"))[0] == v3.hash
        assert (await _score(third.port, f"rewriter@{v1.hash[:12]}"))[0] == v1.hash
        versions = await _versions(third.port)
        assert versions[v3.hash][0] == "current" and versions[v1.hash][0] == "retained"
        assert versions[v1.hash][1] == pytest.approx(time.time() + RETENTION_S, abs=5.0)
    finally:
        await third.stop(grace=1.0)


async def test_an_unreadable_state_is_kept_aside_and_the_folder_served(tmp_path, caplog):
    folder = _folder(tmp_path)
    state = _state_dir(folder) / "state.json"
    state.parent.mkdir()
    state.write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="calibrl.judge_server.version_store"):
        running = await start(_config(folder))
    try:
        assert (await _score(running.port, "rewriter"))[0] == parse_rubric(V1).hash
        assert "cannot be read" in caplog.text
        kept = list(state.parent.glob("state.json.unreadable-*"))
        assert len(kept) == 1 and kept[0].read_text() == "{not json"
        assert json.loads(state.read_text())["rubrics"]["rewriter"]["current"]["hash"] == parse_rubric(V1).hash
    finally:
        await running.stop(grace=1.0)


def test_a_version_this_judge_may_no_longer_serve_is_not_restored(tmp_path, caplog):
    """Persisted under allow_unvalidated; restored by a judge without it: dropped with a warning."""
    folder = tmp_path / "rubrics"
    folder.mkdir()
    (folder / "rewriter.yaml").write_text(V1)
    lenient = Judge.from_config(JudgeConfig(embedder="hashed-ngrams", allow_unvalidated=True), folder)
    store = VersionStore(folder, _state_dir(folder))
    store.save(lenient.versions)
    strict = Judge.from_config(JudgeConfig(embedder="hashed-ngrams"), folder)
    with caplog.at_level(logging.WARNING, logger="calibrl.judge_server.version_store"):
        store.restore(strict)
    assert "this judge may not serve it" in caplog.text
    assert not strict.versions.current("rewriter").usable


async def test_by_default_nothing_is_written_and_a_restart_forgets_the_retained_versions(tmp_path):
    """rubric_state_dir's default is 'none': the server writes nowhere (its rubric folder may be
    read-only or tracked by git), and a pinned superseded version does not outlive the process."""
    folder = _folder(tmp_path)
    assert JudgeServerConfig(rubrics=str(folder)).rubric_state_dir == "none"
    v1, v2 = parse_rubric(V1), parse_rubric(V2)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    first = await start(_config(folder, state_dir="none"))
    try:
        _publish(folder, V2)
        (change,) = first.servicer.rubric_folder.reload()
        assert change.action == "loaded" and (await _score(first.port, f"rewriter@{v1.hash[:12]}"))[0] == v1.hash
    finally:
        await first.stop(grace=1.0)
    published = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert set(published) - set(before) <= {p.relative_to(tmp_path) for p in folder.iterdir()}  # what _publish wrote
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    second = await start(_config(folder, state_dir="none"))
    try:
        assert (await _score(second.port, "rewriter"))[0] == v2.hash
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _score(second.port, f"rewriter@{v1.hash[:12]}")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await second.stop(grace=1.0)
    with pytest.raises(ConfigError, match="rubric_state_dir=''"):
        JudgeServerConfig(rubrics=str(folder), rubric_state_dir="").validate()
