"""Why a request was refused, with the gRPC status it maps to (docs/reference.md#status-codes).

Each error carries a short machine `reason` (a metrics label and audit field) and a message for
the caller that says what was wrong and what to do. Messages never echo tokens or keys.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A refused request. Subclasses fix the status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, reason: str, message: str) -> None:
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


class DependencyUnavailableError(RequestError):
    """Something the CA depends on (the Kubernetes API server) did not answer; clients retry."""

    code = grpc.StatusCode.UNAVAILABLE


class OverloadedError(RequestError):
    """Too many requests in flight: refused at once, with a hint of when to retry (gRPC retry
    pushback, `grpc-retry-pushback-ms`). Clients retry `UNAVAILABLE`."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, reason: str, message: str, *, retry_after_ms: int) -> None:
        super().__init__(reason, message)
        self.retry_after_ms = retry_after_ms
