from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SearchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEARCH_MODE_UNSPECIFIED: _ClassVar[SearchMode]
    SEARCH_MODE_DENSE: _ClassVar[SearchMode]
    SEARCH_MODE_BM25: _ClassVar[SearchMode]
    SEARCH_MODE_HYBRID: _ClassVar[SearchMode]
SEARCH_MODE_UNSPECIFIED: SearchMode
SEARCH_MODE_DENSE: SearchMode
SEARCH_MODE_BM25: SearchMode
SEARCH_MODE_HYBRID: SearchMode

class SearchRequest(_message.Message):
    __slots__ = ("queries", "top_k", "mode", "include_text")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    mode: SearchMode
    include_text: bool
    def __init__(self, queries: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ..., mode: _Optional[_Union[SearchMode, str]] = ..., include_text: _Optional[bool] = ...) -> None: ...

class Hit(_message.Message):
    __slots__ = ("doc_id", "title", "score", "rank", "text")
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    doc_id: str
    title: str
    score: float
    rank: int
    text: str
    def __init__(self, doc_id: _Optional[str] = ..., title: _Optional[str] = ..., score: _Optional[float] = ..., rank: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class HitList(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    def __init__(self, hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[HitList]
    def __init__(self, results: _Optional[_Iterable[_Union[HitList, _Mapping]]] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("query", "gold_doc_ids", "gold_answers", "seen_doc_ids")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    GOLD_DOC_IDS_FIELD_NUMBER: _ClassVar[int]
    GOLD_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    SEEN_DOC_IDS_FIELD_NUMBER: _ClassVar[int]
    query: str
    gold_doc_ids: _containers.RepeatedScalarFieldContainer[str]
    gold_answers: _containers.RepeatedScalarFieldContainer[str]
    seen_doc_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, query: _Optional[str] = ..., gold_doc_ids: _Optional[_Iterable[str]] = ..., gold_answers: _Optional[_Iterable[str]] = ..., seen_doc_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ScoreRetrievalRequest(_message.Message):
    __slots__ = ("items", "top_k", "mode", "include_text")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    top_k: int
    mode: SearchMode
    include_text: bool
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., top_k: _Optional[int] = ..., mode: _Optional[_Union[SearchMode, str]] = ..., include_text: _Optional[bool] = ...) -> None: ...

class RetrievalScore(_message.Message):
    __slots__ = ("hits", "hit", "all_gold", "recall", "mrr", "ndcg", "first_gold_rank", "is_new", "contains_answer", "is_gold")
    HITS_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    ALL_GOLD_FIELD_NUMBER: _ClassVar[int]
    RECALL_FIELD_NUMBER: _ClassVar[int]
    MRR_FIELD_NUMBER: _ClassVar[int]
    NDCG_FIELD_NUMBER: _ClassVar[int]
    FIRST_GOLD_RANK_FIELD_NUMBER: _ClassVar[int]
    IS_NEW_FIELD_NUMBER: _ClassVar[int]
    CONTAINS_ANSWER_FIELD_NUMBER: _ClassVar[int]
    IS_GOLD_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    hit: bool
    all_gold: bool
    recall: float
    mrr: float
    ndcg: float
    first_gold_rank: int
    is_new: _containers.RepeatedScalarFieldContainer[bool]
    contains_answer: _containers.RepeatedScalarFieldContainer[bool]
    is_gold: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ..., hit: _Optional[bool] = ..., all_gold: _Optional[bool] = ..., recall: _Optional[float] = ..., mrr: _Optional[float] = ..., ndcg: _Optional[float] = ..., first_gold_rank: _Optional[int] = ..., is_new: _Optional[_Iterable[bool]] = ..., contains_answer: _Optional[_Iterable[bool]] = ..., is_gold: _Optional[_Iterable[bool]] = ...) -> None: ...

class ScoreRetrievalResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[RetrievalScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[RetrievalScore, _Mapping]]] = ...) -> None: ...

class GetIndexInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IndexInfo(_message.Message):
    __slots__ = ("doc_count", "embedder", "dimension", "dense_index_type", "corpus_sha256", "library_versions", "modes", "default_mode", "max_top_k", "max_batch_size", "max_query_chars", "max_ids_per_item", "max_ids_per_request", "max_answers_per_request", "max_id_chars", "max_answer_chars", "max_request_bytes", "max_request_cost_s")
    class LibraryVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DOC_COUNT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDER_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_INDEX_TYPE_FIELD_NUMBER: _ClassVar[int]
    CORPUS_SHA256_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERY_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_PER_ITEM_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_ANSWERS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_ANSWER_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_COST_S_FIELD_NUMBER: _ClassVar[int]
    doc_count: int
    embedder: str
    dimension: int
    dense_index_type: str
    corpus_sha256: str
    library_versions: _containers.ScalarMap[str, str]
    modes: _containers.RepeatedScalarFieldContainer[SearchMode]
    default_mode: SearchMode
    max_top_k: int
    max_batch_size: int
    max_query_chars: int
    max_ids_per_item: int
    max_ids_per_request: int
    max_answers_per_request: int
    max_id_chars: int
    max_answer_chars: int
    max_request_bytes: int
    max_request_cost_s: float
    def __init__(self, doc_count: _Optional[int] = ..., embedder: _Optional[str] = ..., dimension: _Optional[int] = ..., dense_index_type: _Optional[str] = ..., corpus_sha256: _Optional[str] = ..., library_versions: _Optional[_Mapping[str, str]] = ..., modes: _Optional[_Iterable[_Union[SearchMode, str]]] = ..., default_mode: _Optional[_Union[SearchMode, str]] = ..., max_top_k: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_query_chars: _Optional[int] = ..., max_ids_per_item: _Optional[int] = ..., max_ids_per_request: _Optional[int] = ..., max_answers_per_request: _Optional[int] = ..., max_id_chars: _Optional[int] = ..., max_answer_chars: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_request_cost_s: _Optional[float] = ...) -> None: ...
