"""Playing the kubelet's side of Pod Certificates against a real API server: a pod spec with a
`podCertificate` projected volume, and a PodCertificateRequest as the kubelet creates it (its
own fresh key, a stub CSR signed by it, the pod's, account's and node's names and UIDs).

Used by tests/k8s_real/test_pod_certificates.py and bench/pod_certificates.py.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import kubernetes.client
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

KEY_TYPES = ("RSA3072", "RSA4096", "ECDSAP256", "ECDSAP384", "ECDSAP521", "ED25519")
TERMINAL = ("Issued", "Denied", "Failed")

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey


def generate_key(key_type: str) -> PrivateKey:
    """A key of the podCertificate volume's `keyType` (plus "RSA2048", which the API refuses)."""
    if key_type.startswith("RSA"):
        return rsa.generate_private_key(public_exponent=65537, key_size=int(key_type[3:]))
    if key_type == "ED25519":
        return ed25519.Ed25519PrivateKey.generate()
    curve = {"ECDSAP256": ec.SECP256R1(), "ECDSAP384": ec.SECP384R1(), "ECDSAP521": ec.SECP521R1()}
    return ec.generate_private_key(curve[key_type])


def stub_csr(key: PrivateKey) -> bytes:
    """The kubelet's stub PKCS#10 request: no subject, signed by the pod's new key."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.DER)


def pod_body(
    namespace: str,
    name: str,
    service_account: str,
    node: str,
    signer: str | None,
    key_type: str = "ECDSAP256",
) -> dict[str, Any]:
    """A pod bound to `node`, with a `podCertificate` volume for `signer` (None: no volume)."""
    volumes = []
    mounts = []
    if signer is not None:
        source = {
            "podCertificate": {
                "signerName": signer,
                "keyType": key_type,
                "credentialBundlePath": "credentialbundle.pem",
            }
        }
        volumes = [{"name": "spiffe", "projected": {"sources": [source]}}]
        mounts = [{"name": "spiffe", "mountPath": "/var/run/spiffe"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "serviceAccountName": service_account,
            "nodeName": node,
            "automountServiceAccountToken": False,
            "containers": [
                {"name": "app", "image": "example.invalid/app:1", "volumeMounts": mounts}
            ],
            "volumes": volumes,
        },
    }


def pcr_body(
    pod: Any,
    account_uid: str,
    node: Any,
    signer: str,
    key: PrivateKey,
    *,
    max_expiration_seconds: int = 86400,
    name: str | None = None,
) -> dict[str, Any]:
    """The request the kubelet creates for `pod` (a V1Pod) on `node` (a V1Node)."""
    metadata: dict[str, Any] = {"namespace": pod.metadata.namespace}
    if name is None:
        metadata["generateName"] = "req-"
    else:
        metadata["name"] = name
    return {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "PodCertificateRequest",
        "metadata": metadata,
        "spec": {
            "signerName": signer,
            "podName": pod.metadata.name,
            "podUID": pod.metadata.uid,
            "serviceAccountName": pod.spec.service_account_name,
            "serviceAccountUID": account_uid,
            "nodeName": node.metadata.name,
            "nodeUID": node.metadata.uid,
            "maxExpirationSeconds": max_expiration_seconds,
            "stubPKCS10Request": base64.b64encode(stub_csr(key)).decode(),
        },
    }


def create_pcr(api: kubernetes.client.ApiClient, body: dict[str, Any]) -> dict[str, Any]:
    """Creates the request as the client `api` authenticates (raw JSON back). NodeRestriction
    reads the pod from the API server's own informer, which may not hold a pod created a moment
    ago (HTTP 500 "not found"): retried for a few seconds, as a kubelet retries — a kubelet only
    asks for pods it has seen, so it rarely meets this."""
    certificates: Any = kubernetes.client.CertificatesV1Api(api)
    deadline = time.monotonic() + 5.0
    while True:
        try:
            response = certificates.create_namespaced_pod_certificate_request(
                body["metadata"]["namespace"], body, _preload_content=False
            )
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status != 500 or "not found" not in str(exc.body):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        return dict(json.loads(response.data))


def read_pcr(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    certificates: Any = kubernetes.client.CertificatesV1Api(api)
    response = certificates.read_namespaced_pod_certificate_request(
        name, namespace, _preload_content=False
    )
    return dict(json.loads(response.data))


def condition(pcr: dict[str, Any]) -> dict[str, Any] | None:
    """The request's terminal condition, if it has one."""
    for cond in (pcr.get("status") or {}).get("conditions") or ():
        if cond.get("type") in TERMINAL:
            return dict(cond)
    return None


def outcome(pcr: dict[str, Any]) -> str:
    """The terminal condition's type ("" while pending)."""
    cond = condition(pcr)
    return str(cond["type"]) if cond is not None else ""


def wait_answered(
    api: kubernetes.client.ApiClient, namespace: str, name: str, timeout: float = 30.0
) -> dict[str, Any]:
    """The request once it carries a terminal condition (polled; raises TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        pcr = read_pcr(api, namespace, name)
        if condition(pcr) is not None:
            return pcr
        if time.monotonic() > deadline:
            raise TimeoutError(f"PodCertificateRequest {namespace}/{name} not answered: {pcr}")
        time.sleep(0.05)
