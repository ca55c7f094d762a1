"""The agent's Prometheus metrics, on a per-process `CollectorRegistry`.

A private registry (not prometheus_client's global one) keeps several agents in one test process
from colliding and keeps library metrics out of our exposition. Istio's agent metric names are kept
as they are (docs/reference.md#metrics) so existing dashboards work: they are recorded as ordinary
`meshca_agent_*` Counters and re-exported under Istio's exact names (no `_total`) by
`meshca.prometheus_compat.IstioCounterAliases`, as the CA does.

The per-certificate gauges (`cert_expiry_seconds`, expiry/renewal timestamps, consecutive
failures) are read from one `agent.secret_status.SecretStatus` board at scrape time: time left
is computed from NotAfter and the injected clock then, so it can never go stale, and a secret no
longer served has no series.

Thread-safety: prometheus_client metrics are thread-safe; the status server scrapes from its
own thread while the event loop updates them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.secret_status import CERT_CHAIN, SecretStatus
from agent.secrets import Secret
from meshca.clock import Clock
from meshca.prometheus_compat import IstioCounterAliases

CSR_REQUEST = "csr"


class CounterChild(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class LabeledCounter(Protocol):
    """What other agent modules use of a labelled `prometheus_client.Counter`; they type their
    metrics argument against this so they can be tested with a bare registry."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> CounterChild: ...


