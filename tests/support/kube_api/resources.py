"""The resource types this fake API server knows, and their per-type defaulting.

Each type is described once (group, version, plural, kind, scope) so routing, list kinds, watch
events and error messages all agree. Defaulting mirrors the bits of real API-server behaviour that
client code can observe: Secret ``stringData`` folding, the namespace name label, pod phase.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from .errors import bad_request, invalid


@dataclass(frozen=True)
class ResourceType:
    """One REST resource, e.g. ``secrets`` in the core group."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    # Extra fieldSelector paths the real API server accepts for this type (beyond metadata.*).
    field_labels: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


NAMESPACES = ResourceType("", "v1", "namespaces", "Namespace", False, ("status.phase",))
SECRETS = ResourceType("", "v1", "secrets", "Secret", True, ("type",))
CONFIGMAPS = ResourceType("", "v1", "configmaps", "ConfigMap", True)
PODS = ResourceType(
    "",
    "v1",
    "pods",
    "Pod",
    True,
    (
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
)
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True)
SERVICEACCOUNTS = ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True)
CLUSTERTRUSTBUNDLES = ResourceType(
    "certificates.k8s.io",
    "v1",
    "clustertrustbundles",
    "ClusterTrustBundle",
    False,
    ("spec.signerName",),
)

RESOURCE_TYPES: tuple[ResourceType, ...] = (
    NAMESPACES,
    SECRETS,
    CONFIGMAPS,
    PODS,
    LEASES,
    SERVICEACCOUNTS,
    CLUSTERTRUSTBUNDLES,
)
_BY_PATH: dict[tuple[str, str, str], ResourceType] = {
    (rt.group, rt.version, rt.plural): rt for rt in RESOURCE_TYPES
}
_BY_NAME: dict[str, ResourceType] = {rt.plural: rt for rt in RESOURCE_TYPES}
_BY_NAME.update({rt.kind.lower(): rt for rt in RESOURCE_TYPES})


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    """The type served at ``/api[s]/{group}/{version}/.../{plural}``, if any."""
    return _BY_PATH.get((group, version, plural))


def by_name(name: str | ResourceType) -> ResourceType:
    """Resolve ``"secrets"``, ``"secret"`` or a ``ResourceType`` (for the Python test helpers)."""
    if isinstance(name, ResourceType):
        return name
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise KeyError(f"unknown resource {name!r}") from None


def _fold_secret(obj: dict[str, Any]) -> None:
    """Validate ``data`` as base64 and merge ``stringData`` into it, as the API server does."""
    name = obj.get("metadata", {}).get("name", "")
    data = obj.get("data") or {}
    if not isinstance(data, dict):
        raise bad_request("Secret.data must be an object")
    for key, value in data.items():
        if not isinstance(value, str):
            raise bad_request(f"Secret.data[{key}] must be a base64 string")
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(
                f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data '
                f"at data[{key}]"
            ) from None
    string_data = obj.pop("stringData", None) or {}
    if not isinstance(string_data, dict):
        raise invalid("Secret", name, "stringData must be an object")
    for key, value in string_data.items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    if data:
        obj["data"] = data
    else:
        obj.pop("data", None)
    obj.setdefault("type", "Opaque")


def apply_defaults(rt: ResourceType, obj: dict[str, Any]) -> None:
    """Mutate ``obj`` in place with server-side defaults for a create or update."""
    metadata = obj.setdefault("metadata", {})
    if rt is SECRETS:
        _fold_secret(obj)
    elif rt is NAMESPACES:
        labels = metadata.get("labels") or {}
        labels["kubernetes.io/metadata.name"] = metadata.get("name", "")
        metadata["labels"] = labels
        obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        status = obj.get("status") or {}
        status.setdefault("phase", "Active")
        obj["status"] = status
    elif rt is PODS:
        status = obj.get("status") or {}
        status.setdefault("phase", "Pending")
        obj["status"] = status
