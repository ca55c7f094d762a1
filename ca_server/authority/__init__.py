"""The CA's signing authority: where it comes from, who keeps it current, what it signed.

    AuthorityDriver (protocol)      start · run · signer · ttl_policy · tainted_since
                                    · planned_handover · report · on_change · agents
    ├── self_signed.SelfSignedDriver   authority slots every CA process shares (prepared /
    │     active / old, tainted), in `--data-dir` under its lock (`state_store`) or in Secret
    │     `istio-ca-secret` (`ca_server.kube.secret_root`); rotated on schedule, each step in a
    │     store transaction; workload TTLs capped so a rotation never cuts a leaf short
    └── plugged.PluggedDriver          an operator's CA in `--cacerts-dir` (Istio's `cacerts`
          layout, or `tls.crt`/`tls.key`/`ca.crt`), re-read when its files change, each change
          validated and checked by the guard (`PluggedChangeGuard`) so no workload is stranded

`authority_driver_for()` is the one place that choice is made; `ca_server.server` holds the
result and never asks which kind it has. In Kubernetes mode the shared state lives in the
cluster: the driver takes its store and sink from `ClusterStores` (which
`ca_server.kube.mode.KubernetesMode` implements), never the Kubernetes mode itself. Both
drivers share, once (`driver_core`): the one signer (`signer.LocalSigner`, which records each
leaf in the leaf ledger under the authority it counts under), the ledger's publication with
this process's agent reports (the table the server builds and hands in: files in
`--data-dir`, or per-replica ConfigMaps in Kubernetes mode), `root-cert.pem` and the taint
notice beside it (`root_bundle`), Istio's expiry gauges, and the activation gate's rules
(`ca_server.fleet.gate_coverage`; `slots.gate_deadline` and `slots.gate_verdict`).

The fleet — which leaves are live, which bundle each agent trusts, merged across CA processes —
is its own package below this one (`ca_server.fleet`): the authority reads it, never the other
way round.

Modules:
- `slots`: the pure rules of the self-signed slots (phases, schedule, taints, the gate);
- `state_store`: the slots persisted in `--data-dir` (`data_dir_guard` checks the directory
  first); the Kubernetes store is `ca_server.kube.secret_root`;
- `self_signed`, `plugged`: the two drivers; `driver_core`: what they share;
- `signer`: the one signer (it records each leaf in the fleet's leaf ledger);
- `agent_stragglers`: the agents a rotation waits on, named from the fleet's reports;
- `report`: the slots as `/debug/ca`, `meshca status` and `meshca authority show` print
  them; `fitness`: what `meshca authority` refuses to activate.

`meshca authority` and `meshca status` use this facade (`__all__`) and the fleet's only; the
server uses the driver. Concurrency: a driver's `run()` is one coroutine on the CA's event
loop; store reads and writes (file lock, disk, API server) run in a worker thread;
`signer.sign` runs on the event loop and reads the current authority once per request.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from ca_server.authority.agent_stragglers import agents_section, render_agents
from ca_server.authority.data_dir_guard import check_data_dir, sweep_stale_temporaries
from ca_server.authority.driver_core import DriverSettings
from ca_server.authority.fitness import (
    chain_problem,
    longest_leaf,
    refuse_short_lifetime,
    refuse_unfit,
)
from ca_server.authority.plugged import PluggedDriver, plugged_source_for
from ca_server.authority.report import (
    AuthorityReport,
    ReportSnapshot,
    fleet_coverage,
    report_section,
    show_document,
    status_section,
)
from ca_server.authority.root_bundle import data_dir_lock
from ca_server.authority.self_signed import SelfSignedDriver, audit_events, rotation_policy_for
from ca_server.authority.signer import IssuedCertificate, LocalSigner, Signer
from ca_server.authority.slots import (
    GATE_DEADLINE_REASON,
    GATE_WAITING,
    AuthorityCommandError,
    AuthorityState,
    GateVerdict,
    Phase,
    gate_deadline,
    gate_verdict,
)
from ca_server.authority.state_store import (
    LEGACY_CERT,
    STATE_FILE,
    AuthorityStateStore,
    LocalAuthorityStateStore,
    SlotFactory,
)
from ca_server.config import CaConfig, TtlPolicy
from ca_server.errors import CaSetupError
from ca_server.fleet import AgentReports, DirectoryLedgerSink, FleetReports, LedgerSink
from ca_server.metrics import CaMetrics
from certs import SigningAuthority
from meshca.clock import Clock

__all__ = [
    "GATE_DEADLINE_REASON",
    "GATE_WAITING",
    "AuthorityCommandError",
    "AuthorityDriver",
    "AuthorityReport",
    "AuthorityState",
    "AuthorityStateStore",
    "CaSetupError",
    "ClusterStores",
    "GateVerdict",
    "IssuedCertificate",
    "LocalSigner",
    "Phase",
    "ReportSnapshot",
    "SharedState",
    "Signer",
    "SlotFactory",
    "agents_section",
    "audit_events",
    "authority_driver_for",
    "chain_problem",
    "check_data_dir",
    "data_dir_lock",
    "fleet_coverage",
    "gate_deadline",
    "gate_verdict",
    "longest_leaf",
    "open_shared_state",
    "refuse_short_lifetime",
    "refuse_unfit",
    "render_agents",
    "report_section",
    "show_document",
    "status_section",
    "sweep_stale_temporaries",
]


class AuthorityDriver(Protocol):
    """What the server needs from whichever authority it runs."""

    @property
    def signer(self) -> LocalSigner:
        """Signs with the current authority (available once `start()` returned)."""
        ...

    @property
    def ttl_policy(self) -> TtlPolicy:
        """The workload TTLs to grant (capped under self-signed rotation)."""
        ...

    @property
    def report(self) -> AuthorityReport | None:
        """The slots as `/debug/ca` shows them (`None`: a plugged-in CA has no slots)."""
        ...

    on_change: Callable[[SigningAuthority], None]
    """Told each new authority after `start()` (Kubernetes mode: the root ConfigMaps)."""

    def tainted_since(self) -> dict[str, datetime]:
        """Tainted authorities and since when (what the agent report answers)."""
        ...

    def planned_handover(self) -> datetime | None:
        """When the active authority is planned to stop signing (None: not planned); Pod
        Certificates are refreshed by then (`ca_server.kube.pod_certificates.timing`)."""
        ...

    def agents(self, now: datetime) -> FleetReports:
        """Every CA process's agent reports, merged (blocking: call it in a worker thread)."""
        ...

    def root_phases(self) -> dict[str, Phase]:
        """Each root of the published bundle by authority ID, with its phase (Kubernetes mode
        labels the roots' ClusterTrustBundles with it)."""
        ...

    async def start(self) -> None:
        """Loads the first authority and publishes `root-cert.pem`; raises `CaSetupError`
        for unusable material."""
        ...

    async def run(self) -> None:
        """Keeps the authority current until cancelled (never returns on its own)."""
        ...


