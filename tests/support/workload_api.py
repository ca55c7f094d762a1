"""The real PyPI `spiffe` client (py-spiffe's `WorkloadApiClient`) as tests use it against the
agent's Workload API: a watch that records every pushed X.509 context on ONE stream (no
reconnect), and the facts tests compare (leaf serial, bundle roots, key match, chain check).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from spiffe import TrustDomain, WorkloadApiClient, X509Bundle
from spiffe.workloadapi.x509_context import X509Context

from certs import CertsError, key_matches_certificate, verify_chain


@dataclass(frozen=True)
class Pushed:
    """One X.509 context the client received, reduced to what tests compare."""

    spiffe_id: str
    leaf: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    key_matches: bool
    roots: frozenset[int]  # serials of the trust domain's bundle
    bundle: tuple[x509.Certificate, ...]
    received_at: float

    @property
    def serial(self) -> int:
        return int(self.leaf.serial_number)

    def chain_verifies(self) -> bool:
        """The chain verifies to the bundle that came with it (certs.verify_chain)."""
        try:
            verify_chain(list(self.chain), list(self.bundle), now=datetime.now(UTC))
        except CertsError:
            return False
        return True


def pushed_from(context: X509Context) -> Pushed:
    svid = context.default_svid
    bundle = context.x509_bundle_set.get_bundle_for_trust_domain(svid.spiffe_id.trust_domain)
    roots = tuple(bundle.x509_authorities) if bundle is not None else ()
    chain = tuple(svid.cert_chain)
    key = svid.private_key
    return Pushed(
        spiffe_id=str(svid.spiffe_id),
        leaf=svid.leaf,
        chain=chain,
        key_matches=isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey)
        and key_matches_certificate(key, svid.leaf),
        roots=frozenset(int(root.serial_number) for root in roots),
        bundle=roots,
        received_at=time.monotonic(),
    )


def bundle_serials(trust_domain_id: str, der: bytes) -> frozenset[int]:
    """The root serials in a Workload API bundle (concatenated DER), parsed by py-spiffe."""
    bundle = X509Bundle.parse_raw(TrustDomain(trust_domain_id), der)
    return frozenset(int(root.serial_number) for root in bundle.x509_authorities)


def client_for(socket: Path) -> WorkloadApiClient:
    return WorkloadApiClient(f"unix:{socket}")


class SvidWatch:
    """`stream_x509_contexts` with `retry_connect=False`: a stream that ends (or fails) is an
    error recorded in `errors`, never a silent reconnect, so every entry of `pushed` came on
    one stream."""

    def __init__(self, socket: Path) -> None:
        self.client = client_for(socket)
        self.pushed: list[Pushed] = []
        self.errors: list[Exception] = []
        self._arrivals: queue.Queue[Pushed] = queue.Queue()
        self._lock = threading.Lock()
        self._handle = self.client.stream_x509_contexts(
            self._on_success, self._on_error, retry_connect=False
        )

    def _on_success(self, context: X509Context) -> None:
        item = pushed_from(context)
        with self._lock:
            self.pushed.append(item)
        self._arrivals.put(item)

    def _on_error(self, error: Exception) -> None:
        with self._lock:
            self.errors.append(error)

    def next(self, timeout: float) -> Pushed:
        """The next pushed context; fails the test if none arrives or the stream broke."""
        deadline = time.monotonic() + timeout
        while True:
            assert not self.errors, f"the Workload API stream failed: {self.errors}"
            try:
                return self._arrivals.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise AssertionError(f"no Workload API push within {timeout}s") from None

    def close(self) -> None:
        self._handle.cancel()
        self.client.close()
