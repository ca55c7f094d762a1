"""Kubernetes mode, composed: the parts `ca_server.server` plugs in when a cluster is configured.

`KubernetesMode` builds the API clients once and hands out the cluster-backed implementations
of the CA's seams — an `AuthorityStateStore` (the authority slots in Secret
`istio-ca-secret`) and this replica's `LedgerSink` (its ConfigMaps), together the
`ca_server.authority.ClusterStores` the authority driver takes; the `PodWatch` the fleet's
table checks reports against; the token `Authenticator`s (TokenReview, or offline validation
against the issuer keys and the pod and ServiceAccount informers) and an `ImpersonationPolicy`
(node authorizer) — and runs the background parts (watches, Lease election, ConfigMap and
ClusterTrustBundle publication, the Pod Certificate signer of `--pod-certificate-signer`)
between `start` and `stop`.

The cluster-wide caches (pods, ServiceAccounts: `ca_server.kube.caches`) are this process's own,
or — in a worker of `meshca ca --workers N` — the supervisor's, asked over its Unix socket
(`ca_server.kube.cache_client`). Nothing waits for them to sync: requests that need them answer
`UNAVAILABLE` with a retry hint until they have, and offline validation falls back to TokenReview.

Concurrency: `start`/`stop` are coroutines on the event loop; anything that blocks (reading the
issuer's keys, releasing the Lease) is pushed to a worker thread. The background parts run
in their own threads (see `ca_server.kube`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime

from ca_server.authn import Authenticator
from ca_server.authority import Signer
from ca_server.authority.slots import authority_id
from ca_server.authority.state_store import SlotFactory
from ca_server.config import CaConfig, KubeConfig, TtlPolicy
from ca_server.impersonation import DenyImpersonation, ImpersonationPolicy
from ca_server.jwt_authn import JwtAuthenticator, TrustedIssuer
from ca_server.kube.bound_tokens import BoundTokenAuthenticator, RemoteClustersOnly
from ca_server.kube.cache_client import RemoteKubeCaches
from ca_server.kube.caches import LocalKubeCaches, cache_needs
from ca_server.kube.clients import KubeClients
from ca_server.kube.issuer_keys import ClusterIssuerKeys
from ca_server.kube.istiod_tls import IstiodTlsPublisher, istiod_hosts
from ca_server.kube.leader import LeaseElector
from ca_server.kube.node_authorizer import NodeAuthorizer
from ca_server.kube.pod_cache import PodLookup
from ca_server.kube.pod_certificates import PodCertificateSigner
from ca_server.kube.ratelimit import AsyncTokenBucket
from ca_server.kube.replica_reports import ConfigMapLedgerSink, ReplicaReportsWatch
from ca_server.kube.report_pods import InformerPodWatch
from ca_server.kube.root_publisher import RootConfigMapPublisher
from ca_server.kube.secret_root import KubeAuthorityStateStore
from ca_server.kube.service_account_cache import AccountLookup
from ca_server.kube.tokenreview import TokenReviewAuthenticator
from ca_server.kube.trust_bundles import Root, TrustBundlePublisher
from ca_server.kube.watched_cache import CacheProgress
from ca_server.metrics import CaMetrics
from certs import SigningAuthority
from meshca.clock import Clock
from meshca.taint_notice import encode_taint_notice

log = logging.getLogger(__name__)


class KubernetesMode:
    def __init__(
        self, config: CaConfig, kube: KubeConfig, metrics: CaMetrics, clock: Clock
    ) -> None:
        self._config = config
        self._clock = clock
        self.kube = kube
        self._metrics = metrics
        self.clients = KubeClients.from_config(kube)
        self._secret_store: KubeAuthorityStateStore | None = None
        offline = kube.token_review and kube.token_validation == "offline"
        self._issuer_keys = (
            ClusterIssuerKeys(self.clients.local, monotonic=clock.monotonic) if offline else None
        )
        # Pods serve the node authorizer and offline token validation, which also checks the
        # token's ServiceAccount, as TokenReview does.
        needs_pods, needs_accounts = cache_needs(kube)
        self.caches: LocalKubeCaches | None = None
        self._remote: RemoteKubeCaches | None = None
        self._pods: PodLookup | None = None
        self._accounts: AccountLookup | None = None
        if config.worker is not None and (needs_pods or needs_accounts):
            self._remote = remote = RemoteKubeCaches(config.worker.cache_socket)
            self._pods = remote.pods if needs_pods else None
            self._accounts = remote.accounts if needs_accounts else None
        else:
            self.caches = LocalKubeCaches(self.clients.local, needs_pods, needs_accounts, kube)
            self._pods, self._accounts = self.caches.pods, self.caches.accounts
        self._elector: LeaseElector | None = None
        self._publisher: RootConfigMapPublisher | None = None
        # Every replica's reports, watched: the self-signed driver reads them every round.
        self._replica_reports = ReplicaReportsWatch(self.clients.local, kube.namespace)
        self._tainted_since: Callable[[], Mapping[str, datetime]] = dict  # set by `start`
        self._root_phases: Callable[[], Mapping[str, str]] = dict  # set by `start`
        self._istiod_tls: IstiodTlsPublisher | None = None
        self._trust_bundles: TrustBundlePublisher | None = None
        publish_bundles = kube.pod_certificate_signer is not None or kube.istio_cluster_trust_bundle
        if kube.publish_root or kube.istiod_tls or publish_bundles:
            self._elector = LeaseElector(
                self.clients.local,
                kube.namespace,
                kube.instance_id,
                lease_duration=kube.lease_duration,
                clock=clock,
                on_change=self._leadership_changed,
            )
        if kube.publish_root and self._elector is not None:
            self._publisher = RootConfigMapPublisher(
                self.clients.local,
                self._elector.is_leader,
                metrics,
                resync_interval=kube.resync_interval,
            )
        if publish_bundles and self._elector is not None:
            self._trust_bundles = TrustBundlePublisher(
                self.clients.local,
                self._elector.is_leader,
                metrics,
                signer=kube.pod_certificate_signer,
                istio_bundle=kube.istio_cluster_trust_bundle,
                resync_interval=kube.resync_interval,
            )
        if kube.istiod_tls and self._elector is not None:
            istiod_namespace = kube.istiod_namespace or kube.namespace
            self._istiod_tls = IstiodTlsPublisher(
                self.clients.local,
                self._elector.is_leader,
                istiod_namespace,
                istiod_hosts(istiod_namespace, kube.istiod_revisions),
                clock,
                lifetime=kube.istiod_tls_lifetime,
                resync_interval=kube.resync_interval,
            )

        self._pod_signer: PodCertificateSigner | None = None
        if kube.pod_certificate_signer and self._elector is not None and self._pods is not None:
            self._pod_signer = PodCertificateSigner(
                self.clients.local,
                kube.pod_certificate_signer,
                is_leader=self._elector.is_leader,
                pods=self._pods,
                accounts=self._accounts,
                trust_domain=config.trust_domain,
                metrics=metrics,
                clock=clock,
                resync_interval=kube.resync_interval,
            )

    # -- the seams -------------------------------------------------------------------------

    def authority_state_store(self, factory: SlotFactory) -> KubeAuthorityStateStore:
        """The authority slots in Secret `istio-ca-secret`, shared by every replica."""
        if self._secret_store is None:
            self._secret_store = KubeAuthorityStateStore(
                self.clients.local, self.kube.namespace, factory, self._clock
            )
        return self._secret_store

    def ledger_sink(self, instance: str) -> ConfigMapLedgerSink:
        """This replica's leaf-ledger report, a ConfigMap in the CA's namespace."""
        return ConfigMapLedgerSink(
            self.clients.local,
            self.kube.namespace,
            instance,
            pods=self.report_pods(),
            watch=self._replica_reports,
        )

    def report_pods(self) -> InformerPodWatch | None:
        """Whether a report's pod still exists (`ca_server.kube.report_pods`); `None` without
        a pod informer (TokenReview without node agents): reports then live until they expire."""
        if self._pods is None:
            return None
        return InformerPodWatch(self._pods, self.kube.cluster_id)

    def token_review_authenticator(self) -> TokenReviewAuthenticator:
        return TokenReviewAuthenticator(
            self.clients,
            audiences=self.kube.audiences,
            trust_domain=self._config.trust_domain,
            limiter=AsyncTokenBucket(self.kube.qps, self.kube.burst, self._clock),
            metrics=self._metrics,
            clock=self._clock,
        )

    def token_authenticators(self) -> list[Authenticator]:
        """This cluster's tokens: TokenReview, or offline validation (with TokenReview kept for
        remote clusters, whose pods this CA does not watch); none with `--no-token-review`.
        Call after `start`: offline validation needs the issuer it has read."""
        if not self.kube.token_review:
            return []
        review = self.token_review_authenticator()
        if self._issuer_keys is None or self._pods is None or self._accounts is None:
            return [review]
        verifier = JwtAuthenticator(
            [TrustedIssuer(self._issuer_keys.issuer, self._issuer_keys, self.kube.audiences)],
            self._config.trust_domain,
            self._clock,
        )
        offline = BoundTokenAuthenticator(
            verifier, self._pods, self._accounts, self.kube.cluster_id, until_synced=review
        )
        if not self.clients.remote:
            return [offline]
        return [offline, RemoteClustersOnly(review, self.kube.cluster_id)]

    def impersonation_policy(self) -> ImpersonationPolicy:
        """The node authorizer when the pod cache serves requests (trusted node accounts or
        offline validation; a cache kept for the Pod Certificate signer alone changes nothing
        here), else refuse."""
        offline = self.kube.token_review and self.kube.token_validation == "offline"
        if self._pods is None or not (self.kube.trusted_node_accounts or offline):
            return DenyImpersonation()
        return NodeAuthorizer(
            self.kube.trusted_node_accounts,
            self._pods,
            self._config.trust_domain,
            self.kube.cluster_id,
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def start(
        self,
        authority: SigningAuthority,
        tainted_since: Callable[[], Mapping[str, datetime]] = dict,
        root_phases: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        """Starts the watches and the election; returns once (for offline token validation)
        the issuer's keys are read, without waiting for the caches to sync. `tainted_since`
        gives the taints the root ConfigMaps carry beside the bundle, `root_phases` each root's
        phase the ClusterTrustBundles are labelled with (both read at each change of the
        authority)."""
        self._tainted_since = tainted_since
        self._root_phases = root_phases
        if self._issuer_keys is not None:
            await asyncio.to_thread(self._issuer_keys.load)
        self._replica_reports.start()  # until it has synced, readers list
        if self._secret_store is not None:
            self._secret_store.start_watch()
        if self._publisher is not None:
            self._publisher.set_root(authority.root_bundle_pem, self._taint_notice())
            self._publisher.start()
        if self._istiod_tls is not None:
            self._istiod_tls.set_authority(authority)
            self._istiod_tls.start()
        if self._pod_signer is not None:
            self._pod_signer.start()  # answers once `sign_pod_certificates` gave it a signer
        if self._trust_bundles is not None:
            self._set_trust_bundles(authority)
            self._trust_bundles.start()
        if self._elector is not None:
            self._elector.start()
        if self.caches is not None:
            self.caches.start()
        if self._remote is not None:
            self._remote.start(self._pods is not None, self._accounts is not None)

    def sign_pod_certificates(
        self,
        signer: Signer,
        ttl_policy: TtlPolicy,
        planned_handover: Callable[[], datetime | None],
    ) -> None:
        """Starts answering PodCertificateRequests (when `--pod-certificate-signer` is set)
        with the CA's signer, its TTL policy and its authority's planned handover."""
        if self._pod_signer is not None:
            self._pod_signer.use(signer, ttl_policy, planned_handover)

    def cache_progress(self) -> list[CacheProgress]:
        """The caches this process holds (none in a worker: the supervisor shows its own)."""
        return self.caches.progress() if self.caches is not None else []

    def authority_changed(self, authority: SigningAuthority) -> None:
        """A new bundle or a new taint (the authority driver calls this at every change)."""
        if self._publisher is not None:
            self._publisher.set_root(authority.root_bundle_pem, self._taint_notice())
        if self._istiod_tls is not None:
            self._istiod_tls.set_authority(authority)
        if self._trust_bundles is not None:
            self._set_trust_bundles(authority)

    def _taint_notice(self) -> str:
        return encode_taint_notice(self._tainted_since())

    def _set_trust_bundles(self, authority: SigningAuthority) -> None:
        """Each root with its phase and taint, for the ClusterTrustBundles (a root the driver
        names no phase for is counted active: it is in the bundle, so pods must trust it)."""
        assert self._trust_bundles is not None
        phases, tainted = self._root_phases(), self._tainted_since()
        roots = []
        for cert in authority.roots:
            ident = authority_id(cert)
            roots.append(Root(cert, ident, str(phases.get(ident, "active")), ident in tainted))
        self._trust_bundles.set_roots(roots, authority.root_bundle_pem)

    async def stop(self) -> None:
        self._replica_reports.stop()
        if self._publisher is not None:
            self._publisher.stop()
        if self._istiod_tls is not None:
            self._istiod_tls.stop()
        if self._pod_signer is not None:
            self._pod_signer.stop()
        if self._trust_bundles is not None:
            self._trust_bundles.stop()
        if self.caches is not None:
            await asyncio.to_thread(self.caches.stop)
        if self._remote is not None:
            self._remote.stop()
        if self._secret_store is not None:
            self._secret_store.stop_watch()
        if self._elector is not None:
            await asyncio.to_thread(self._elector.stop)
        self.clients.close()

    def _leadership_changed(self, leading: bool) -> None:
        self._metrics.root_publisher_leader.set(1 if leading else 0)
        if leading and self._publisher is not None:
            self._publisher.kick()
        if leading and self._istiod_tls is not None:
            self._istiod_tls.kick()
        if self._pod_signer is not None:
            self._pod_signer.leadership_changed(leading)
        if leading and self._trust_bundles is not None:
            self._trust_bundles.kick()