class ClusterStores(Protocol):
    """Where the shared state lives when a cluster holds it (Kubernetes mode): the authority
    slots every replica shares, and where this replica publishes its ledger and agent reports."""

    def authority_state_store(self, factory: SlotFactory) -> AuthorityStateStore: ...

    def ledger_sink(self, instance: str) -> LedgerSink: ...


def _instance_name(config: CaConfig) -> str:
    """This CA process's name in audit lines and in its leaf-ledger report."""
    return config.kube.instance_id if config.kube is not None else f"ca-{os.getpid()}"


def authority_driver_for(
    config: CaConfig,
    metrics: CaMetrics,
    clock: Clock,
    agent_reports: AgentReports,
    cluster: ClusterStores | None = None,
) -> AuthorityDriver:
    """The plugged-in driver when `--cacerts-dir` holds a complete layout, else self-signed
    slots shared by every CA process (in the `cluster`'s store, Secret `istio-ca-secret`, in
    Kubernetes mode, else in `--data-dir`). It publishes `agent_reports` (this process's table)
    with its leaf ledger. Raises `CaSetupError` for an unusable `--cacerts-dir`. Not started."""
    source = plugged_source_for(config.cacerts_dir)
    instance = _instance_name(config)
    sink: LedgerSink = (
        cluster.ledger_sink(instance)
        if cluster is not None
        else DirectoryLedgerSink(config.data_dir, instance)
    )
    settings = DriverSettings(
        config.data_dir,
        instance,
        config.plugged_ca_poll_interval.total_seconds(),
        sink,
        config.trust_domain,
        agent_reports,
    )
    driver: SelfSignedDriver | PluggedDriver
    if source is None:
        factory = SlotFactory(config.root_key, config.trust_domain, config.root_lifetime)
        store: AuthorityStateStore = (
            cluster.authority_state_store(factory)
            if cluster is not None
            else LocalAuthorityStateStore(config.data_dir, factory, clock)
        )
        policy = rotation_policy_for(config)
        driver = SelfSignedDriver(store, policy, factory, metrics, clock, settings, config.ttl)
    else:
        driver = PluggedDriver(
            source,
            metrics,
            clock,
            settings,
            config.ttl,
            switch_at_coverage=config.activate_at_coverage,
            deadline_share=config.activate_deadline,
        )
    return driver


@dataclass(frozen=True)
class SharedState:
    """What `meshca authority` and `meshca status` read and change."""

    store: AuthorityStateStore
    ledgers: LedgerSink  # where every CA process publishes its live leaves and agent reports
    exists: bool


@contextlib.contextmanager
def open_shared_state(
    data_dir: Path | None,
    kubeconfig: Path | None,
    namespace: str,
    factory: SlotFactory,
    clock: Clock,
    agent: str,
) -> Iterator[SharedState]:
    """The shared state in `data_dir`, or in the cluster of `kubeconfig` (Secret
    `istio-ca-secret` and the replica ConfigMaps in `namespace`); `agent` names the command to
    the API server. Raises `CaSetupError` for unusable cluster credentials."""
    if data_dir is not None:
        exists = (data_dir / STATE_FILE).exists() or (data_dir / LEGACY_CERT).exists()
        store = LocalAuthorityStateStore(data_dir, factory, clock)
        yield SharedState(store, DirectoryLedgerSink(data_dir, agent), exists)
        return
    # Imported here: the Kubernetes client loads only for `--kubeconfig`.
    from ca_server.kube.clients import build_api_client
    from ca_server.kube.replica_reports import ConfigMapLedgerSink
    from ca_server.kube.secret_root import KubeAuthorityStateStore
    from meshca.kube_client import KubeCredentialsError

    try:
        api = build_api_client(kubeconfig, pool_size=2, user_agent=agent)
    except KubeCredentialsError as exc:
        raise CaSetupError(str(exc)) from None
    try:
        kube_store = KubeAuthorityStateStore(api, namespace, factory, clock)
        ledgers = ConfigMapLedgerSink(api, namespace, agent)
        yield SharedState(kube_store, ledgers, kube_store.exists())
    finally:
        api.close()
