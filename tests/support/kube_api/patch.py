"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

Strategic merge patch is treated as a merge patch: for the maps meshca patches (labels,
annotations, data, lease spec) the two agree; only list-merge-by-key semantics differ.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError, bad_request

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _resolve(doc: Any, pointer: str) -> tuple[Any, str]:
    """Return (parent container, final token) for a JSON pointer."""
    if not pointer.startswith("/"):
        raise bad_request(f"invalid JSON pointer {pointer!r}")
    tokens = [_unescape(t) for t in pointer[1:].split("/")]
    parent = doc
    for token in tokens[:-1]:
        try:
            parent = parent[int(token)] if isinstance(parent, list) else parent[token]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ApiError(422, "Invalid", f"jsonpatch: path {pointer!r} does not exist") from None
    return parent, tokens[-1]


def _get(doc: Any, pointer: str) -> Any:
    if pointer == "":
        return doc
    parent, token = _resolve(doc, pointer)
    try:
        return parent[int(token)] if isinstance(parent, list) else parent[token]
    except (KeyError, IndexError, ValueError, TypeError):
        raise ApiError(422, "Invalid", f"jsonpatch: path {pointer!r} does not exist") from None


def _remove(doc: Any, pointer: str) -> Any:
    parent, token = _resolve(doc, pointer)
    try:
        return parent.pop(int(token)) if isinstance(parent, list) else parent.pop(token)
    except (KeyError, IndexError, ValueError, TypeError):
        raise ApiError(422, "Invalid", f"jsonpatch: path {pointer!r} does not exist") from None


def _add(doc: Any, pointer: str, value: Any) -> None:
    parent, token = _resolve(doc, pointer)
    if isinstance(parent, list):
        if token == "-":
            parent.append(value)
        else:
            parent.insert(int(token), value)
    elif isinstance(parent, dict):
        parent[token] = value
    else:
        raise ApiError(422, "Invalid", f"jsonpatch: cannot add at {pointer!r}")


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 add/remove/replace/move/copy/test on a deep copy of ``target``."""
    if not isinstance(operations, list):
        raise bad_request("json patch body must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid json patch operation {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "add":
            _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _remove(doc, path)
            _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "move":
            _add(doc, path, _remove(doc, op["from"]))
        elif kind == "copy":
            _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise ApiError(422, "Invalid", f"jsonpatch: test failed at {path!r}")
        else:
            raise bad_request(f"unknown json patch op {kind!r}")
    return doc


def apply_patch(target: dict[str, Any], content_type: str, body: Any) -> dict[str, Any]:
    """Dispatch on the request Content-Type; unsupported types get 415 like the real server."""
    media = content_type.split(";")[0].strip().lower()
    if media in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        if not isinstance(body, dict):
            raise bad_request("merge patch body must be a JSON object")
        result = merge_patch(target, body)
    elif media == JSON_PATCH:
        result = json_patch(target, body)
    else:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - "
            f"accepted media types include: {JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_MERGE_PATCH}",
        )
    if not isinstance(result, dict):
        raise bad_request("patch result is not an object")
    return result
