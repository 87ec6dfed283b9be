"""The encoders' text -> vector caches on the servers' Prometheus pages: a real retrieval
server and a real judge (MiniLM intent rubric) on loopback, the page scraped over HTTP."""

from __future__ import annotations

import grpc
import pytest

from calibrl import telemetry
from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
from calibrl.judge_server.server import start as start_judge
from calibrl.telemetry import TelemetryConfig
from calibrl.testing import build_test_index, start_test_server
from calibrl.v1 import judge_pb2 as jpb
from calibrl.v1 import judge_pb2_grpc
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc

pytest.importorskip("opentelemetry.exporter.prometheus", reason="the prometheus extra: pip install 'calibrl[prometheus]'")
from tests.test_prometheus import _free_port, _scrape  # noqa: E402

LOOKUPS = "calibrl_embedding_cache_lookups_total"


def _lookups(samples, result: str) -> dict[str, float]:
    return {dict(labels)["cache"]: value for (name, labels), value in samples.items()
            if name == LOOKUPS and dict(labels).get("result") == result}


async def test_the_retrieval_server_exports_its_query_cache_hits_and_misses(tmp_path):
    index = build_test_index(tmp_path / "index")
    port = _free_port()
    running = await start_test_server(index, "serving.telemetry.enabled=true",
                                      f"serving.telemetry.prometheus_port={port}")
    try:
        before_hits, before_misses = _lookups(_scrape(port), "hit"), _lookups(_scrape(port), "miss")
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.RetrievalServiceStub(channel)
            for query in ("a new query about Mozart", "a new query about Mozart", "another about the Nile"):
                await stub.Search(pb.SearchRequest(queries=[query], top_k=1, mode=pb.SEARCH_MODE_DENSE), timeout=30)
        samples = _scrape(port)
        hits, misses = _lookups(samples, "hit"), _lookups(samples, "miss")
        (cache,) = [name for name in misses if misses[name] - before_misses.get(name, 0) > 0]
        assert misses[cache] - before_misses.get(cache, 0) == 2  # two new texts
        assert hits[cache] - before_hits.get(cache, 0) == 1  # the repeat
        entries = {dict(labels)["cache"]: value for (name, labels), value in samples.items()
                   if name == "calibrl_embedding_cache_entries"}
        assert entries[cache] >= 2
    finally:
        await running.stop(grace=0)
        telemetry.shutdown()  # the next server in this process configures its own


async def test_the_judge_exports_its_embedder_cache_hits_and_misses(tmp_path):
    rubrics = tmp_path / "rubrics"
    rubrics.mkdir()
    (rubrics / "intent.yaml").write_text(
        "id: intent\nversion: '1'\ncriteria:\n"
        "  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 1.0}\n")
    port = _free_port()
    config = JudgeServerConfig(rubrics=str(rubrics), judge=JudgeConfig(embedder="minilm", allow_unvalidated=True,
                                                                       cache_size=0))
    config.serving.port = 0
    config.serving.telemetry = TelemetryConfig(enabled=True, prometheus_port=port)
    running = await start_judge(config)
    try:
        before = _lookups(_scrape(port), "hit")
        before_misses = _lookups(_scrape(port), "miss")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            # one task query, two outputs: the query is embedded once, then found in the cache
            for output in ("VTSAX costs 0.04% a year", "The fee of VTSAX is 0.04%"):
                await stub.Score(jpb.ScoreRequest(rubric_id="intent", items=[jpb.JudgeItem(
                    query="What is the expense ratio of VTSAX?", output=output)]), timeout=60)
        samples = _scrape(port)
        hits, misses = _lookups(samples, "hit"), _lookups(samples, "miss")
        grown = {name: misses[name] - before_misses.get(name, 0) for name in misses}
        (cache,) = [name for name, count in grown.items() if count > 0]
        assert "minilm" in cache
        assert grown[cache] == 3  # the query and two outputs
        assert hits[cache] - before.get(cache, 0) == 1  # the query again
    finally:
        await running.stop(grace=0)
        telemetry.shutdown()  # the next server in this process configures its own
