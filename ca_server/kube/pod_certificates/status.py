"""The status a signer writes on a PodCertificateRequest, in one update.

The API server accepts exactly one condition, of type `Issued`, `Denied` or `Failed`, with
status `True`, a reason and a transition time; `Issued` comes with the chain (leaf first, PEM)
and the three times, `Denied` and `Failed` with nothing else. The body is the smallest object a
status update takes: the request's identity and the resourceVersion the decision was made on
(so a write racing another writer is refused with 409, never applied twice), the spec as read
(the API server keeps the stored one whatever is sent, but the client checks it is complete)
and the status.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

from ca_server.kube.pod_certificates.checks import Refusal
from ca_server.kube.pod_certificates.requests import API_VERSION, KIND, PendingRequest
from ca_server.kube.pod_certificates.timing import PodCertificateTimes

ISSUED_REASON = "Issued"


def rfc3339(moment: datetime) -> str:
    """A `metav1.Time`: UTC, whole seconds."""
    return moment.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, reason: str, message: str, now: datetime) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": rfc3339(now),
    }


def issued_status(
    chain_pem: str, times: PodCertificateTimes, identity: str, now: datetime
) -> dict[str, Any]:
    return {
        "conditions": [_condition("Issued", ISSUED_REASON, f"issued {identity}", now)],
        "certificateChain": chain_pem,
        "notBefore": rfc3339(times.not_before),
        "notAfter": rfc3339(times.not_after),
        "beginRefreshAt": rfc3339(times.begin_refresh_at),
    }


def refused_status(refusal: Refusal, now: datetime) -> dict[str, Any]:
    return {"conditions": [_condition(refusal.condition, refusal.reason, refusal.message, now)]}


def status_body(request: PendingRequest, status: dict[str, Any]) -> dict[str, Any]:
    """The update's body: `status` on the request as it was read (`resource_version`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": request.name,
            "namespace": request.namespace,
            "uid": request.uid,
            "resourceVersion": request.resource_version,
        },
        "spec": {
            "signerName": request.signer_name,
            "podName": request.pod_name,
            "podUID": request.pod_uid,
            "serviceAccountName": request.service_account,
            "serviceAccountUID": request.service_account_uid,
            "nodeName": request.node_name,
            "nodeUID": request.node_uid,
            "maxExpirationSeconds": request.max_expiration_seconds,
            "stubPKCS10Request": base64.b64encode(request.stub_csr).decode(),
        },
        "status": status,
    }
