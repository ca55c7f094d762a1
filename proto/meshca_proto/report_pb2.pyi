from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentReportRequest(_message.Message):
    __slots__ = ("agent_id", "trust_bundle_sha256", "leaf_authorities", "jwt_kids")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TRUST_BUNDLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    LEAF_AUTHORITIES_FIELD_NUMBER: _ClassVar[int]
    JWT_KIDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    trust_bundle_sha256: str
    leaf_authorities: _containers.RepeatedScalarFieldContainer[str]
    jwt_kids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_id: _Optional[str] = ..., trust_bundle_sha256: _Optional[str] = ..., leaf_authorities: _Optional[_Iterable[str]] = ..., jwt_kids: _Optional[_Iterable[str]] = ...) -> None: ...

class TaintedAuthority(_message.Message):
    __slots__ = ("id", "seconds_since_taint")
    ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_TAINT_FIELD_NUMBER: _ClassVar[int]
    id: str
    seconds_since_taint: float
    def __init__(self, id: _Optional[str] = ..., seconds_since_taint: _Optional[float] = ...) -> None: ...

class AgentReportResponse(_message.Message):
    __slots__ = ("tainted",)
    TAINTED_FIELD_NUMBER: _ClassVar[int]
    tainted: _containers.RepeatedCompositeFieldContainer[TaintedAuthority]
    def __init__(self, tainted: _Optional[_Iterable[_Union[TaintedAuthority, _Mapping]]] = ...) -> None: ...
