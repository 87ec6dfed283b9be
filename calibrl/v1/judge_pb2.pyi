from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JudgeItem(_message.Message):
    __slots__ = ("query", "output", "retrieved_texts", "retrieved_doc_ids", "context")
    class ContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUERY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RETRIEVED_TEXTS_FIELD_NUMBER: _ClassVar[int]
    RETRIEVED_DOC_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    query: str
    output: str
    retrieved_texts: _containers.RepeatedScalarFieldContainer[str]
    retrieved_doc_ids: _containers.RepeatedScalarFieldContainer[str]
    context: _containers.ScalarMap[str, str]
    def __init__(self, query: _Optional[str] = ..., output: _Optional[str] = ..., retrieved_texts: _Optional[_Iterable[str]] = ..., retrieved_doc_ids: _Optional[_Iterable[str]] = ..., context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("rubric_id", "rubric_hash", "items")
    RUBRIC_ID_FIELD_NUMBER: _ClassVar[int]
    RUBRIC_HASH_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    rubric_id: str
    rubric_hash: str
    items: _containers.RepeatedCompositeFieldContainer[JudgeItem]
    def __init__(self, rubric_id: _Optional[str] = ..., rubric_hash: _Optional[str] = ..., items: _Optional[_Iterable[_Union[JudgeItem, _Mapping]]] = ...) -> None: ...

class CriterionScore(_message.Message):
    __slots__ = ("name", "score", "weight", "penalty")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PENALTY_FIELD_NUMBER: _ClassVar[int]
    name: str
    score: float
    weight: float
    penalty: bool
    def __init__(self, name: _Optional[str] = ..., score: _Optional[float] = ..., weight: _Optional[float] = ..., penalty: _Optional[bool] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("criteria", "total", "cached")
    CRITERIA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    criteria: _containers.RepeatedCompositeFieldContainer[CriterionScore]
    total: float
    cached: bool
    def __init__(self, criteria: _Optional[_Iterable[_Union[CriterionScore, _Mapping]]] = ..., total: _Optional[float] = ..., cached: _Optional[bool] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "rubric_id", "rubric_hash", "model_id", "rubric_version")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    RUBRIC_ID_FIELD_NUMBER: _ClassVar[int]
    RUBRIC_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    RUBRIC_VERSION_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScore]
    rubric_id: str
    rubric_hash: str
    model_id: str
    rubric_version: str
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ..., rubric_id: _Optional[str] = ..., rubric_hash: _Optional[str] = ..., model_id: _Optional[str] = ..., rubric_version: _Optional[str] = ...) -> None: ...

class ListRubricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RubricSummary(_message.Message):
    __slots__ = ("id", "version", "hash", "description", "num_criteria", "validated", "versions")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    NUM_CRITERIA_FIELD_NUMBER: _ClassVar[int]
    VALIDATED_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    version: str
    hash: str
    description: str
    num_criteria: int
    validated: bool
    versions: _containers.RepeatedCompositeFieldContainer[RubricVersion]
    def __init__(self, id: _Optional[str] = ..., version: _Optional[str] = ..., hash: _Optional[str] = ..., description: _Optional[str] = ..., num_criteria: _Optional[int] = ..., validated: _Optional[bool] = ..., versions: _Optional[_Iterable[_Union[RubricVersion, _Mapping]]] = ...) -> None: ...

class RubricVersion(_message.Message):
    __slots__ = ("hash", "version", "state", "validated", "loaded_at", "retires_at", "reason")
    HASH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VALIDATED_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    RETIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    hash: str
    version: str
    state: str
    validated: bool
    loaded_at: float
    retires_at: float
    reason: str
    def __init__(self, hash: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[str] = ..., validated: _Optional[bool] = ..., loaded_at: _Optional[float] = ..., retires_at: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class ReloadRubricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RubricVersionChange(_message.Message):
    __slots__ = ("rubric_id", "hash", "version", "action", "reason", "source")
    RUBRIC_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    rubric_id: str
    hash: str
    version: str
    action: str
    reason: str
    source: str
    def __init__(self, rubric_id: _Optional[str] = ..., hash: _Optional[str] = ..., version: _Optional[str] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class ReloadRubricsResponse(_message.Message):
    __slots__ = ("changes",)
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[RubricVersionChange]
    def __init__(self, changes: _Optional[_Iterable[_Union[RubricVersionChange, _Mapping]]] = ...) -> None: ...

class ListRubricsResponse(_message.Message):
    __slots__ = ("rubrics",)
    RUBRICS_FIELD_NUMBER: _ClassVar[int]
    rubrics: _containers.RepeatedCompositeFieldContainer[RubricSummary]
    def __init__(self, rubrics: _Optional[_Iterable[_Union[RubricSummary, _Mapping]]] = ...) -> None: ...

class GetRubricRequest(_message.Message):
    __slots__ = ("rubric_id",)
    RUBRIC_ID_FIELD_NUMBER: _ClassVar[int]
    rubric_id: str
    def __init__(self, rubric_id: _Optional[str] = ...) -> None: ...

class Criterion(_message.Message):
    __slots__ = ("name", "kind", "question", "scorer", "params_json", "weight", "severity", "penalty")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    question: str
    scorer: str
    params_json: str
    weight: float
    severity: float
    penalty: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., question: _Optional[str] = ..., scorer: _Optional[str] = ..., params_json: _Optional[str] = ..., weight: _Optional[float] = ..., severity: _Optional[float] = ..., penalty: _Optional[bool] = ...) -> None: ...

class Validation(_message.Message):
    __slots__ = ("passed", "kappa", "model_id", "threshold", "min_kappa", "pass_threshold", "pass_threshold_source", "reason")
    PASSED_FIELD_NUMBER: _ClassVar[int]
    KAPPA_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_KAPPA_FIELD_NUMBER: _ClassVar[int]
    PASS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    PASS_THRESHOLD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    passed: bool
    kappa: float
    model_id: str
    threshold: float
    min_kappa: float
    pass_threshold: float
    pass_threshold_source: str
    reason: str
    def __init__(self, passed: _Optional[bool] = ..., kappa: _Optional[float] = ..., model_id: _Optional[str] = ..., threshold: _Optional[float] = ..., min_kappa: _Optional[float] = ..., pass_threshold: _Optional[float] = ..., pass_threshold_source: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Rubric(_message.Message):
    __slots__ = ("id", "version", "hash", "description", "criteria", "source_yaml", "validation", "max_request_cost_s", "versions")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CRITERIA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_YAML_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_COST_S_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    version: str
    hash: str
    description: str
    criteria: _containers.RepeatedCompositeFieldContainer[Criterion]
    source_yaml: str
    validation: Validation
    max_request_cost_s: float
    versions: _containers.RepeatedCompositeFieldContainer[RubricVersion]
    def __init__(self, id: _Optional[str] = ..., version: _Optional[str] = ..., hash: _Optional[str] = ..., description: _Optional[str] = ..., criteria: _Optional[_Iterable[_Union[Criterion, _Mapping]]] = ..., source_yaml: _Optional[str] = ..., validation: _Optional[_Union[Validation, _Mapping]] = ..., max_request_cost_s: _Optional[float] = ..., versions: _Optional[_Iterable[_Union[RubricVersion, _Mapping]]] = ...) -> None: ...
