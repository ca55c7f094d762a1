"""Choosing, at start-up, how the CA gets its signing authority and who keeps it current.

- Self-signed (no plugged-in CA): authority slots shared by every CA process — in Secret
  `istio-ca-secret` in Kubernetes mode, else in `--data-dir` — rotated by one
  `rotation.AuthorityRotator` per process; workload TTLs capped so a rotation never cuts a leaf
  short.
- Plugged-in (`--cacerts-dir`): the directory, re-read by `server.watch_authority`, each change
  checked by a `plugged_rotation.PluggedChangeGuard` before use.

Both keep a leaf ledger published through a `LedgerSink` (per-replica ConfigMaps in Kubernetes
mode, files in `--data-dir` otherwise), which `meshca authority show` and the guard read.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ca_server.authority.agent_reports import AgentReports
from ca_server.authority.leaf_ledger import DirectoryLedgerSink, LeafLedger, LedgerSink
from ca_server.authority.plugged import PluggedChangeGuard, RecordingSigner
from ca_server.authority.root_bundle import AuthoritySource, publish_root_bundle
from ca_server.authority.self_signed import (
    AuthorityRotator,
    RotationSettings,
    cap_leaf_lifetimes,
    rotation_policy_for,
)
from ca_server.authority.signer import LocalSigner
from ca_server.authority.state_store import (
    AuthorityStateStore,
    LocalAuthorityStateStore,
    SlotFactory,
)
from ca_server.config import CaConfig, TtlPolicy
from ca_server.errors import CaSetupError
from ca_server.metrics import CaMetrics
from certs import SigningAuthority
from meshca.clock import Clock

if TYPE_CHECKING:  # `ca_server.kube` imports this package's stores
    from ca_server.kube.mode import KubernetesMode

__all__ = ["AuthoritySetup", "CaSetupError", "set_up_authority"]

log = logging.getLogger(__name__)


@dataclass
class AuthoritySetup:
    """What the server needs: the signer, the TTL policy to grant with, and what keeps the
    authority current (exactly one of `rotator` / `guard` is set)."""

    signer: LocalSigner
    ttl_policy: TtlPolicy
    rotator: AuthorityRotator | None = None
    guard: PluggedChangeGuard | None = None
    agent_reports: AgentReports | None = None  # published with the leaf ledger


def instance_name(config: CaConfig) -> str:
    """This CA process's name in audit lines and in its leaf-ledger report."""
    return config.kube.instance_id if config.kube is not None else f"ca-{os.getpid()}"


def ledger_sink_for(config: CaConfig, kube: KubernetesMode | None) -> LedgerSink:
    """Per-replica ConfigMaps in Kubernetes mode; else files in `--data-dir`."""
    if kube is not None:
        return kube.ledger_sink(instance_name(config))
    return DirectoryLedgerSink(config.data_dir, instance_name(config))


def rotator_for(
    config: CaConfig, metrics: CaMetrics, clock: Clock, kube: KubernetesMode | None
) -> AuthorityRotator:
    """Self-signed authorities shared by every CA process: in Secret `istio-ca-secret` in
    Kubernetes mode, else in `--data-dir`."""
    factory = SlotFactory(config.root_key, config.trust_domain, config.root_lifetime)
    store: AuthorityStateStore = (
        kube.authority_state_store(factory)
        if kube is not None
        else LocalAuthorityStateStore(config.data_dir, factory, clock)
    )
    settings = RotationSettings(
        config.data_dir,
        instance_name(config),
        config.plugged_ca_poll_interval.total_seconds(),
        ledger_sink_for(config, kube),
    )
    return AuthorityRotator(store, rotation_policy_for(config), factory, metrics, clock, settings)


async def set_up_authority(
    config: CaConfig,
    source: AuthoritySource | None,
    metrics: CaMetrics,
    clock: Clock,
    kube: KubernetesMode | None,
) -> AuthoritySetup:
    """Loads the first authority (and publishes `root-cert.pem`); `source` is the plugged-in
    CA, or `None` for self-signed slots. Raises `CaSetupError` for unusable material."""
    if source is None:
        rotator = rotator_for(config, metrics, clock, kube)
        signer = await rotator.start()
        log.info("signing with self-signed authority slots (trust domain %s)", config.trust_domain)
        ttl = cap_leaf_lifetimes(config.ttl, rotator.policy)
        rotator.ledger.agents.pods = kube.report_pods() if kube is not None else None
        return AuthoritySetup(signer, ttl, rotator, agent_reports=rotator.ledger.agents)
    authority = await asyncio.to_thread(source.load, clock.now())
    publish_root_bundle(config.data_dir, authority, {})  # a plugged-in CA has no taints
    log.info("signing with %s (trust domain %s)", source.description, config.trust_domain)
    record_expiry(metrics, authority)
    ledger = LeafLedger()
    guard = PluggedChangeGuard(
        ledger,
        ledger_sink_for(config, kube),
        switch_at_coverage=config.activate_at_coverage,
        deadline_share=config.activate_deadline,
        on_deadline=metrics.plugged_switch_deadline.inc,
    )
    ledger.agents.pods = kube.report_pods() if kube is not None else None
    return AuthoritySetup(
        RecordingSigner(authority, ledger, clock),
        config.ttl,
        guard=guard,
        agent_reports=ledger.agents,
    )


def record_expiry(metrics: CaMetrics, authority: SigningAuthority) -> None:
    """Istio's expiry gauges for a plugged-in CA (the rotator keeps them for slots)."""
    metrics.record_authority(authority)
