"""The CA's Prometheus metrics: Istio's names (docs/reference.md#metrics) plus meshca's own.

Counters are recorded under meshca's names and re-exported under Istio's exact names by
`meshca.prometheus_compat.IstioCounterAliases`.

With `meshca ca --workers N` each worker records into prometheus-client's multiprocess files
(the supervisor sets `PROMETHEUS_MULTIPROC_DIR` for them) and the supervisor serves one view
(`aggregated_registry`): counters and histograms are summed across workers, dead workers'
counts kept; each gauge says how to combine (`multiprocess_mode`), which a single process ignores.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import values as prometheus_values
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ca_server.fleet import IssuedLeaves
from ca_server.wire import REPORT_SERVICE
from certs import SigningAuthority
from meshca.prometheus_compat import FamilyOf, IstioCounterAliases

# Istio's counter name -> the meshca counter it re-exports.
ISTIO_COUNTER_ALIASES = {
    "citadel_server_csr_count": "meshca_ca_csr_requests",
    "citadel_server_authentication_failure_count": "meshca_ca_authentication_failures",
    "citadel_server_csr_sign_err_count": "meshca_ca_csr_sign_errors",
    "citadel_server_success_cert_issuance_count": "meshca_ca_certificates_issued",
}


def aggregated_registry(multiprocess_dir: Path) -> CollectorRegistry:
    """The supervisor's registry: every worker's metrics summed, plus Istio's aliases."""
    registry = CollectorRegistry()
    workers = MultiProcessCollector(None, path=str(multiprocess_dir))
    registry.register(WithoutRetiredSeries(workers))
    registry.register(
        IstioCounterAliases(
            {alias: FamilyOf(workers, name) for alias, name in ISTIO_COUNTER_ALIASES.items()}
        )
    )
    return registry


