"""`api_error_text`: an API refusal names what the server said, not only its status line."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from meshca.kube_client import api_error_text

FORBIDDEN = (
    'pods is forbidden: User "system:serviceaccount:istio-system:meshca" cannot list resource '
    '"pods" in API group "" at the cluster scope'
)


def _error(status: int, reason: str, body: str | bytes | None) -> ApiException:
    error = ApiException(status=status, reason=reason)
    error.body = body  # type: ignore[assignment]  # the client sets bytes or str
    return error


def test_the_servers_message_names_the_missing_permission():
    body = json.dumps({"kind": "Status", "status": "Failure", "message": FORBIDDEN}).encode()
    assert api_error_text(_error(403, "Forbidden", body)) == f"HTTP 403 Forbidden: {FORBIDDEN}"


def test_without_a_status_body_only_the_status_line():
    assert api_error_text(_error(503, "Service Unavailable", b"<html>")) == (
        "HTTP 503 Service Unavailable"
    )
    assert api_error_text(_error(500, "Internal Server Error", None)) == (
        "HTTP 500 Internal Server Error"
    )
    assert api_error_text(_error(500, "x", json.dumps(["not", "a", "status"]))) == "HTTP 500 x"


def test_a_long_or_multi_line_message_is_one_short_line():
    body = json.dumps({"message": "line one\nline two " + "x" * 1000})
    text = api_error_text(_error(422, "Unprocessable Entity", body))
    assert "\n" not in text
    assert text.startswith("HTTP 422 Unprocessable Entity: line one line two x")
    assert len(text) < 400
