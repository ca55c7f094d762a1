"""API errors rendered as Kubernetes ``Status`` objects.

The official client turns any non-2xx response into ``ApiException`` and callers branch on
``e.status`` and sometimes on ``json.loads(e.body)["reason"]``, so every failure must carry the
same ``code``/``reason`` pair a real API server would send.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A failed API call; ``to_status()`` is what goes on the wire."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        name: str | None = None,
        kind: str | None = None,
        group: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details: dict[str, Any] = {}
        if name is not None:
            self.details["name"] = name
        if group:
            self.details["group"] = group
        if kind is not None:
            self.details["kind"] = kind

    def to_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            status["details"] = dict(self.details)
        return status


def not_found(plural: str, name: str, group: str = "") -> ApiError:
    resource = f"{plural}.{group}" if group else plural
    return ApiError(
        404, "NotFound", f'{resource} "{name}" not found', name=name, kind=plural, group=group
    )


def already_exists(plural: str, name: str, group: str = "") -> ApiError:
    resource = f"{plural}.{group}" if group else plural
    return ApiError(
        409,
        "AlreadyExists",
        f'{resource} "{name}" already exists',
        name=name,
        kind=plural,
        group=group,
    )


def conflict(plural: str, name: str, group: str = "") -> ApiError:
    resource = f"{plural}.{group}" if group else plural
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        name=name,
        kind=plural,
        group=group,
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(kind: str, name: str, message: str) -> ApiError:
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {message}', name=name, kind=kind)


def expired(requested: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {requested} ({oldest})")
