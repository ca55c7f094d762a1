"""Why a request was refused, with the gRPC status it maps to (docs/reference.md#status-codes).

Each error carries a short machine `reason` (a metrics label and audit field) and a message for
the caller that says what was wrong and what to do. Messages never echo tokens or keys.

Messages are bounded (`MAX_MESSAGE_CHARS`) because parts of them come from the caller (SAN
values, impersonated identities): an unbounded one travels back as gRPC trailing metadata, and
past the client's metadata limit the caller sees `RESOURCE_EXHAUSTED`, a code clients retry,
instead of the refusal. Builders of messages shorten caller input first (`clip`, `clip_list`) so
the part that says what to fix survives; the cap in `RequestError` is the backstop.

`CaSetupError` is the other kind: not a refused request but a CA that cannot start (or keep) its
configuration or signing material; the commands print it as one line and exit.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

MAX_MESSAGE_CHARS = 1024
MAX_VALUE_CHARS = 120
_LIST_SHOWN = 3


def clip(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more characters)"


def clip_list(values: Sequence[str]) -> str:
    """The first few values, each clipped, and how many more there were."""
    shown = [clip(value) for value in values[:_LIST_SHOWN]]
    more = f" and {len(values) - _LIST_SHOWN} more" if len(values) > _LIST_SHOWN else ""
    return f"{shown}{more}"


class RequestError(Exception):
    """A refused request. Subclasses fix the status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, reason: str, message: str) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.reason = reason
        self.message = message


class AuthenticationError(RequestError):
    """The caller could not be authenticated (never retried by clients)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class InvalidRequestError(RequestError):
    """The CSR or parameters are malformed or outside policy (never retried by clients)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class PermissionDeniedError(RequestError):
    """An authenticated caller asked for an identity that is not theirs."""

    code = grpc.StatusCode.PERMISSION_DENIED


class CaUnavailableError(RequestError):
    """The CA cannot sign right now (not ready, expired, signing failed); clients retry."""

    code = grpc.StatusCode.INTERNAL


class SigningKeyUnavailableError(RequestError):
    """The JWT-SVID signing key cannot sign now (it expires too soon: the CA was down past its
    rotation, or rotation is off); the CA replaces it at its next key poll. Clients retry."""

    code = grpc.StatusCode.UNAVAILABLE


class DependencyUnavailableError(RequestError):
    """Something the CA depends on (the Kubernetes API server) did not answer; clients retry."""

    code = grpc.StatusCode.UNAVAILABLE


class CacheSyncingError(DependencyUnavailableError):
    """A cluster-wide cache the request needs (pods, ServiceAccounts) has not completed its
    first list: refused at once with a retry hint (`grpc-retry-pushback-ms`), the cache's
    progress in the message."""

    def __init__(self, reason: str, message: str, *, retry_after_ms: int) -> None:
        super().__init__(reason, message)
        self.retry_after_ms = retry_after_ms


class OverloadedError(RequestError):
    """Too many requests in flight: refused at once, with a hint of when to retry (gRPC retry
    pushback, `grpc-retry-pushback-ms`). Clients retry `UNAVAILABLE`."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, reason: str, message: str, *, retry_after_ms: int) -> None:
        super().__init__(reason, message)
        self.retry_after_ms = retry_after_ms


class CaSetupError(RuntimeError):
    """The CA's signing material or configuration is missing, incomplete or inconsistent:
    refuse to start (or, for a change at run time, keep what is in use)."""
