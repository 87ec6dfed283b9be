"""Fuzzing both services over gRPC with hypothesis.

Real servers on loopback (a MiniLM/FAISS/BM25 index of the twelve test passages;
a programmatic judge with every scorer in its rubric) receive generated protobuf
messages: empty, huge, unicode and control-character strings, negative and huge
``top_k``, enum values the contract does not define, batches over the limits.

The oracle is the documented contract (the comments at the top of the .proto
files), not the implementation: a request that breaks no rule must answer OK with
a well-formed reply; a request that breaks rules must answer one of the codes of
the rules it breaks (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND,
FAILED_PRECONDITION), never INTERNAL or UNKNOWN. After each run a normal request
still succeeds. The servers run with small limits so that hypothesis reaches
every limit with small inputs, and every run stays bounded (``max_examples``).
"""

from __future__ import annotations

import math
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from calibrl.v1 import judge_pb2 as jpb
from calibrl.v1 import judge_pb2_grpc as jpb_grpc
from calibrl.v1 import retrieval_pb2 as rpb
from calibrl.v1 import retrieval_pb2_grpc as rpb_grpc

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

# Server limits of this module (small, so that generated inputs cross them often).
MAX_TOP_K = 20
MAX_QUERIES = 6
MAX_QUERY_CHARS = 200
MAX_IDS = 5
JUDGE_MAX_ITEMS = 6
JUDGE_MAX_TEXT = 300
JUDGE_MAX_RETRIEVED = 4

FUZZ_RUBRIC = "fuzz-rubric"
LLM_RUBRIC = "needs-an-llm"  # has an LLM criterion: a programmatic judge must refuse it
RUBRICS = {
    f"{FUZZ_RUBRIC}.yaml": f"""\
id: {FUZZ_RUBRIC}
version: "1"
description: Every programmatic scorer, two of them as penalties.
glossary: [Mozart, Magic Flute, penicillin]
criteria:
  - {{name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.3}}
  - {{name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.3}}
  - {{name: specific, kind: programmatic, scorer: specificity, weight: 0.2}}
  - {{name: length, kind: programmatic, scorer: length, weight: 0.1}}
  - {{name: shape, kind: programmatic, scorer: format, weight: 0.1}}
  - {{name: invented, kind: programmatic, scorer: invented_entities, weight: 0.3, penalty: true}}
  - {{name: leak, kind: programmatic, scorer: compliance_leak, weight: 1.0, penalty: true}}
""",
    f"{LLM_RUBRIC}.yaml": f"""\
id: {LLM_RUBRIC}
version: "1"
description: An LLM criterion that a programmatic judge cannot score.
criteria:
  - name: intent_llm
    kind: llm
    question: Does the rewrite keep the intent of the user's query?
    scale: yes_no
    good_answer: "yes"
    weight: 1.0
""",
}

_GOOD_ITEM = jpb.JudgeItem(query="Who composed The Magic Flute?", output="Magic Flute composer Mozart")

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


# --------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """Both servers on one background event loop; synchronous stubs for hypothesis."""

    def __init__(self, root) -> None:
        from calibrl.trainer.aio import BackgroundLoop

        from calibrl.testing import build_test_index

        self.index_dir = build_test_index(root / "index")
        self.rubric_dir = root / "rubrics"
        self.rubric_dir.mkdir()
        for name, text in RUBRICS.items():
            (self.rubric_dir / name).write_text(text)
        self.loop = BackgroundLoop(name="fuzz-servers")
        self.retrieval = self.loop.run(self._start_retrieval(), timeout=300)
        self.judge = self.loop.run(self._start_judge(), timeout=120)
        self.retrieval_channel = grpc.insecure_channel(f"127.0.0.1:{self.retrieval.port}")
        self.judge_channel = grpc.insecure_channel(f"127.0.0.1:{self.judge.port}")
        self.search_stub = rpb_grpc.RetrievalServiceStub(self.retrieval_channel)
        self.judge_stub = jpb_grpc.JudgeServiceStub(self.judge_channel)
        self.fuzz_hash = self.judge_stub.GetRubric(jpb.GetRubricRequest(rubric_id=FUZZ_RUBRIC), timeout=30).hash

    async def _start_retrieval(self):
        from calibrl.testing import start_test_server

        return await start_test_server(
            self.index_dir, f"max_top_k={MAX_TOP_K}", f"max_batch_size={MAX_QUERIES}",
            f"max_query_chars={MAX_QUERY_CHARS}", f"max_ids_per_item={MAX_IDS}", "batch_max_wait_ms=0",
        )

    async def _start_judge(self):
        from calibrl.serving import ServingConfig
        from calibrl.judge_server import server as judge_server
        from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig

        config = JudgeServerConfig(
            rubrics=str(self.rubric_dir),
            judge=JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0,
                              max_batch_size=JUDGE_MAX_ITEMS, max_text_chars=JUDGE_MAX_TEXT,
                              max_retrieved=JUDGE_MAX_RETRIEVED),
            serving=ServingConfig(port=0, grace_seconds=1.0),
            max_wait_ms=0.0,
        )
        return await judge_server.start(config)

    def close(self) -> None:
        self.retrieval_channel.close()
        self.judge_channel.close()
        self.loop.run(self.retrieval.stop(grace=1.0), timeout=30)
        self.loop.run(self.judge.stop(grace=1.0), timeout=30)
        self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("fuzz"))
    yield served
    served.close()


