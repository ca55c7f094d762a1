"""What both authority drivers share, written once: the signer and its leaf ledger, their
publication with the agent reports the server hands in (one sink for both), the published trust
bundle, Istio's expiry gauges and the change notification. `self_signed.SelfSignedDriver` and
`plugged.PluggedDriver` differ only in where the next authority comes from and which rule
admits it.

Concurrency: everything here runs on the CA's event loop, except `save_ledger` and `adopt`'s
file writes, which are short; the drivers call the blocking store reads in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cryptography import x509

from ca_server.authority.root_bundle import publish_root_bundle
from ca_server.authority.signer import LocalSigner, anchor_of
from ca_server.authority.slots import Phase, authority_id
from ca_server.fleet import AgentReports, FleetReports, LeafLedger, LedgerSink
from ca_server.metrics import CaMetrics
from certs import DEFAULT_TRUST_DOMAIN, SigningAuthority
from meshca.clock import Clock


@dataclass
class DriverSettings:
    data_dir: Path  # where root-cert.pem and the taint notice are published
    instance: str  # this process's name in audit lines and its leaf-ledger report
    poll_interval: float  # seconds between looks at the shared state or the directory
    ledger_sink: LedgerSink  # where this process's ledger and agent reports are published
    trust_domain: str = DEFAULT_TRUST_DOMAIN  # named in the start-up log line
    # This process's agent reports, published with the ledger: the one table the server builds
    # and its RPC services record into (a driver built alone publishes an empty one).
    agent_reports: AgentReports = field(default_factory=AgentReports)


class DriverCore:
    """The signer, the ledger and the publication steps of an authority driver."""

    def __init__(self, settings: DriverSettings, clock: Clock, metrics: CaMetrics) -> None:
        self.settings = settings
        self.clock = clock
        self._metrics = metrics
        self.ledger = LeafLedger()
        # Told every new authority after `start()` (Kubernetes mode: the root ConfigMaps).
        self.on_change: Callable[[SigningAuthority], None] = lambda authority: None
        self._signer: LocalSigner | None = None

    @property
    def signer(self) -> LocalSigner:
        if self._signer is None:
            raise RuntimeError("the authority driver has not started: await start() first")
        return self._signer

    @property
    def started(self) -> bool:
        return self._signer is not None

    def planned_handover(self) -> datetime | None:
        """When the active authority is planned to stop signing; None: no plan is known (a
        plugged-in CA changes when its operator says so)."""
        return None

    def adopt(
        self,
        authority: SigningAuthority,
        counts_under: str | None,
        client_roots: tuple[x509.Certificate, ...],
        tainted_since: Mapping[str, datetime],
        gauge_root: x509.Certificate | None = None,
    ) -> None:
        """Signs with `authority` from now on (each leaf counted under `counts_under`), then
        publishes `root-cert.pem` with the taint notice, sets Istio's expiry gauges (for
        `gauge_root`; default the bundle's first root to expire), then tells `on_change` (the
        server sets it after `start()`: Kubernetes mode publishes the first authority as it
        starts)."""
        if self._signer is None:
            self._signer = LocalSigner(authority, self.ledger, self.clock)
        self._signer.use(authority, counts_under, client_roots, tainted_since)
        publish_root_bundle(self.settings.data_dir, authority, tainted_since)
        self._metrics.record_authority(authority, root=gauge_root)
        self.on_change(authority)

    def agents(self, now: datetime) -> FleetReports:
        """Every CA process's agent reports, merged (blocking: a worker thread): what the
        JWT-SVID key's activation gate counts (`ca_server.jwt_svid`)."""
        return self.settings.ledger_sink.agents(now)

    def root_phases(self) -> dict[str, Phase]:
        """Each root of the bundle by authority ID, with its phase (what the ClusterTrustBundles
        are labelled with). Without slots (a plugged-in CA) it is read off the bundle: the root
        the signing chain ends at is active, a newer one prepared (the operator's A+B step), an
        older one old (the B-only step has not come yet)."""
        authority = self.signer.authority
        anchor = anchor_of(authority)
        phases = {}
        for root in authority.roots:
            if anchor is None or root == anchor:
                phase = Phase.ACTIVE
            elif root.not_valid_before_utc > anchor.not_valid_before_utc:
                phase = Phase.PREPARED
            else:
                phase = Phase.OLD
            phases[authority_id(root)] = phase
        return phases

    def save_ledger(self) -> None:
        """Publishes this process's ledger and agent reports (blocking: worker thread)."""
        self.settings.ledger_sink.save(self.ledger, self.settings.agent_reports, self.clock.now())
