"""What the agent serves right now and how its renewals are going, per resource name.

One board feeds both views an operator has of the agent: the Prometheus gauges
(`agent.metrics`) and the `/debug/secrets` JSON that `meshca status` prints. Because both read
the same entries, a scrape and a status call can never disagree, and because the entries are
written only by

- the `SecretCache` listeners (`on_secret` / `on_secret_removed`): every publish from any source
  (a rotation, a restore from disk, a file-mounted reload) replaces the served certificate, and a
  secret no longer served loses its entry, so no series outlives it;
- the certificate scheduler, one call per event (`renewed`, `renewal_failed`, `forget`),

there is no second place that could go stale. Time left is computed when read, never stored.

Thread-safety: the event loop writes, the status server's thread reads; a lock guards the two
dicts and readers get immutable snapshots.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from datetime import datetime

from agent.secrets import RootSecret, Secret, TlsSecret
from certs import load_certs

CERT_CHAIN = "cert_chain"
CA_BUNDLE = "ca"


@dataclass(frozen=True)
class ServedCertificate:
    """The certificate served under a resource name: the leaf of a chain, or for a trust
    bundle the root that expires first (the one to alert on)."""

    type: str  # CERT_CHAIN or CA_BUNDLE
    serial_hex: str
    not_before: datetime
    not_after: datetime
    certificates: int  # certificates in the chain or bundle


@dataclass(frozen=True)
class RenewalState:
    """The scheduler's view of one identity's renewals (absent for file-mounted secrets)."""

    serial_hex: str | None = None  # the certificate `last_renewal` obtained
    last_renewal: datetime | None = None
    next_rotation: datetime | None = None
    consecutive_failures: int = 0
    last_error: str | None = None
    last_error_at: datetime | None = None


@dataclass(frozen=True)
class SecretReport:
    """One row of `meshca status`: what is served under `resource_name` and its renewals."""

    resource_name: str
    served: ServedCertificate | None  # None while the first certificate is still being fetched
    renewal: RenewalState | None

    def status(self, now: datetime) -> str:
        """ACTIVE (served and valid), FAILING (valid but the last renewal attempt failed),
        EXPIRED, NOT_YET_VALID or PENDING (no certificate yet)."""
        if self.served is None:
            return "PENDING"
        if now >= self.served.not_after:
            return "EXPIRED"
        if now < self.served.not_before:
            return "NOT_YET_VALID"
        if self.renewal is not None and self.renewal.consecutive_failures:
            return "FAILING"
        return "ACTIVE"

    def lifetime_seconds(self) -> float | None:
        """The served leaf's lifetime as its agent counts it: from when it was obtained (the
        CA backdates NotBefore for clock skew, which would swamp a short lifetime), or from
        NotBefore when the board has no renewal record for this very certificate."""
        served, renewal = self.served, self.renewal
        if served is None:
            return None
        start = served.not_before
        if renewal and renewal.last_renewal and renewal.serial_hex == served.serial_hex:
            start = renewal.last_renewal
        return (served.not_after - start).total_seconds()

    def valid(self, now: datetime) -> bool:
        served = self.served
        return served is not None and served.not_before <= now < served.not_after


def describe_secret(secret: Secret) -> ServedCertificate:
    """The fields the board keeps of a published secret (parsed once, at publish time)."""
    if isinstance(secret, TlsSecret):
        chain = load_certs(secret.cert_chain_pem)
        cert = chain[0]
        kind, count = CERT_CHAIN, len(chain)
    else:
        assert isinstance(secret, RootSecret)
        bundle = load_certs(secret.trusted_ca_pem)
        cert = min(bundle, key=lambda c: c.not_valid_after_utc)
        kind, count = CA_BUNDLE, len(bundle)
    return ServedCertificate(
        type=kind,
        serial_hex=f"{cert.serial_number:x}",
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        certificates=count,
    )


class SecretStatus:
    """The board: served certificates (from the cache) and renewal state (from the scheduler)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: dict[str, ServedCertificate] = {}
        self._renewal: dict[str, RenewalState] = {}

    # -- SecretCache listeners ------------------------------------------------------------

    def on_secret(self, secret: Secret) -> None:
        served = describe_secret(secret)
        with self._lock:
            self._served[secret.name] = served

    def on_secret_removed(self, resource_name: str) -> None:
        self.forget(resource_name)

    # -- scheduler hooks (one call per event) ---------------------------------------------

    def renewed(
        self, resource_name: str, serial_hex: str, at: datetime, next_rotation: datetime
    ) -> None:
        """Certificate `serial_hex` for `resource_name` was obtained (or restored) at `at`; the
        next rotation is due at `next_rotation`. Clears the failure count."""
        with self._lock:
            self._renewal[resource_name] = RenewalState(
                serial_hex=serial_hex, last_renewal=at, next_rotation=next_rotation
            )

    def renewal_failed(self, resource_name: str, message: str, at: datetime) -> None:
        """An attempt to obtain `resource_name`'s certificate failed (it will be retried)."""
        with self._lock:
            state = self._renewal.get(resource_name, RenewalState())
            self._renewal[resource_name] = replace(
                state,
                consecutive_failures=state.consecutive_failures + 1,
                last_error=message,
                last_error_at=at,
            )

    def forget(self, resource_name: str) -> None:
        """`resource_name` is no longer served (node mode: its last pod left the node)."""
        with self._lock:
            self._served.pop(resource_name, None)
            self._renewal.pop(resource_name, None)

    # -- readers --------------------------------------------------------------------------

    def reports(self) -> list[SecretReport]:
        """Every resource name, sorted, with what is known of it."""
        with self._lock:
            names = sorted(self._served.keys() | self._renewal.keys())
            return [
                SecretReport(name, self._served.get(name), self._renewal.get(name))
                for name in names
            ]
