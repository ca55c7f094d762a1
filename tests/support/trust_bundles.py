"""What a pod's `clusterTrustBundle` projection selects, as the kubelet computes it
(pkg/kubelet/clustertrustbundle: every bundle whose `spec.signerName` is the signer and whose
labels match the selector, merged, duplicate roots removed), over ClusterTrustBundles given as
the API's JSON (the fake API server's objects, or `ApiClient.sanitize_for_serialization` of the
real one's)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ca_server.authority.slots import authority_id
from certs import load_certs


def _matching(
    bundles: Iterable[Mapping[str, Any]], signer: str, match_labels: Mapping[str, str] | None
) -> list[Mapping[str, Any]]:
    """`match_labels` None matches nothing (the projection's missing selector), `{}` all."""
    if match_labels is None:
        return []
    return [
        b
        for b in bundles
        if (b.get("spec") or {}).get("signerName") == signer
        and all(
            ((b.get("metadata") or {}).get("labels") or {}).get(k) == v
            for k, v in match_labels.items()
        )
    ]


def selected_roots(
    bundles: Iterable[Mapping[str, Any]], signer: str, match_labels: Mapping[str, str] | None
) -> list[x509.Certificate]:
    """The merged roots (each once) the projection gives the pod."""
    seen: dict[bytes, x509.Certificate] = {}
    for bundle in _matching(bundles, signer, match_labels):
        for cert in load_certs(bundle["spec"]["trustBundle"].encode()):
            seen.setdefault(cert.public_bytes(Encoding.DER), cert)
    return list(seen.values())


def selected_ids(
    bundles: Iterable[Mapping[str, Any]], signer: str, match_labels: Mapping[str, str] | None
) -> set[str]:
    """The authority IDs of `selected_roots`."""
    return {authority_id(cert) for cert in selected_roots(bundles, signer, match_labels)}


def bundle_labels(bundles: Iterable[Mapping[str, Any]], signer: str) -> list[dict[str, str]]:
    """The labels of every bundle of `signer`."""
    return [
        dict((b.get("metadata") or {}).get("labels") or {}) for b in _matching(bundles, signer, {})
    ]
