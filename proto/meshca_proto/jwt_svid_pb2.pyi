from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class MintJwtSvidRequest(_message.Message):
    __slots__ = ("audience", "impersonated_identity")
    AUDIENCE_FIELD_NUMBER: _ClassVar[int]
    IMPERSONATED_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    audience: _containers.RepeatedScalarFieldContainer[str]
    impersonated_identity: str
    def __init__(self, audience: _Optional[_Iterable[str]] = ..., impersonated_identity: _Optional[str] = ...) -> None: ...

class MintJwtSvidResponse(_message.Message):
    __slots__ = ("token", "spiffe_id", "expires_at", "issued_at")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPIFFE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    token: str
    spiffe_id: str
    expires_at: int
    issued_at: int
    def __init__(self, token: _Optional[str] = ..., spiffe_id: _Optional[str] = ..., expires_at: _Optional[int] = ..., issued_at: _Optional[int] = ...) -> None: ...

class JwtBundleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JwtBundleResponse(_message.Message):
    __slots__ = ("jwks", "tainted_kids", "trust_domain_id")
    JWKS_FIELD_NUMBER: _ClassVar[int]
    TAINTED_KIDS_FIELD_NUMBER: _ClassVar[int]
    TRUST_DOMAIN_ID_FIELD_NUMBER: _ClassVar[int]
    jwks: bytes
    tainted_kids: _containers.RepeatedScalarFieldContainer[str]
    trust_domain_id: str
    def __init__(self, jwks: _Optional[bytes] = ..., tainted_kids: _Optional[_Iterable[str]] = ..., trust_domain_id: _Optional[str] = ...) -> None: ...
