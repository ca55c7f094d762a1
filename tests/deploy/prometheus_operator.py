"""Schemas for the Prometheus Operator objects under deploy/monitoring/.

Their CRDs (monitoring.coreos.com/v1) are not among Kubernetes 1.30's built-in schemas that
kubernetes-validate bundles, so these are written here: the subset of the operator's CRD schemas
that deploy/ uses, strict (no unknown field anywhere), with the operator's required fields and
types. A field deploy/ starts using must be added here on purpose, after checking it in the
operator's API reference (prometheus-operator Documentation/api-reference/api.md).
"""

from __future__ import annotations

from typing import Any

import jsonschema

API_VERSION = "monitoring.coreos.com/v1"


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_STRING = {"type": "string"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The operator's Duration pattern: units from years to milliseconds, largest first.
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
    r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_METADATA = _object(
    {"name": _STRING, "namespace": _STRING, "labels": _STRING_MAP, "annotations": _STRING_MAP},
    ("name",),
)
_LABEL_SELECTOR = _object(
    {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _object(
                {"key": _STRING, "operator": _STRING, "values": {"type": "array"}},
                ("key", "operator"),
            ),
        },
    }
)
_NAMESPACE_SELECTOR = _object({"any": {"type": "boolean"}, "matchNames": {"type": "array"}})
_ENDPOINT = _object({"port": _STRING, "path": _STRING, "interval": _DURATION, "scheme": _STRING})
_RULE = _object(
    {
        "alert": _STRING,
        "record": _STRING,
        "expr": _STRING,
        "for": _DURATION,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    ("expr",),
)


def _kind(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {
            "apiVersion": {"const": API_VERSION},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


SCHEMAS: dict[str, dict[str, Any]] = {
    "PodMonitor": _kind(
        "PodMonitor",
        _object(
            {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            },
            ("selector",),
        ),
    ),
    "ServiceMonitor": _kind(
        "ServiceMonitor",
        _object(
            {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "endpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            },
            ("selector",),
        ),
    ),
    "PrometheusRule": _kind(
        "PrometheusRule",
        _object(
            {
                "groups": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": _STRING,
                            "interval": _DURATION,
                            "rules": {"type": "array", "items": _RULE},
                        },
                        ("name",),
                    ),
                }
            }
        ),
    ),
}


def is_prometheus_operator_object(doc: dict[str, Any]) -> bool:
    return doc.get("apiVersion") == API_VERSION


def validate(doc: dict[str, Any]) -> None:
    """Raises `jsonschema.ValidationError` (or `LookupError` for a kind not modelled here)."""
    kind = doc.get("kind", "")
    if kind not in SCHEMAS:
        raise LookupError(f"{API_VERSION} kind {kind!r} has no schema in {__name__}")
    jsonschema.validate(doc, SCHEMAS[kind])
