"""Whether a pending PodCertificateRequest may be signed: pure rules, no I/O.

What the API server has checked before the signer sees a request: the stub CSR's signature and
key type (RSA 3072/4096, ECDSA P-256/P-384/P-521, Ed25519), the field formats, and — only when
the cluster enables NodeRestriction, and only for requests a *node* creates — that the pod runs
on that node, has those UIDs and mounts a `podCertificate` volume for the signer. Anyone else
with `create podcertificaterequests` may name any pod, and the signer is not told who created a
request. So every request is checked here against the CA's pod cache as if NodeRestriction
were off (`request_refusal`), and its key against what meshca signs (`stub_public_key`).

Outcomes, as the API accepts them: `Denied` only with reason `UnsupportedKeyType` (a key type
meshca does not sign; the message names those it does), `Failed` for everything else with a
reason saying what did not match, or `WAIT`: the pod is not (or not yet as named) in the cache,
and the request is younger than `POD_GRACE` — a pod created a moment ago may not have reached
the watch yet, and a terminal answer cannot be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, cast

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from ca_server.kube.pod_certificates.requests import PendingRequest
from certs import PublicKey
from meshca.pods import PodInfo

POD_GRACE = timedelta(seconds=10)
SIGNED_KEY_TYPES = "ECDSAP256, ECDSAP384, RSA3072 or RSA4096"
_SIGNED_CURVES = frozenset({"secp256r1", "secp384r1"})
_SIGNED_RSA_BITS = frozenset({3072, 4096})


@dataclass(frozen=True)
class Refusal:
    """A terminal answer other than `Issued`: the condition, its reason and the operator's
    message (what did not match, and what to do)."""

    condition: Literal["Denied", "Failed"]
    reason: str
    message: str


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()


def _denied_key(what: str) -> Refusal:
    return Refusal(
        "Denied",
        "UnsupportedKeyType",
        f"meshca does not sign {what} keys (Envoy and Istio peers do not accept them); set "
        f"keyType to one of {SIGNED_KEY_TYPES} in the pod's podCertificate volume",
    )


def stub_public_key(
    stub_csr: bytes,
) -> tuple[PublicKey, x509.CertificateSigningRequest] | Refusal:
    """The public key of the request's stub CSR (only the key counts: the API server checked
    the CSR's signature), with the parsed CSR; or why it cannot be signed."""
    try:
        csr = x509.load_der_x509_csr(stub_csr)
        key = csr.public_key()
    except (ValueError, TypeError):
        return Refusal(
            "Failed",
            "StubCSRUnreadable",
            "spec.stubPKCS10Request is not a DER PKCS#10 request meshca can read",
        )
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in _SIGNED_CURVES:
            return _denied_key(f"ECDSA {key.curve.name}")
        return cast(PublicKey, key), csr
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size not in _SIGNED_RSA_BITS:
            return _denied_key(f"RSA-{key.key_size}")
        return cast(PublicKey, key), csr
    if isinstance(key, ed25519.Ed25519PublicKey):
        return _denied_key("Ed25519")
    return _denied_key(type(key).__name__)


def request_refusal(
    request: PendingRequest,
    signer_name: str,
    pod: PodInfo | None,
    account_uid: str | None,
    now: datetime,
) -> Refusal | _Wait | None:
    """None when the request's claims match the pod as the cache holds it; `account_uid` is the
    ServiceAccount's uid when the CA caches accounts (None: not known, not checked). The node's
    UID is not checked: the CA keeps no node cache (docs/pod-certificates.md)."""
    where = f"pod {request.namespace}/{request.pod_name}"
    if request.signer_name != signer_name:
        return Refusal("Failed", "WrongSigner", f"the request names signer {request.signer_name!r}")
    young = request.created is not None and now - request.created < POD_GRACE
    if pod is None:
        if young:
            return WAIT
        return Refusal("Failed", "PodNotFound", f"{where} does not exist (in the CA's pod cache)")
    if pod.uid != request.pod_uid:
        if young:
            return WAIT
        return Refusal(
            "Failed",
            "PodUIDMismatch",
            f"{where} has UID {pod.uid}, the request names {request.pod_uid}",
        )
    if not pod.live:
        return Refusal("Failed", "PodNotRunning", f"{where} has ended (phase {pod.phase})")
    if pod.service_account != request.service_account:
        return Refusal(
            "Failed",
            "ServiceAccountMismatch",
            f"{where} runs as service account {pod.service_account}, the request names "
            f"{request.service_account}",
        )
    if account_uid is not None and account_uid != request.service_account_uid:
        return Refusal(
            "Failed",
            "ServiceAccountMismatch",
            f"service account {request.namespace}/{request.service_account} has UID "
            f"{account_uid}, the request names {request.service_account_uid}",
        )
    if pod.node_name != request.node_name:
        return Refusal(
            "Failed",
            "NodeMismatch",
            f"{where} is bound to node {pod.node_name or '(none)'}, the request names "
            f"{request.node_name}",
        )
    if signer_name not in pod.pod_certificate_signers:
        return Refusal(
            "Failed",
            "NoPodCertificateVolume",
            f"{where} does not mount a podCertificate projected volume for signer {signer_name}",
        )
    return None