class AgentMetrics:
    """Every agent metric, registered on `self.registry`.

    Other agent modules (SDS, file-mounted certs) record through the attributes here rather
    than defining metrics of their own, so the full list lives in one place.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=reg)

        # CA calls, re-exported under Istio's names (docs/reference.md#metrics) by
        # IstioCounterAliases.
        by_type = "request_type"
        self.ca_requests = counter("meshca_agent_ca_requests", "Requests sent to the CA.", by_type)
        self.ca_request_failures = counter(
            "meshca_agent_ca_request_failures", "Requests to the CA that failed.", by_type
        )
        self.ca_retries = counter("meshca_agent_ca_retries", "Requests to the CA retried.", by_type)
        self.ca_latency_ms = counter(
            "meshca_agent_ca_latency_milliseconds",
            "Sum of CA request latencies in milliseconds.",
            by_type,
        )
        reg.register(
            IstioCounterAliases(
                {
                    "num_outgoing_requests": self.ca_requests,
                    "num_failed_outgoing_requests": self.ca_request_failures,
                    "num_outgoing_retries": self.ca_retries,
                    "outgoing_latency": self.ca_latency_ms,
                }
            )
        )
        # meshca additions.
        self.ca_request_seconds = Histogram(
            "meshca_agent_ca_request_seconds",
            "Latency of one CreateCertificate call, by outcome (gRPC status name or OK).",
            ["outcome"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=reg,
        )
        # Whether the CA is reachable, as two timestamps rather than windows over counters: the
        # alert "the latest call got no answer" is then one comparison, true from the first
        # unanswered call after the last answer, however long ago that answer was.
        self.ca_last_answer = gauge(
            "meshca_agent_ca_last_answer_timestamp_seconds",
            "When the CA last answered a call (CreateCertificate or the periodic report; any "
            "status it sent, refusals and load-shedding included); 0 before the first answer.",
        )
        self.ca_last_unanswered = gauge(
            "meshca_agent_ca_last_unanswered_timestamp_seconds",
            "When a call to the CA (CreateCertificate or the periodic report) last got no answer "
            "(UNAVAILABLE without a retry hint, DEADLINE_EXCEEDED); 0 if none has failed so.",
        )
        self.rotations = counter(
            "meshca_agent_rotations",
            "Certificates obtained from the CA and published (first one included).",
        )
        self.restores = counter(
            "meshca_agent_certificate_restores",
            "Certificates restored at start-up from the output directory of a previous run.",
        )
        self.rotation_failures = counter(
            "meshca_agent_rotation_failures",
            "Attempts to obtain a certificate that failed (each is retried with backoff).",
        )
        self.taint_resigns = counter(
            "meshca_agent_taint_resigns",
            "Certificates whose renewal was moved forward because the CA tainted their signer.",
        )
        self.taint_notice_refused = counter(
            "meshca_agent_taint_notice_refused",
            "Versions of the taint notice beside the root file (meshca-taints.json) ignored as "
            "malformed, oversized or unreadable (taints already known stay).",
        )
        self.reports = counter(
            "meshca_agent_reports",
            "Periodic reports to the CA (agent.reporter), by outcome (OK or the gRPC status).",
            "outcome",
        )
        by_name = "resource_name"
        self.sds_pushes = counter(
            "meshca_agent_sds_pushes", "Secrets pushed to SDS clients.", by_name
        )
        self.sds_nacks = counter(
            "meshca_agent_sds_nacks", "SDS responses rejected (NACKed) by a client.", by_name
        )
        # The SPIFFE Workload API (`agent.workload.api`); `rpc` is FetchX509SVID or
        # FetchX509Bundles, `reason` a refusal's cause (`agent.workload.api.REFUSAL_REASONS`).
        self.workload_api_streams = Gauge(
            "meshca_agent_workload_api_streams",
            "Workload API streams open right now.",
            ["rpc"],
            registry=reg,
        )
        self.workload_api_responses = counter(
            "meshca_agent_workload_api_responses",
            "Workload API responses sent (the first of a stream and every push after it).",
            "rpc",
        )
        self.workload_api_refusals = counter(
            "meshca_agent_workload_api_refusals",
            "Workload API calls refused, by reason (missing security header, caller not "
            "attested, undecodable request, too many streams, JWT not served).",
            "reason",
        )
        self.file_reload_failures = counter(
            "meshca_agent_file_reload_failures",
            "File-mounted certificates refused (unreadable, mismatched key, expired).",
            by_name,
        )
        # The scheduler (`agent.scheduler`); a pod agent serves one identity.
        self.node_identities = gauge(
            "meshca_agent_node_identities",
            "Identities (namespace/service account) the agent currently serves.",
        )
        self.fetches_in_flight = gauge(
            "meshca_agent_fetches_in_flight",
            "Certificate fetches (key generation + CSR) in progress right now.",
        )
        self.fetches_queued = gauge(
            "meshca_agent_fetches_queued",
            "Identities waiting for a fetch slot (first certificates and due renewals).",
        )
        # The served trust bundle (`agent.trust_bundle`); `source` is one of three values.
        by_source = "source"
        self.trust_bundle_updates = counter(
            "meshca_agent_trust_bundle_updates",
            "Changes of the served trust bundle (ROOTCA, root-cert.pem), by the source that "
            "changed it (root-file, ca-response, restored). No new leaf is requested for them.",
            by_source,
        )
        self.trust_bundle_refused = counter(
            "meshca_agent_trust_bundle_refused",
            "Trust bundles refused (unreadable, not PEM, no CA certificate, expired); the served "
            "bundle stayed as it was.",
            by_source,
        )
        self.trust_bundle_roots = gauge(
            "meshca_agent_trust_bundle_roots", "CA certificates in the served trust bundle."
        )
        self.trust_bundle_retained_roots = gauge(
            "meshca_agent_trust_bundle_retained_roots",
            "Roots kept in the served bundle only because a served certificate chains to them.",
        )
        self.trust_bundle_info = Gauge(
            "meshca_agent_trust_bundle_info",
            "1 for the served trust bundle's digest (first 16 hex digits; one series at a time).",
            ["digest"],
            registry=reg,
        )
        for source in ("root-file", "ca-response", "restored"):
            self.trust_bundle_updates.labels(source)
            self.trust_bundle_refused.labels(source)
        for family in (
            self.ca_requests,
            self.ca_request_failures,
            self.ca_retries,
            self.ca_latency_ms,
        ):
            family.labels(CSR_REQUEST)  # exposed as 0 before the first request
        # Per-resource state, shared with the status server's /debug/secrets.
        self.secrets = SecretStatus()
        reg.register(_SecretStatusCollector(self.secrets, clock))

    def record_ca_request(self, seconds: float, outcome: str, *, answered: bool = True) -> None:
        """One CreateCertificate call: `outcome` is OK or the gRPC status name; `answered` is
        False when the CA never answered it (connection refused, deadline)."""
        self.record_reachability(answered=answered)
        self.ca_requests.labels(CSR_REQUEST).inc()
        self.ca_latency_ms.labels(CSR_REQUEST).inc(seconds * 1000.0)
        self.ca_request_seconds.labels(outcome).observe(seconds)
        if outcome != "OK":
            self.ca_request_failures.labels(CSR_REQUEST).inc()

    def record_reachability(self, *, answered: bool) -> None:
        """Any call to the CA (CSR or periodic report): did the CA answer it?"""
        now = self._clock.now().timestamp()
        (self.ca_last_answer if answered else self.ca_last_unanswered).set(now)

    def record_retry(self) -> None:
        self.ca_retries.labels(CSR_REQUEST).inc()

    def on_secret(self, secret: Secret) -> None:
        """Cache listener: every published secret, from any source, replaces its entry."""
        self.secrets.on_secret(secret)

    def on_secret_removed(self, resource_name: str) -> None:
        """Cache removal listener: a removed secret loses its entry and so its series."""
        self.secrets.on_secret_removed(resource_name)


class _SecretStatusCollector(Collector):
    """Per-resource gauges read from the `SecretStatus` board at scrape time.

    Time left is `NotAfter - now` on the injected clock when scraped, so it never goes stale;
    a resource that stops being served leaves the board and so has no series at the next
    scrape. Renewal gauges exist only for resources the scheduler renews (not file-mounted).
    """

    def __init__(self, board: SecretStatus, clock: Clock) -> None:
        self._board = board
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        reports = self._board.reports()
        now = self._clock.now()

        def family(name: str, help_text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_text, labels=["resource_name"])

        remaining = family(
            "cert_expiry_seconds", "Seconds until the certificate expires (Istio-compatible)."
        )
        expiry = family(
            "meshca_agent_cert_expiry_timestamp_seconds",
            "Unix time at which the certificate (or the first root of a bundle) expires.",
        )
        lifetime = family(
            "meshca_agent_cert_lifetime_seconds",
            "Lifetime of the served leaf, from when it was obtained (NotBefore if unknown).",
        )
        last_renewal = family(
            "meshca_agent_cert_last_renewal_timestamp_seconds",
            "Unix time the certificate now served was obtained (or restored from disk).",
        )
        next_rotation = family(
            "meshca_agent_cert_next_rotation_timestamp_seconds",
            "Unix time the next rotation of this certificate is scheduled.",
        )
        failures = family(
            "meshca_agent_cert_consecutive_renewal_failures",
            "Failed attempts to renew this certificate since the last success.",
        )
        for report in reports:
            labels = [report.resource_name]
            served, renewal = report.served, report.renewal
            if served is not None:
                remaining.add_metric(labels, (served.not_after - now).total_seconds())
                expiry.add_metric(labels, served.not_after.timestamp())
                served_for = report.lifetime_seconds()
                if served.type == CERT_CHAIN and served_for is not None:
                    lifetime.add_metric(labels, served_for)
            if renewal is not None:
                failures.add_metric(labels, renewal.consecutive_failures)
                if renewal.last_renewal is not None:
                    last_renewal.add_metric(labels, renewal.last_renewal.timestamp())
                if renewal.next_rotation is not None:
                    next_rotation.add_metric(labels, renewal.next_rotation.timestamp())
        yield from (remaining, expiry, lifetime, last_renewal, next_rotation, failures)