def _call(method, request) -> tuple[grpc.StatusCode, object, str]:
    """(status, reply or None, details); the status is a hypothesis event, so
    ``--hypothesis-show-statistics`` shows how often each code was reached."""
    try:
        code, reply, details = OK, method(request, timeout=60), ""
    except grpc.RpcError as exc:  # the sync stub raises a Call that is also an RpcError
        code, reply, details = exc.code(), None, exc.details() or ""
    if currently_in_test_context():
        event(code.name)
    return code, reply, details


def _assert_allowed(code: grpc.StatusCode, details: str, expected: set[grpc.StatusCode], request) -> None:
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (code, details, request)
    if not expected:
        assert code == OK, f"valid request answered {code.name}: {details!r}\nrequest: {request!r:.2000}"
    else:
        assert code in expected, (
            f"answered {code.name} ({details!r}); the request breaks rules answered by "
            f"{sorted(c.name for c in expected)}\nrequest: {request!r:.2000}"
        )
        # The message names the field or the limit it broke (errors.InvalidArgument, limits.py).
        assert details.strip(), "an error status without a message"


def _still_serving(served: Served) -> None:
    reply = served.search_stub.Search(rpb.SearchRequest(queries=["Who composed The Magic Flute?"], top_k=2),
                                      timeout=30)
    assert reply.results[0].hits[0].doc_id == "mozart"
    scores = served.judge_stub.Score(jpb.ScoreRequest(rubric_id=FUZZ_RUBRIC, items=[_GOOD_ITEM]), timeout=30).scores
    assert len(scores) == 1 and 0.0 <= scores[0].total <= 1.0
    for channel in (served.retrieval_channel, served.judge_channel):
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


# --------------------------------------------------------------------------- strategies
#
# Each field is drawn mostly from values the contract accepts and sometimes from
# values it rejects, so that about half the requests are valid (and their replies
# are checked) and the rest break one or a few rules at a time.

# Any code point but lone surrogates (which are not UTF-8 and cannot be put in a
# protobuf string at all): control characters, NUL, zero-width and RTL marks included.
_chars = st.characters(exclude_categories=("Cs",))
_tricky = st.sampled_from(["", " ", "\t\n\r", "\x00", "\x1c\x1d", "\u200b", "\u202e", "\ufeff", "\U0001f600" * 4,
                           "4111 1111 1111 1111", "a@b.co", "<think>", "%s%n{0}", "\\x00", "é" * 3])
_sensible = st.sampled_from(["Who composed The Magic Flute?", "penicillin 1928", "Mozart", "iron tower in Paris",
                             "highest mountain", "Rust memory safety"])
_short_text = st.one_of(_tricky, _sensible, st.text(_chars, max_size=30))


def _repeat(unit: str, n: int) -> str:
    return (unit * n)[:n]


def _long(low: int, high: int) -> st.SearchStrategy[str]:
    return st.builds(_repeat, st.text(_chars, min_size=1, max_size=4), st.integers(low, high))


def _nonblank(max_size: int) -> st.SearchStrategy[str]:
    return st.one_of(_sensible, st.text(_chars, min_size=1, max_size=max_size).filter(str.strip))


def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy, weight: int = 4) -> st.SearchStrategy:
    """``valid`` ``weight`` times out of ``weight + 1``; shrinks towards ``valid``."""
    return st.sampled_from(range(weight + 1)).flatmap(lambda n: invalid if n == weight else valid)


def _around(limit: int) -> st.SearchStrategy[str]:
    """A string just under, at or just over ``limit`` characters, or far over it."""
    return st.one_of(_long(limit - 2, limit + 2), _long(limit + 3, 3_000))


