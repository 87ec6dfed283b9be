"""Refused requests cost no memory: a real `calibrl serve retrieval` process with API keys
and a 256 KiB receive limit answers 1,000 oversize or unauthenticated requests, and its
resident memory afterwards is within 10% of where it started (psutil)."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys

import grpc
import psutil
import pytest

from calibrl.v1 import retrieval_pb2 as pb
from calibrl.testing import build_test_index

SEARCH = "/calibrl.v1.RetrievalService/Search"
KEY = "memory-test-key"
LIMIT_MB = 0.25


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("abuse-memory")
    index = build_test_index(folder / "index")
    keys = folder / "keys.yaml"
    keys.write_text(f"tenants:\n  - name: team\n    key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "calibrl", "serve", "retrieval", "--index", str(index), "--port", "0", "device=cpu",
         "default_mode=bm25", f"serving.api_keys_file={keys}", f"serving.max_request_mb={LIMIT_MB}",
         "serving.drain_seconds=0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line
        yield process, f"127.0.0.1:{line.strip().rsplit(':', 1)[1]}"
    finally:
        process.terminate()
        process.wait(timeout=60)


async def _flood(address: str, body: bytes, metadata: list, count: int, concurrency: int = 16) -> dict[str, int]:
    """Send ``body`` ``count`` times, ``concurrency`` at a time; the status codes counted."""
    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(SEARCH)  # raw bytes: the client never parses or builds a big message

        async def one() -> None:
            try:
                await call(body, metadata=metadata, timeout=60)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] = codes.get(exc.code().name, 0) + 1

        for _ in range(count // concurrency):
            await asyncio.gather(*(one() for _ in range(concurrency)))
    return codes


@pytest.mark.slow
async def test_rss_stays_flat_after_1000_refused_requests(served):
    process, address = served
    rss = psutil.Process(process.pid).memory_info
    small = pb.SearchRequest(queries=["Mozart"], top_k=1).SerializeToString()
    assert await _flood(address, small, [("x-api-key", KEY)], 32) == {"OK": 32}  # warm: every path loaded once
    start = rss().rss

    # twice the receive limit: the transport refuses it before it becomes a Python object
    oversize = pb.SearchRequest(queries=["x" * int(2 * LIMIT_MB * 2**20)], top_k=1).SerializeToString()
    assert await _flood(address, oversize, [("x-api-key", KEY)], 496) == {"RESOURCE_EXHAUSTED": 496}
    # just under the limit, no key: refused from the metadata before the body is read
    unauthenticated = pb.SearchRequest(queries=["y" * int(0.9 * LIMIT_MB * 2**20)], top_k=1).SerializeToString()
    assert await _flood(address, unauthenticated, [], 496) == {"UNAUTHENTICATED": 496}
    assert await _flood(address, unauthenticated, [("x-api-key", "wrong")], 16) == {"UNAUTHENTICATED": 16}

    end = rss().rss
    assert end <= 1.10 * start, f"RSS grew from {start / 2**20:.0f} MiB to {end / 2**20:.0f} MiB"
    # and the server still serves
    assert await _flood(address, small, [("x-api-key", KEY)], 16) == {"OK": 16}


async def test_oversize_refusal_names_the_limit(served):
    _, address = served
    oversize = pb.SearchRequest(queries=["x" * int(2 * LIMIT_MB * 2**20)], top_k=1).SerializeToString()
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(SEARCH)(oversize, metadata=[("x-api-key", KEY)], timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {int(LIMIT_MB * 2**20)}" in refused.value.details()  # grpc: "larger than max (N vs. LIMIT)"