def retire_series(gauge: Gauge, *labels: str) -> None:
    """Removes the series `gauge{labels}` (an authority that is gone).

    In multiprocess mode (`meshca ca --workers N`) prometheus-client cannot remove a series: it
    warns, and the worker's file keeps the last value, so the supervisor would go on serving a
    dropped authority's phase or a revoked one's taint. There the series is first set to NaN,
    a value no meshca gauge otherwise takes, which `WithoutRetiredSeries` leaves out.
    """
    if _multiprocess():
        gauge.labels(*labels).set(math.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the multiprocess warning, handled above
        gauge.remove(*labels)


def _multiprocess() -> bool:
    # What the supervisor sets for its workers (`ca_server.serving.workers`), and what
    # prometheus-client reads to choose its multiprocess values.
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


_pid = os.getpid()


def _process_id() -> int:
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


def _use_values_with_a_kept_pid() -> None:
    """In multiprocess mode (a worker of `meshca ca --workers N`) prometheus-client's values
    call `os.getpid()` on every `inc`, `set` and `observe` to notice a fork: a system call
    each (the C library keeps no pid cache), 8 per certificate issued. Its documented hook,
    `MultiProcessValue(process_identifier=...)`, takes a pid this module keeps and renews in a
    forked child, which answers the same. Installed when this module is imported, before any
    metric exists (metrics are made at run time, by `CaMetrics`), so every value shares the
    one class and its files; a process not in multiprocess mode keeps its mutex values."""
    if _multiprocess() and getattr(prometheus_values.ValueClass, "_multiprocess", False):
        os.register_at_fork(after_in_child=_forked)
        prometheus_values.ValueClass = prometheus_values.MultiProcessValue(
            process_identifier=_process_id
        )


_use_values_with_a_kept_pid()


class WithoutRetiredSeries(Collector):
    """The workers' metrics without the gauge series `retire_series` marked as gone. A gauge
    combined across workers is NaN as soon as one live worker has retired it (a sum, or the
    most recent value), so a gone authority leaves the view within one worker's poll."""

    def __init__(self, workers: Collector) -> None:
        self._workers = workers

    def collect(self) -> Iterable[Metric]:
        for family in self._workers.collect():
            if family.type == "gauge":
                family.samples = [s for s in family.samples if not math.isnan(s.value)]
            yield family


class CaMetrics:
    """One registry per CA process (tests start several CAs; no global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.csr_requests = Counter(
            "meshca_ca_csr_requests", "CreateCertificate requests received", registry=r
        )
        self.authn_failures = Counter(
            "meshca_ca_authentication_failures",
            "Requests whose caller was not authenticated",
            ["reason"],
            registry=r,
        )
        self.sign_errors = Counter(
            "meshca_ca_csr_sign_errors",
            "Requests refused or failed after authentication",
            ["error"],
            registry=r,
        )
        self.issued = Counter(
            "meshca_ca_certificates_issued", "Workload certificates issued", registry=r
        )
        self.denials = Counter(
            "meshca_ca_denials", "Requests refused, by reason", ["reason", "code"], registry=r
        )
        self.issuance_latency = Histogram(
            "meshca_ca_issuance_latency_seconds",
            "Time from request arrival to response, for successful issuances",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.granted_ttl = Histogram(
            "meshca_ca_granted_ttl_seconds",
            "Lifetime granted to issued certificates",
            buckets=(60, 600, 3600, 6 * 3600, 86400, 7 * 86400, 30 * 86400, 90 * 86400),
            registry=r,
        )
        self.root_expiry = Gauge(
            "citadel_server_root_cert_expiry_timestamp",
            "Unix time the root certificate expires",
            registry=r,
            # Across workers: the earliest any live worker still signs under.
            multiprocess_mode="livemin",
        )
        self.chain_expiry = Gauge(
            "citadel_server_cert_chain_expiry_timestamp",
            "Unix time the CA's signing chain expires (earliest expiry on the path)",
            registry=r,
            multiprocess_mode="livemin",
        )
        # Lifetimes, so alerts can say "less than a sixth of its life left" instead of a fixed
        # number of days that misfires when lifetimes change.
        self.root_lifetime = Gauge(
            "meshca_ca_root_cert_lifetime_seconds",
            "NotAfter - NotBefore of the root that expires first",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.chain_lifetime = Gauge(
            "meshca_ca_cert_chain_lifetime_seconds",
            "NotAfter - NotBefore of the signing certificate",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.in_flight = Gauge(
            "meshca_ca_requests_in_flight",
            "CreateCertificate requests being handled right now",
            registry=r,
            multiprocess_mode="livesum",
        )
        # Not a metric (unbounded labels): the latest leaf per identity, for `meshca status`.
        self.leaves: IssuedLeaves = IssuedLeaves()
        # Kubernetes mode.
        self.tokenreview_requests = Counter(
            "meshca_ca_tokenreview_requests",
            "TokenReview calls to the API server, by result",
            ["result"],
            registry=r,
        )
        self.tokenreview_cache_hits = Counter(
            "meshca_ca_tokenreview_cache_hits",
            "Bearer tokens accepted from the review cache without an API call",
            registry=r,
        )
        self.root_configmap_writes = Counter(
            "meshca_ca_root_configmap_writes",
            "Writes of the istio-ca-root-cert ConfigMap, by operation and result",
            ["operation", "result"],
            registry=r,
        )
        self.root_publisher_leader = Gauge(
            "meshca_ca_root_publisher_leader",
            "1 while this replica holds the root-publisher Lease (and may write ConfigMaps)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.pod_certificate_requests = Counter(
            "meshca_ca_pod_certificate_requests",
            "PodCertificateRequests answered by this replica's signer, by outcome (issued, "
            "denied, failed; conflict: another writer answered first; error: not written) "
            "and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.pod_certificate_latency = Histogram(
            "meshca_ca_pod_certificate_seconds",
            "From when the signer first saw a PodCertificateRequest to its status written",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.trust_bundle_writes = Counter(
            "meshca_ca_trust_bundle_writes",
            "Writes of the CA's ClusterTrustBundles, by operation (create, update, delete) and "
            "result",
            ["operation", "result"],
            registry=r,
        )
        self.trust_bundles_wanted = Gauge(
            "meshca_ca_trust_bundles_wanted",
            "ClusterTrustBundles the CA wants (one per root for --pod-certificate-signer, plus "
            "Istio's with --istio-cluster-trust-bundle)",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.trust_bundles_published = Gauge(
            "meshca_ca_trust_bundles_published",
            "Of those, how many the API server holds as wanted (this replica's watch)",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.trust_bundles_in_step = Gauge(
            "meshca_ca_trust_bundles_in_step",
            "1 when the ClusterTrustBundles are exactly what the CA wants (nothing to create, "
            "update or delete)",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.kube_watch_restarts = Counter(
            "meshca_ca_kube_watch_restarts",
            "Re-lists of a watched Kubernetes resource, by resource and cause",
            ["resource", "cause"],
            registry=r,
        )
        self.shed = Counter(
            "meshca_ca_requests_shed",
            "Requests refused with UNAVAILABLE and a retry hint because too many were in flight, "
            "by kind (first certificate, renewal or agent report)",
            ["kind"],
            registry=r,
        )
        self.agent_reports = Counter(
            "meshca_ca_agent_reports",
            f"Periodic agent reports ({REPORT_SERVICE}/Report), by outcome: "
            "recorded, or the refusal's reason",
            ["outcome"],
            registry=r,
        )
        # No per-identity series here: this registry is served on the monitoring port, which
        # shows no workload identities (docs/security.md); who reported how often is in the
        # published reports (`callers`) and `meshca authority show ID --agents`.
        self.plugged_switch_deadline = Counter(
            "meshca_ca_plugged_switch_deadline",
            "Plugged-in CA changes to another root taken at the --activate-deadline, below the "
            "coverage --activate-at-coverage asked for",
            registry=r,
        )
        counters = {
            counter._name: counter
            for counter in (self.csr_requests, self.authn_failures, self.sign_errors, self.issued)
        }
        r.register(
            IstioCounterAliases(
                {alias: counters[name] for alias, name in ISTIO_COUNTER_ALIASES.items()}
            )
        )

    def record_authority(
        self, authority: SigningAuthority, root: x509.Certificate | None = None
    ) -> None:
        """Expiry and lifetime gauges for `authority`; called at start and on every reload or
        rotation step so they never describe material the CA no longer signs with. `root` is
        the root they describe (default: the bundle's first to expire)."""
        first_root = root or min(authority.roots, key=lambda r: r.not_valid_after_utc)
        self.root_expiry.set(first_root.not_valid_after_utc.timestamp())
        self.root_lifetime.set(_lifetime_seconds(first_root))
        self.chain_expiry.set(authority.not_after.timestamp())
        self.chain_lifetime.set(_lifetime_seconds(authority.cert))


def _lifetime_seconds(cert: x509.Certificate) -> float:
    return (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