int32 = st.integers(-(2**31), 2**31 - 1)
query = _mostly(_nonblank(60), st.one_of(_tricky, _around(MAX_QUERY_CHARS)), weight=6)
top_k = _mostly(st.one_of(st.sampled_from([1, MAX_TOP_K]), st.integers(1, MAX_TOP_K)),
                st.one_of(st.sampled_from([0, -1, MAX_TOP_K + 1]), int32))
# Open proto3 enums carry any int32 on the wire; only 0..3 are defined.
mode = _mostly(st.sampled_from([0, 1, 2, 3]), st.one_of(st.integers(-5, 10), int32))
ids = _mostly(st.lists(_short_text, max_size=MAX_IDS), st.lists(_short_text, max_size=MAX_IDS + 3))
# Rubric ids and hashes are echoed in error messages, which travel in gRPC metadata
# (hard limit 16 KiB): long ones must be cut, not overflow it (test below).
name_text = st.one_of(_short_text, _long(100, 20_000))


def _batch(element: st.SearchStrategy, limit: int) -> st.SearchStrategy[list]:
    return _mostly(st.lists(element, min_size=1, max_size=limit), st.lists(element, max_size=limit + 3))


def _search_requests():
    return st.builds(rpb.SearchRequest, queries=_batch(query, MAX_QUERIES), top_k=top_k, mode=mode,
                     include_text=st.booleans())


def _score_requests():
    item = st.builds(rpb.ScoreItem, query=query, gold_doc_ids=ids, gold_answers=ids, seen_doc_ids=ids)
    return st.builds(rpb.ScoreRetrievalRequest, items=_batch(item, MAX_QUERIES), top_k=top_k, mode=mode,
                     include_text=st.booleans())


def _judge_requests():
    judge_text = _mostly(_nonblank(80), st.one_of(_tricky, _around(JUDGE_MAX_TEXT)), weight=8)
    item = st.builds(
        jpb.JudgeItem,
        query=judge_text,
        output=judge_text,
        retrieved_texts=_mostly(st.lists(judge_text, max_size=JUDGE_MAX_RETRIEVED),
                                st.lists(judge_text, max_size=JUDGE_MAX_RETRIEVED + 3)),
        retrieved_doc_ids=_mostly(st.lists(_short_text, max_size=JUDGE_MAX_RETRIEVED),
                                  st.lists(_short_text, max_size=JUDGE_MAX_RETRIEVED + 3)),
        context=st.dictionaries(_short_text, _short_text, max_size=3),
    )
    rubric_id = _mostly(st.just(FUZZ_RUBRIC), st.one_of(st.sampled_from([LLM_RUBRIC, "", "no-such-rubric"]),
                                                        name_text))
    rubric_hash = _mostly(st.sampled_from(["", "pinned"]), st.one_of(st.just("0" * 64), name_text))
    return st.tuples(rubric_id, rubric_hash, _batch(item, JUDGE_MAX_ITEMS))


# --------------------------------------------------------------------------- the contract as an oracle


def _query_rules(queries: list[str], limit_items: int, limit_chars: int) -> set[grpc.StatusCode]:
    broken = set()
    if not queries:
        broken.add(INVALID)
    if len(queries) > limit_items:
        broken.add(EXHAUSTED)
    for query in queries:
        if not query.strip():
            broken.add(INVALID)
        if len(query) > limit_chars:
            broken.add(EXHAUSTED)
    return broken


def _retrieval_rules(queries: list[str], request_top_k: int, request_mode: int) -> set[grpc.StatusCode]:
    broken = _query_rules(queries, MAX_QUERIES, MAX_QUERY_CHARS)
    if not 1 <= request_top_k <= MAX_TOP_K:
        broken.add(INVALID)
    if request_mode not in (0, 1, 2, 3):
        broken.add(INVALID)
    return broken


def _check_hits(hits, top_k_asked: int, include_text: bool) -> None:
    assert len(hits) <= top_k_asked
    assert [h.rank for h in hits] == list(range(1, len(hits) + 1))
    assert len({h.doc_id for h in hits}) == len(hits), "a passage twice in one list"
    for hit in hits:
        assert hit.doc_id and math.isfinite(hit.score)
        assert bool(hit.text) == include_text


# --------------------------------------------------------------------------- retrieval


# The limits exactly (valid) and one past them (invalid), whatever hypothesis draws.
_AT_LIMIT = "q" * MAX_QUERY_CHARS


