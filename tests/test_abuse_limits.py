"""Limits bound the work of a request, not only its parts: the requests that kept a
server busy for a minute, or that it accepted with megabytes in one field, are refused
with the field and the limit, and both servers keep serving."""

from __future__ import annotations

import grpc
import pytest

from calibrl.v1 import judge_pb2 as jpb
from calibrl.v1 import judge_pb2_grpc
from calibrl.v1 import retrieval_pb2 as pb
from calibrl.v1 import retrieval_pb2_grpc as pb_grpc
from calibrl.judge_server.server import start as start_judge
from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import build_test_index, start_test_server
from tests.test_judge_server import make_rubrics, server_config


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("abuse-limits") / "index")


@pytest.fixture(scope="module")
def retriever(tiny_index):
    return Retriever.load(tiny_index, device="cpu")


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


async def test_retrieval_refuses_requests_whose_work_is_unbounded(tiny_index, retriever):
    running = await start_test_server(tiny_index, retriever=retriever)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.RetrievalServiceStub(channel)
            # the request: 256 items x 1,024 one-word answers, inside every per-item limit
            flood = [pb.ScoreItem(query=f"q{i}", gold_answers=[f"w{j}" for j in range(1024)]) for i in range(256)]
            error = await _refused(stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=flood, top_k=100), timeout=60))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "262144 answers" in error.details() and "max_answers_per_request=2048" in error.details()

            many_ids = [pb.ScoreItem(query=f"q{i}", seen_doc_ids=[f"d{j}" for j in range(1000)]) for i in range(17)]
            error = await _refused(stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=many_ids, top_k=5), timeout=60))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_ids_per_request=16384" in error.details()

            huge_id = [pb.ScoreItem(query="Mozart", gold_doc_ids=["m" * 1_000_000])]
            error = await _refused(stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=huge_id, top_k=5), timeout=60))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == "items[0].gold_doc_ids[0]: 1000000 characters, limit max_id_chars=256"

            long_answer = [pb.ScoreItem(query="Mozart", gold_answers=["a " * 300])]
            error = await _refused(stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=long_answer, top_k=5),
                                                       timeout=60))
            assert "items[0].gold_answers[0]: 600 characters, limit max_answer_chars=512" == error.details()

            # 5 MB in one request: the transport's 4 MiB limit (serving.max_request_mb) refuses it unparsed
            error = await _refused(stub.ScoreRetrieval(pb.ScoreRetrievalRequest(
                items=[pb.ScoreItem(query="Mozart", gold_doc_ids=["g" * 5_000_000])], top_k=5), timeout=60))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"vs. {4 * 2**20}" in error.details()

            # the limits are announced; a request at them is refused for its estimated cost (the
            # budget, 1 s of server time), with the number of leading items that fit
            info = await stub.GetIndexInfo(pb.GetIndexInfoRequest(), timeout=30)
            assert (info.max_answers_per_request, info.max_ids_per_request, info.max_id_chars,
                    info.max_answer_chars, info.max_request_bytes) == (2048, 16384, 256, 512, 4 * 2**20)
            assert info.max_request_cost_s == 1.0
            at_limit = [pb.ScoreItem(query=f"Mozart {i}", gold_answers=[f"w{j}" for j in range(8)] + ["Salzburg"],
                                     gold_doc_ids=["mozart"]) for i in range(227)]
            error = await _refused(stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=at_limit, top_k=100),
                                                       timeout=120))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details().startswith("items: estimated cost ")
            assert "limit max_request_cost_s=1 s" in error.details()
            fits = int(dict(error.trailing_metadata())["calibrl-max-items"])
            assert 1 <= fits < 227 and f"the first {fits} item(s) fit" in error.details()
            reply = await stub.ScoreRetrieval(pb.ScoreRetrievalRequest(items=at_limit[:fits], top_k=100),
                                              timeout=120)
            assert len(reply.scores) == fits and reply.scores[0].hit
    finally:
        await running.stop(grace=1.0)


async def test_judge_refuses_oversized_context_ids_and_requests(tmp_path):
    running = await start_judge(server_config(make_rubrics(tmp_path / "rubrics")))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)

            def score(**fields):
                item = jpb.JudgeItem(query="VTSAX expense ratio", output="VTSAX expense ratio 2024", **fields)
                return stub.Score(jpb.ScoreRequest(rubric_id="rewriter", items=[item]), timeout=60)

            # a 10 MB context map: above the transport's 4 MiB, refused before it is parsed
            error = await _refused(score(context={f"k{i}": "v" * 100_000 for i in range(100)}))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"vs. {4 * 2**20}" in error.details()
            # under the transport limit, the judge's own limits name the field
            error = await _refused(score(context={"notes": "v" * 1_000_000}))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == ("items[0].context: 1000005 characters (keys and values), limit "
                                       "max_context_chars=8000")
            error = await _refused(score(context={f"k{i}": "v" for i in range(40)}))
            assert "items[0].context: 40 entries, limit max_context_entries=32" == error.details()
            error = await _refused(score(retrieved_doc_ids=["g" * 3_000_000]))
            assert error.details() == "items[0].retrieved_doc_ids[0]: 3000000 characters, limit max_id_chars=256"
            # every item within its own limits, the request above max_request_chars
            items = [jpb.JudgeItem(query="VTSAX expense ratio", output=f"VTSAX {i} " + "x" * 7900)
                     for i in range(256)]
            error = await _refused(stub.Score(jpb.ScoreRequest(rubric_id="rewriter", items=items), timeout=60))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit max_request_chars=2000000" in error.details()
            # and it keeps serving
            reply = await score(context={"domain": "funds"}, retrieved_doc_ids=["doc-1"])
            assert 0.0 <= reply.scores[0].total <= 1.0
    finally:
        await running.stop(0)
