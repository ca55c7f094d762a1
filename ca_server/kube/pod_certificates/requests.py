"""What the signer keeps of a PodCertificateRequest (`certificates.k8s.io/v1`), from raw JSON.

The watch (`meshca.paged_informer`, field selector `spec.signerName=<signer>`) hands every
request for this signer to `request_from_json`. A request that already carries a terminal
condition (`Issued`, `Denied`, `Failed`) is answered for good — its status is immutable — so it
is kept as the one shared `ANSWERED` value: the kubelet leaves answered requests behind until
the API server's cleaner deletes them, and they must not cost their CSR's bytes meanwhile. A
pending request keeps what the checks and the status write need, and its stub CSR (DER).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

API_VERSION = "certificates.k8s.io/v1"
KIND = "PodCertificateRequest"
TERMINAL_CONDITIONS = frozenset({"Issued", "Denied", "Failed"})
DEFAULT_MAX_EXPIRATION_SECONDS = 86400  # the API server's default for the field


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request without a terminal condition: the spec's claims, to be checked, and what its
    status write needs (the resourceVersion it was read at)."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    created: datetime | None
    signer_name: str
    pod_name: str
    pod_uid: str
    service_account: str
    service_account_uid: str
    node_name: str
    node_uid: str
    max_expiration_seconds: int
    stub_csr: bytes  # DER; the API server verified its signature before storing it

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class AnsweredRequest:
    """A request with a terminal condition (one shared value for all of them)."""


ANSWERED = AnsweredRequest()
StoredRequest = PendingRequest | AnsweredRequest


def is_terminal(status: dict[str, Any]) -> bool:
    """Whether a raw status carries a terminal condition."""
    for condition in status.get("conditions") or ():
        if isinstance(condition, dict) and condition.get("type") in TERMINAL_CONDITIONS:
            return True
    return False


def _timestamp(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _text(spec: dict[str, Any], field: str) -> str:
    value = spec.get(field)
    return value if isinstance(value, str) else ""


def request_from_json(obj: dict[str, Any]) -> StoredRequest:
    """The informer's transform: `ANSWERED`, or the pending request's fields. A stub CSR that
    is not base64 is kept empty (the checks then fail the request, saying so)."""
    if is_terminal(obj.get("status") or {}):
        return ANSWERED
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise ValueError("a PodCertificateRequest without metadata.namespace and metadata.name")
    try:
        stub = base64.b64decode(_text(spec, "stubPKCS10Request"), validate=True)
    except (binascii.Error, ValueError):
        stub = b""
    expiration = spec.get("maxExpirationSeconds")
    return PendingRequest(
        namespace=namespace,
        name=name,
        uid=str(metadata.get("uid") or ""),
        resource_version=str(metadata.get("resourceVersion") or ""),
        created=_timestamp(metadata.get("creationTimestamp")),
        signer_name=_text(spec, "signerName"),
        pod_name=_text(spec, "podName"),
        pod_uid=_text(spec, "podUID"),
        service_account=_text(spec, "serviceAccountName"),
        service_account_uid=_text(spec, "serviceAccountUID"),
        node_name=_text(spec, "nodeName"),
        node_uid=_text(spec, "nodeUID"),
        max_expiration_seconds=(
            expiration if isinstance(expiration, int) else DEFAULT_MAX_EXPIRATION_SECONDS
        ),
        stub_csr=stub,
    )