@FUZZ
@given(request=_search_requests())
@example(request=rpb.SearchRequest(queries=[_AT_LIMIT] * MAX_QUERIES, top_k=MAX_TOP_K, mode=3))
@example(request=rpb.SearchRequest(queries=[_AT_LIMIT + "q"], top_k=1))
@example(request=rpb.SearchRequest(queries=["Mozart"] * (MAX_QUERIES + 1), top_k=1))
def test_fuzzed_search_requests_get_documented_codes(served, request):
    code, reply, details = _call(served.search_stub.Search, request)
    _assert_allowed(code, details, _retrieval_rules(list(request.queries), request.top_k, request.mode), request)
    if code == OK:
        assert len(reply.results) == len(request.queries)
        for hits in reply.results:
            if request.mode != 2:  # dense (and so hybrid) ranks every passage; BM25 may match none
                assert len(hits.hits) == min(request.top_k, 12)
            _check_hits(hits.hits, request.top_k, request.include_text)


@FUZZ
@given(request=_score_requests())
@example(request=rpb.ScoreRetrievalRequest(
    items=[rpb.ScoreItem(query=_AT_LIMIT, gold_doc_ids=["mozart"] * MAX_IDS, gold_answers=["x"] * MAX_IDS,
                         seen_doc_ids=["bach"] * MAX_IDS)], top_k=MAX_TOP_K))
@example(request=rpb.ScoreRetrievalRequest(items=[rpb.ScoreItem(query="Mozart", seen_doc_ids=["a"] * (MAX_IDS + 1))],
                                           top_k=3))
def test_fuzzed_score_retrieval_requests_get_documented_codes(served, request):
    code, reply, details = _call(served.search_stub.ScoreRetrieval, request)
    broken = _retrieval_rules([i.query for i in request.items], request.top_k, request.mode)
    for item in request.items:
        if max(len(item.gold_doc_ids), len(item.gold_answers), len(item.seen_doc_ids)) > MAX_IDS:
            broken.add(EXHAUSTED)
    _assert_allowed(code, details, broken, request)
    if code != OK:
        return
    assert len(reply.scores) == len(request.items)
    for item, score in zip(request.items, reply.scores):
        hits = score.hits
        _check_hits(hits, request.top_k, request.include_text)
        gold = set(item.gold_doc_ids)
        assert list(score.is_gold) == [h.doc_id in gold for h in hits]
        assert len(score.is_new) == len(score.contains_answer) == len(hits)
        seen = set(item.seen_doc_ids)
        assert list(score.is_new) == [h.doc_id not in seen for h in hits]
        assert score.hit == any(score.is_gold)
        assert score.first_gold_rank == (list(score.is_gold).index(True) + 1 if score.hit else 0)
        for value in (score.recall, score.mrr, score.ndcg):
            assert 0.0 <= value <= 1.0
        assert score.mrr == pytest.approx(1.0 / score.first_gold_rank if score.hit else 0.0)


def test_retrieval_still_serves_after_fuzzing(served):
    _still_serving(served)


# --------------------------------------------------------------------------- judge


def _judge_rules(served: Served, rubric_id: str, rubric_hash: str, items) -> set[grpc.StatusCode]:
    broken = set()
    if rubric_id == "":
        broken.add(INVALID)
    elif rubric_id == LLM_RUBRIC:
        broken.add(PRECONDITION)
    elif rubric_id != FUZZ_RUBRIC:
        broken.add(NOT_FOUND)
    if rubric_hash and rubric_id == FUZZ_RUBRIC and rubric_hash != served.fuzz_hash:
        broken.add(INVALID)
    if rubric_hash and rubric_id == LLM_RUBRIC:
        broken.add(INVALID)  # cannot match: "pinned" and the fuzzed hashes are not its hash
    if not items:
        broken.add(INVALID)
    if len(items) > JUDGE_MAX_ITEMS:
        broken.add(EXHAUSTED)
    for item in items:
        if not item.query.strip() or not item.output.strip():
            broken.add(INVALID)
        texts = [item.query, item.output, *item.retrieved_texts]
        if any(len(t) > JUDGE_MAX_TEXT for t in texts):
            broken.add(EXHAUSTED)
        if max(len(item.retrieved_texts), len(item.retrieved_doc_ids)) > JUDGE_MAX_RETRIEVED:
            broken.add(EXHAUSTED)
    return broken


@FUZZ
@given(fuzzed=_judge_requests())
@example(fuzzed=(LLM_RUBRIC, "", [_GOOD_ITEM]))  # FAILED_PRECONDITION: no LLM in a programmatic judge
@example(fuzzed=(FUZZ_RUBRIC, "pinned", [_GOOD_ITEM] * JUDGE_MAX_ITEMS))
@example(fuzzed=(FUZZ_RUBRIC, "", [jpb.JudgeItem(query="q" * JUDGE_MAX_TEXT, output="o" * JUDGE_MAX_TEXT,
                                                 retrieved_texts=["t" * JUDGE_MAX_TEXT] * JUDGE_MAX_RETRIEVED)]))
