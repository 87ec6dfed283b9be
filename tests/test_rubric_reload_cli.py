"""`calibrl rubric reload` against a real judge server with API keys on loopback: it prints what the
reread loaded, refused and retired, exits 1 on a refusal, and says clearly why when the server
cannot be reached, the key is wrong or missing, or the tenant may not reload."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from calibrl.cli import main as calibrl
from calibrl.judge_server.rubric import parse_rubric
from tests.test_rubric_versions import KEYS, V1, V2, V3, _publish, start_judge


async def _server(tmp_path, retention_s=600.0):
    return await start_judge(tmp_path, retention_s, poll_s=0)


async def _run(capsys, *argv):
    code = await asyncio.to_thread(calibrl, ["rubric", "reload", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_reload_prints_what_was_loaded_refused_and_retired(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CALIBRL_API_KEY", raising=False)
    folder, running = await _server(tmp_path, retention_s=1.0)
    target = f"127.0.0.1:{running.port}"
    v1, v2, v3 = parse_rubric(V1), parse_rubric(V2), parse_rubric(V3)
    try:
        code, out, _ = await _run(capsys, "--target", target, "--api-key", KEYS["ops"])
        assert code == 0 and out.strip() == f"{target}: no change (the folder holds the served versions)"

        _publish(folder, V2)
        code, out, _ = await _run(capsys, "--target", target, "--api-key", KEYS["ops"])
        lines = out.strip().splitlines()
        assert code == 0 and lines[-1] == f"{target}: 1 loaded"
        assert lines[0].startswith(f"loaded   rewriter {v2.hash[:12]} (version 2): current version (replacing "
                                   f"{v1.hash[:12]})")
        assert running.servicer.judge.resolve("rewriter").hash == v2.hash

        _publish(folder, V3, passed=False)  # its validation failed: refused, exit 1
        await asyncio.sleep(1.2)  # and version 1's retention (1 s) has ended
        code, out, _ = await _run(capsys, "--target", target, "--json")
        assert code == 2 and out == ""  # no key: refused by the server, nothing reread
        code, out, _ = await _run(capsys, "--target", target, "--json", "--api-key", KEYS["ops"])
        changes = json.loads(out)
        assert code == 1
        assert sorted((c["action"], c["hash"]) for c in changes) == [("refused", v3.hash), ("retired", v1.hash)]
        refused = next(c for c in changes if c["action"] == "refused")
        assert "kappa 0.200 < min_kappa 0.6" in refused["reason"]
        assert running.servicer.judge.resolve("rewriter").hash == v2.hash  # the current version kept serving
    finally:
        await running.stop(grace=1.0)


async def test_reload_says_why_the_call_failed(tmp_path, capsys, monkeypatch):
    folder, running = await _server(tmp_path)
    target = f"127.0.0.1:{running.port}"
    monkeypatch.delenv("CALIBRL_API_KEY", raising=False)
    try:
        code, _, err = await _run(capsys, "--target", target, "--api-key", "not-a-key")
        assert code == 2 and "UNAUTHENTICATED" in err and "rubric_admin_tenants" in err
        code, _, err = await _run(capsys, "--target", target)
        assert code == 2 and "UNAUTHENTICATED" in err and "the server requires an API key" in err
        code, _, err = await _run(capsys, "--target", target, "--api-key", KEYS["team-a"])
        assert code == 2 and "PERMISSION_DENIED" in err and "'team-a' is not in rubric_admin_tenants" in err
        monkeypatch.setenv("CALIBRL_API_KEY", KEYS["ops"])
        code, out, _ = await _run(capsys, "--target", target)
        assert code == 0 and "no change" in out
    finally:
        await running.stop(grace=1.0)

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    code, _, err = await _run(capsys, "--target", f"127.0.0.1:{free}", "--api-key", KEYS["ops"], "--timeout", "5")
    assert code == 2 and "UNAVAILABLE" in err and "is the judge server running there?" in err


def test_reload_checks_its_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        calibrl(["rubric", "reload", "--tls-cert", "c.pem"])
    assert exit_.value.code == 2 and "--tls-cert and --tls-key go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrl(["rubric", "reload", "--timeout", "0"])
    assert "--timeout 0.0: must be > 0 seconds" in capsys.readouterr().err
    code = calibrl(["rubric", "reload", "--tls-ca", "/nonexistent/ca.pem"])
    assert code == 2 and "cannot read /nonexistent/ca.pem" in capsys.readouterr().err
