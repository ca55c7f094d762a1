"""Test-only control endpoints (``/_test/...``) for a server running in another process.

They mirror the ``KubeApiServer`` Python helpers: register tokens, seed objects, read request
counts, compact history. Real clients never call them, and they are not counted.
"""

from __future__ import annotations

from typing import Any

from . import errors
from .backend import Backend
from .errors import ApiError
from .resources import by_name

ADMIN_PREFIX = "/_test/"


def handle_admin(backend: Backend, method: str, action: str, body: Any) -> tuple[int, Any]:
    """Out-of-process equivalents of the ``KubeApiServer`` test helpers."""
    if method == "GET" and action == "counts":
        counts = backend.recorder.counts()
        return (200, [{"verb": v, "resource": r, "count": n} for (v, r), n in counts.items()])
    elif method == "POST" and action == "tokens" and isinstance(body, dict):
        spec = dict(body)
        token = spec.pop("token", None)
        if not token or not ("serviceAccount" in spec or "username" in spec):
            raise errors.bad_request("token spec needs token and username or serviceAccount")
        if "serviceAccount" in spec:
            backend.tokens.add_service_account(
                token,
                spec["namespace"],
                spec["serviceAccount"],
                audiences=spec.get("audiences"),
                pod_name=spec.get("podName"),
                pod_uid=spec.get("podUid"),
            )
        else:
            backend.tokens.add(
                token,
                spec["username"],
                uid=spec.get("uid", ""),
                groups=spec.get("groups", ()),
                extra=spec.get("extra"),
                audiences=spec.get("audiences"),
            )
        return (201, {"token": token})
    elif method == "POST" and action == "objects" and isinstance(body, dict):
        try:
            rt = by_name(str(body.get("kind", "")))
        except KeyError:
            raise errors.bad_request(f"unsupported kind {body.get('kind')!r}") from None
        namespace = (body.get("metadata") or {}).get("namespace")
        return (201, backend.store.create(rt, namespace, body, trusted=True))
    elif method == "POST" and action == "compact":
        backend.store.compact()
        return (200, {"resourceVersion": str(backend.store.resource_version)})
    elif method == "POST" and action == "reset-counts":
        backend.recorder.reset()
        return (200, {})
    else:
        raise ApiError(404, "NotFound", f"unknown test action {method} {action}")