@example(fuzzed=(FUZZ_RUBRIC, "", [jpb.JudgeItem(query="q", output="o" * (JUDGE_MAX_TEXT + 1))]))
@example(fuzzed=(FUZZ_RUBRIC, "", [_GOOD_ITEM] * (JUDGE_MAX_ITEMS + 1)))
def test_fuzzed_judge_score_requests_get_documented_codes(served, fuzzed):
    rubric_id, rubric_hash, items = fuzzed
    if rubric_hash == "pinned":  # pin the served rubric's real hash
        rubric_hash = served.fuzz_hash
    request = jpb.ScoreRequest(rubric_id=rubric_id, rubric_hash=rubric_hash, items=items)
    code, reply, details = _call(served.judge_stub.Score, request)
    _assert_allowed(code, details, _judge_rules(served, rubric_id, rubric_hash, items), request)
    if code != OK:
        return
    assert reply.rubric_id == FUZZ_RUBRIC and reply.rubric_hash == served.fuzz_hash
    assert len(reply.scores) == len(items)
    for score in reply.scores:
        assert [c.name for c in score.criteria] == ["entities", "intent", "specific", "length", "shape",
                                                    "invented", "leak"]
        assert all(0.0 <= c.score <= 1.0 for c in score.criteria)
        assert 0.0 <= score.total <= 1.0


@FUZZ
@given(rubric_id=_mostly(st.sampled_from([FUZZ_RUBRIC, LLM_RUBRIC]), st.one_of(st.just(""), name_text), weight=1))
def test_fuzzed_get_rubric_requests_get_documented_codes(served, rubric_id):
    code, reply, details = _call(served.judge_stub.GetRubric, jpb.GetRubricRequest(rubric_id=rubric_id))
    expected = set() if rubric_id in (FUZZ_RUBRIC, LLM_RUBRIC) else {INVALID if rubric_id == "" else NOT_FOUND}
    _assert_allowed(code, details, expected, rubric_id)
    if code == OK:
        assert reply.id == rubric_id and len(reply.hash) == 64


def test_judge_still_serves_after_fuzzing(served):
    _still_serving(served)


@pytest.mark.parametrize("field", ["rubric_id", "rubric_hash"])
def test_a_huge_rubric_id_or_hash_gets_its_documented_code(served, field):
    """An echoed 20,000-character id once made the message outgrow gRPC's metadata
    limit: the caller got RESOURCE_EXHAUSTED 'Stream removed' instead."""
    huge = "\U0001f600" * 20_000  # 80 kB of UTF-8, 240 kB percent-encoded
    if field == "rubric_id":
        request, expected = jpb.ScoreRequest(rubric_id=huge, items=[_GOOD_ITEM]), {NOT_FOUND, INVALID}
    else:
        request, expected = jpb.ScoreRequest(rubric_id=FUZZ_RUBRIC, rubric_hash=huge, items=[_GOOD_ITEM]), {INVALID}
    code, _, details = _call(served.judge_stub.Score, request)
    assert code in expected, (code, details[:200])


# --------------------------------------------------------------------------- bytes that are not a message


def _raw_method(channel, path: str):
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(payload=st.binary(max_size=64))
def test_arbitrary_bytes_never_break_the_servers(served, payload):
    """Random bytes that happen to parse are requests like any other; the rest must
    fail the call alone. Either way the servers keep serving (checked after)."""
    for channel, path, message_cls in (
        (served.retrieval_channel, "/calibrl.v1.RetrievalService/Search", rpb.SearchRequest),
        (served.judge_channel, "/calibrl.v1.JudgeService/Score", jpb.ScoreRequest),
    ):
        try:
            message_cls.FromString(payload)
            parses = True
        except Exception:  # noqa: BLE001 - DecodeError and friends
            parses = False
        code, _, details = _call(_raw_method(channel, path), payload)
        if parses:
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (payload, code, details)
        else:
            assert code != OK, (payload, details)


def test_corrupt_wire_bytes_are_invalid_argument(served):
    code, _, details = _call(_raw_method(served.judge_channel, "/calibrl.v1.JudgeService/Score"), b"\xff\xff\xff")
    assert code == INVALID, (code, details)


def test_servers_still_serve_after_raw_bytes(served):
    _still_serving(served)
