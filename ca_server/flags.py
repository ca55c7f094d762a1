"""`meshca ca`'s flags: the table argparse reads (`add_ca_arguments`) and the argument types
that refuse a bad value with a one-line usage error (exit 2) before anything starts.

Defaults that Istio's environment variables may fill in are None here; what the flags mean
together — the environment merged in, the cross-flag checks, the typed `CaConfig` the rest of
the CA is handed — is `ca_server.config`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from ca_server.config import (
    DEFAULT_AUDIENCE,
    LOG_LEVELS,
    RPC_SERVER_CHOICES,
    TOKEN_VALIDATIONS,
    AdmissionPolicy,
)
from ca_server.serving.cpu_scheduling import CPU_SCHEDULING_CHOICES
from ca_server.wire import RENEWAL_HEADER, REPORT_SERVICE, RETRY_PUSHBACK_TRAILER
from certs import DEFAULT_TRUST_DOMAIN, CertsError, KeySpec
from meshca.durations import parse_duration


def duration_argument(text: str) -> timedelta:
    """An argparse type for durations such as `90d`, `24h`, `10m`."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def log_level_argument(text: str) -> str:
    """An argparse type: one of Python's logging level names, any case."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        choices = ", ".join(LOG_LEVELS)
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; use {choices}")
    return level


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` that must be above zero."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be greater than 0")
        return value

    return parse


def _key_spec(text: str) -> KeySpec:
    try:
        return KeySpec.parse(text)
    except CertsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_ca_arguments(ca: argparse.ArgumentParser) -> None:
    """Registers `meshca ca`'s flags. Defaults that Istio's environment variables may fill in
    are None here; `CaConfig.from_args` resolves them from the environment it is handed."""
    ca.add_argument(
        "--data-dir",
        type=Path,
        required=True,
        help="state directory: root key/cert, dev issuer, published root-cert.pem",
    )
    ca.add_argument("--listen", default="127.0.0.1:15012", help="gRPC TLS address")
    ca.add_argument(
        "--mtls-listen",
        default=None,
        help="extra gRPC address that requires a client certificate (renewal over mTLS)",
    )
    ca.add_argument(
        "--monitoring-listen",
        default="127.0.0.1:15014",
        help="HTTP address for /metrics, /healthz, /ready (no identities: see --debug-listen)",
    )
    ca.add_argument(
        "--debug-listen",
        default=None,
        metavar="HOST:PORT",
        help="HTTP address for /debug/ca (identities, serials, authorities) and /metrics, what "
        "`meshca status` reads of a CA; off unless given; keep it on loopback (127.0.0.1:15015)",
    )
    ca.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN)
    ca.add_argument(
        "--cacerts-dir",
        type=Path,
        default=None,
        help="plugged-in CA directory (Istio cacerts layout or tls.crt/tls.key/ca.crt)",
    )
    ca.add_argument(
        "--jwks",
        action="append",
        default=[],
        help="JWKS file or URL of a trusted token issuer (repeat with --jwt-issuer)",
    )
    ca.add_argument(
        "--jwt-issuer",
        action="append",
        default=[],
        help="the `iss` of the issuer whose keys the matching --jwks holds",
    )
    ca.add_argument(
        "--audience",
        action="append",
        default=[],
        help=f"accepted token audience (default {DEFAULT_AUDIENCE})",
    )
    ca.add_argument(
        "--dev-issuer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trust the development issuer in --data-dir (default: only if no --jwks)",
    )
    ca.add_argument("--workload-cert-ttl", type=duration_argument, default="24h")
    ca.add_argument("--max-workload-cert-ttl", type=duration_argument, default="90d")
    ca.add_argument("--min-workload-cert-ttl", type=duration_argument, default="10m")
    _add_jwt_svid_arguments(ca)
    ca.add_argument(
        "--root-key",
        type=_key_spec,
        default=KeySpec(),
        help="key type of a generated root: ec-p256 (default), ec-p384, rsa-2048...",
    )
    ca.add_argument(
        "--root-ttl",
        type=duration_argument,
        default="3650d",
        help="lifetime of each self-signed authority (down to seconds, for trying rotation)",
    )
    ca.add_argument(
        "--root-rotation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rotate the self-signed authority by itself (prepare at 1/2 of its life, "
        "activate at 5/6); off: only `meshca authority` changes it",
    )
    ca.add_argument(
        "--root-prepare-cap",
        type=duration_argument,
        default="180d",
        help="prepare the next authority at most this long before the active one expires",
    )
    ca.add_argument(
        "--root-activate-cap",
        type=duration_argument,
        default="90d",
        help="activate it at most this long before the active one expires; also the longest "
        "workload certificate the CA signs, so a rotation never cuts one short",
    )
    ca.add_argument(
        "--activate-at-coverage",
        type=float,
        default=None,
        metavar="F",
        help="self-signed rotation: at the 5/6 point, activate the prepared authority only once "
        "this fraction of the reporting agents trust it (e.g. 0.95); default: by the clock. "
        "Plugged-in CA: take a change that moves signing to another root only once this "
        "fraction of the reporting agents trust that root",
    )
    ca.add_argument(
        "--activate-deadline",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="with --activate-at-coverage: activate anyway (with a WARNING) once this share of "
        "the time between the 5/6 point and the active authority's expiry has passed; leaves "
        "signed meanwhile get at least (1 - SHARE) of the maximum TTL. Plugged-in CA: take a "
        "held-back change to another root anyway (with a WARNING) once this share of the "
        "current signing certificate's remaining life has passed since it was first held [0.5]",
    )
    ca.add_argument(
        "--ca-reload-interval",
        "--authority-poll-interval",
        dest="ca_reload_interval",
        type=duration_argument,
        default="5s",
        help="how often to check the plugged-in CA files or the shared root Secret for changes",
    )
    ca.add_argument(
        "--serving-host",
        action="append",
        default=[],
        help="DNS name or IP for the CA's TLS certificate (repeatable)",
    )
    _add_kubernetes_flags(ca)
    _add_capacity_flags(ca)
    ca.add_argument(
        "--log-level", type=log_level_argument, default="INFO", help="DEBUG, INFO, WARNING, ERROR"
    )


def _add_capacity_flags(ca: argparse.ArgumentParser) -> None:
    capacity = ca.add_argument_group(
        "capacity", "worker processes and admission control (docs/performance.md)"
    )
    capacity.add_argument(
        "--workers",
        type=_positive(int),
        default=None,
        help="CA processes serving the same ports (SO_REUSEPORT) under one supervisor; "
        "default: the CPUs available to meshca (within its CPU quota). 1 runs a single process",
    )
    capacity.add_argument(
        "--max-in-flight",
        type=_positive(int),
        default=AdmissionPolicy.max_in_flight,
        help="requests one worker works on at once; beyond it, UNAVAILABLE with a "
        f"{RETRY_PUSHBACK_TRAILER} hint (default %(default)s)",
    )
    capacity.add_argument(
        "--max-in-flight-renewals",
        type=_positive(int),
        default=None,
        help=f"in-flight level at which renewals ({RENEWAL_HEADER}: 1) are refused "
        "(default: half of --max-in-flight), so first certificates get through first",
    )
    capacity.add_argument(
        "--max-in-flight-reports",
        type=_positive(int),
        default=None,
        help=f"in-flight level at which agent reports ({REPORT_SERVICE}) are "
        "refused (default: a quarter of --max-in-flight, at most the renewals' level); "
        "reports never take a certificate request's slot",
    )
    capacity.add_argument(
        "--cpu-scheduling",
        choices=CPU_SCHEDULING_CHOICES,
        default="batch",
        help="Linux scheduling policy of the CA's threads: batch (SCHED_BATCH: a woken gRPC "
        "thread does not preempt the one signing; same CPU share) or normal "
        "(default %(default)s; docs/performance.md)",
    )
    capacity.add_argument(
        "--rpc-server",
        choices=RPC_SERVER_CHOICES,
        default="auto",
        help="gRPC server: completion-queue (one thread polls grpcio's completion queue and "
        "answers inline; about 4x less CPU per call; the CA refuses to start when the "
        "installed grpcio cannot run it), aio (grpc.aio's server), or auto: the first when the "
        "installed grpcio is a tested release, else the second with a warning "
        "(default %(default)s; docs/performance.md)",
    )
    # Set by the supervisor for its workers only.
    capacity.add_argument("--worker-slot", type=int, default=None, help=argparse.SUPPRESS)
    capacity.add_argument("--worker-ready-file", type=Path, default=None, help=argparse.SUPPRESS)


def _add_kubernetes_flags(ca: argparse.ArgumentParser) -> None:
    kube = ca.add_argument_group(
        "Kubernetes mode",
        "on with --kubeconfig, or automatically with in-cluster credentials: TokenReview "
        "authentication, shared root in Secret istio-ca-secret, root ConfigMaps, node authorizer",
    )
    kube.add_argument(
        "--kubernetes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force Kubernetes mode on/off (default: on with --kubeconfig or in a pod)",
    )
    kube.add_argument("--kubeconfig", type=Path, default=None, help="kubeconfig of this cluster")
    kube.add_argument(
        "--remote-kubeconfig",
        action="append",
        default=[],
        metavar="CLUSTER_ID=PATH",
        help="kubeconfig of a remote cluster whose tokens arrive with `clusterid: CLUSTER_ID`",
    )
    kube.add_argument(
        "--namespace",
        default=None,
        help="the CA's own namespace (Secret, Lease); default $POD_NAMESPACE or istio-system",
    )
    kube.add_argument(
        "--cluster-id",
        default=None,
        help="this cluster's id, as sent in the clusterid header (default $CLUSTER_ID)",
    )
    kube.add_argument(
        "--trusted-node-accounts",
        default=None,
        metavar="NS/SA,...",
        help="service accounts allowed to impersonate pods on their node (ztunnel); "
        "default $CA_TRUSTED_NODE_ACCOUNTS",
    )
    kube.add_argument(
        "--token-review",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="authenticate bearer tokens with TokenReview (Kubernetes mode only)",
    )
    kube.add_argument(
        "--token-validation",
        choices=TOKEN_VALIDATIONS,
        default="tokenreview",
        help="check this cluster's tokens with a TokenReview per new token, or offline against "
        "the issuer's keys and the pod informer (pod-bound tokens only; see docs/kubernetes.md)",
    )
    kube.add_argument(
        "--root-configmaps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish ConfigMap istio-ca-root-cert in every namespace (Kubernetes mode only)",
    )
    kube.add_argument(
        "--istiod-tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="issue istiod's serving certificate into Secret istiod-tls (istiod with "
        "ENABLE_CA_SERVER=false serves xDS over TLS only with it); --no-istiod-tls for a mesh "
        "without istiod",
    )
    kube.add_argument(
        "--istiod-namespace",
        default=None,
        help="istiod's namespace, where Secret istiod-tls goes (default: the CA's namespace)",
    )
    kube.add_argument(
        "--istiod-revisions",
        default="",
        help="comma-separated istiod revisions: each adds istiod-<revision>.<ns>.svc to the "
        "certificate's names",
    )
    kube.add_argument(
        "--istiod-tls-lifetime",
        type=duration_argument,
        default="1h",
        help="lifetime of istiod's serving certificate (renewed at 40%% of it)",
    )
    kube.add_argument(
        "--pod-certificate-signer",
        default="",
        metavar="SIGNER",
        help="answer PodCertificateRequests for this signer name (e.g. meshca.example.com/spiffe) "
        "and publish the roots as its ClusterTrustBundles (docs/pod-certificates.md); off unless "
        "given",
    )
    kube.add_argument(
        "--istio-cluster-trust-bundle",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also write Istio's ClusterTrustBundle istio.io:istiod-ca:root-cert (signer "
        "istio.io/istiod-ca), for Istio's injection templates that project it",
    )
    kube.add_argument(
        "--instance-id",
        default=None,
        help="this replica's name in the leader Lease and API user agent (default $POD_NAME)",
    )
    kube.add_argument(
        "--kube-qps", type=_positive(float), default=50.0, help="TokenReview calls/second"
    )
    kube.add_argument("--kube-burst", type=_positive(int), default=100, help="TokenReview burst")
    kube.add_argument(
        "--kube-list-page-size",
        type=_positive(int),
        default=500,
        help="pods and service accounts per page when the CA lists them (pages are paced at "
        "--kube-qps in a bucket of their own)",
    )
    kube.add_argument(
        "--kube-stream-lists",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the pod and service-account caches' state from the API server's watch "
        "cache (watch-list; an API server without it is listed in pages anyway)",
    )


def _add_jwt_svid_arguments(ca: argparse.ArgumentParser) -> None:
    """JWT-SVIDs (docs/jwt-svid.md): their life, their signing key, the discovery endpoint."""
    ca.add_argument(
        "--jwt-svid-ttl",
        type=duration_argument,
        default="5m",
        help="lifetime of each JWT-SVID (capped by its key's expiry)",
    )
    ca.add_argument(
        "--jwt-key-algorithm",
        choices=("ES256", "ES384", "RS256"),
        default="ES256",
        help="algorithm of a new JWT-SVID signing key (every SPIFFE client verifies these)",
    )
    ca.add_argument(
        "--jwt-key-ttl",
        type=duration_argument,
        default="24h",
        help="lifetime of each JWT-SVID signing key (prepared at 1/2, activated at 5/6)",
    )
    ca.add_argument(
        "--jwks-max-age",
        type=duration_argument,
        default="5m",
        help="how long relying parties may cache the JWKS (Cache-Control max-age); a new key "
        "is published at least this long before it signs",
    )
    ca.add_argument(
        "--jwt-activate-at-coverage",
        type=float,
        default=1.0,
        metavar="F",
        help="at the 5/6 point, activate the prepared JWT-SVID key only once this fraction of "
        "the agents that hold a JWT bundle report holding it (anyway once --activate-deadline "
        "of the time left has passed, or two tokens' lives before the active key expires) [1.0]",
    )
    ca.add_argument(
        "--oidc-listen",
        default=None,
        metavar="HOST:PORT",
        help="HTTP address for OIDC discovery (/.well-known/openid-configuration, /keys); off "
        "unless given",
    )
    ca.add_argument(
        "--oidc-issuer",
        default=None,
        help="the JWT-SVIDs' `iss` and the discovery document's issuer (default "
        "http://<--oidc-listen>)",
    )
