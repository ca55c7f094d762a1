"""What a pod trusts when it projects the CA's ClusterTrustBundles as docs/trust-bundles.md says
(`clusterTrustBundle` by `signerName` + `labelSelector: {matchLabels: {meshca.io/trust:
"true"}}`), read as the kubelet reads it, and a watcher that checks it all along a rotation.

Used by tests/k8s_real/test_trust_bundles.py (leaves from CreateCertificate) and
tests/k8s_real/test_pod_certificates.py (leaves from PodCertificateRequests).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from cryptography import x509

from ca_server.authority.slots import authority_id
from ca_server.kube.trust_bundles import TRUST_LABEL
from certs import CertsError, load_certs, verify_chain


def selected_roots(api: Any, signer: str) -> list[x509.Certificate]:
    """Every root of the bundles the projection selects, each once (the API server filters by
    signer and label, as the kubelet's informer-backed lister does; the kubelet merges them)."""
    listed = api.list_cluster_trust_bundle(
        field_selector=f"spec.signerName={signer}", label_selector=f"{TRUST_LABEL}=true"
    )
    roots: dict[bytes, x509.Certificate] = {}
    for bundle in listed.items:
        for cert in load_certs(bundle.spec.trust_bundle.encode()):
            roots.setdefault(cert.tbs_certificate_bytes, cert)
    return list(roots.values())


def selected_ids(api: Any, signer: str) -> set[str]:
    return {authority_id(cert) for cert in selected_roots(api, signer)}


class SelectionWatch:
    """Checks, in a thread, every ~50 ms, that the selection verifies every live leaf (its
    chain: leaf first, then intermediates) and holds no revoked root; keeps what went wrong."""

    def __init__(self, api: Any, signer: str) -> None:
        self._api = api
        self._signer = signer
        self._lock = threading.Lock()
        self.live: dict[str, list[x509.Certificate]] = {}
        self.revoked: set[str] = set()
        self.problems: list[str] = []
        self.checks = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, name: str, chain: list[x509.Certificate]) -> None:
        with self._lock:
            self.live[name] = chain

    def retire(self, name: str) -> None:
        with self._lock:
            del self.live[name]

    def mark_revoked(self, ident: str) -> None:
        with self._lock:
            self.revoked.add(ident)

    def _run(self) -> None:
        while not self._stopping.wait(0.05):
            self.check()

    def check(self) -> None:
        with self._lock:
            live, revoked = dict(self.live), set(self.revoked)
        roots = selected_roots(self._api, self._signer)
        now = datetime.now(UTC)
        for name, chain in live.items():
            try:
                verify_chain(chain, roots, now=now)
            except CertsError as exc:
                self.problems.append(f"leaf {name} does not verify: {exc}")
        if bad := revoked & {authority_id(cert) for cert in roots}:
            self.problems.append(f"revoked roots selected: {bad}")
        self.checks += 1

    def __enter__(self) -> SelectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join(5)
