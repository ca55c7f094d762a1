"""Publishes the CA's roots as ClusterTrustBundles (`certificates.k8s.io/v1`) for its signer.

With `--pod-certificate-signer SIGNER`, every root of the trust bundle the CA publishes (the
same roots as ConfigMap `istio-ca-root-cert`) gets a bundle of its own: signer SIGNER, named
`<SIGNER with / → :>:<first 16 hex digits of the root's SHA-256>`, holding that root's PEM and
labelled (docs/trust-bundles.md):

- `meshca.io/trust: "true"` on every root a pod must trust — the selector pods project with
  (`signerName` + `labelSelector: {matchLabels: {meshca.io/trust: "true"}}`). Every root in the
  bundle has it: a prepared one (so pods trust it before it signs), the active one, an old one
  (tainted or not: leaves it signed are still live). A revoked or dropped root has left the
  bundle, so its ClusterTrustBundle is deleted.
- `meshca.io/phase: prepared | active | old` and `meshca.io/tainted: "true" | "false"`: where
  the root is in its rotation (`ca_server.authority.slots`), for operators and narrower
  selectors; `meshca.io/authority`: its authority ID as `meshca authority show` prints it.
- `app.kubernetes.io/managed-by: meshca` on every bundle this module writes.

Every other bundle of SIGNER is deleted: only meshca may say what a pod selecting SIGNER
trusts. With `--istio-cluster-trust-bundle` it also writes Istio's own bundle
`istio.io:istiod-ca:root-cert` (signer `istio.io/istiod-ca`) with the whole bundle, as istiod
does, and leaves the other bundles of Istio's signer alone.

The shape is `root_publisher`'s: level-triggered (a watch of SIGNER's bundles, one of Istio's
by name, the roots handed in by `set_roots`, leadership; any change wakes one pass comparing
what exists with what is wanted), only the Lease holder writes, an update or delete carries the
resourceVersion read (a racing writer gets 409 and the next pass re-reads), and a periodic pass
repairs what a lost event left. A pass writes creates and updates before deletes. `spec.signerName`
is immutable, but a bundle's name fixes its signer (the API server requires the prefix), so a
bundle of the wrong signer can never sit under a name meshca wants. Writing a bundle of a
signer needs verb `attest` on `certificates.k8s.io/signers` for it (the API server's
ClusterTrustBundleAttest admission); deleting one does not.

Every replica, leader or not, compares its watch with what it wants after each change, so its
gauges (which `meshca status` reads) say on any replica how many bundles are published and
whether they are in step.

Concurrency: as `root_publisher` — the reconciler in its own daemon thread, woken through a
`threading.Event` by the watch threads, the election thread and the event loop (`set_roots`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import kubernetes.client
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ca_server.kube.reconcile_loop import ReconcileThread, guarded_write
from ca_server.metrics import CaMetrics
from certs import cert_to_pem
from meshca.informer import Informer

log = logging.getLogger(__name__)

TRUST_LABEL = "meshca.io/trust"
PHASE_LABEL = "meshca.io/phase"
TAINTED_LABEL = "meshca.io/tainted"
AUTHORITY_LABEL = "meshca.io/authority"
MANAGED_LABELS = {"app.kubernetes.io/managed-by": "meshca"}
TRUST_SELECTOR = {TRUST_LABEL: "true"}
"""The `matchLabels` a pod's `clusterTrustBundle` projection uses (with the signer name)."""
ISTIO_SIGNER = "istio.io/istiod-ca"
ISTIO_BUNDLE_NAME = "istio.io:istiod-ca:root-cert"
_FINGERPRINT_DIGITS = 16
_LABEL_VALUE_MAX = 63
_REQUEST_TIMEOUT = (2.0, 5.0)


@dataclass(frozen=True)
class Root:
    """One root of the bundle and where it is in its rotation."""

    cert: x509.Certificate
    authority: str  # its authority ID (Subject Key ID, hex)
    phase: str  # prepared | active | old
    tainted: bool = False


@dataclass(frozen=True)
class Bundle:
    """A ClusterTrustBundle as this module compares it: wanted, or as the watch saw it."""

    name: str
    signer: str
    trust_bundle: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str] | None = None
    resource_version: str | None = None


def bundle_prefix(signer: str) -> str:
    """The name prefix the API server requires of a bundle of `signer`."""
    return signer.replace("/", ":") + ":"


def root_bundle_name(signer: str, cert: x509.Certificate) -> str:
    """`<signer, / → :>:<16 hex digits of the root's SHA-256>`: stable per root, so a root
    keeps its bundle through its whole rotation, and distinct for two roots of one key."""
    digest = hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()
    return bundle_prefix(signer) + digest[:_FINGERPRINT_DIGITS]


def wanted_bundles(
    signer: str | None, roots: list[Root], istio_bundle: str | None
) -> dict[str, Bundle]:
    """Every bundle meshca wants, by name: one per root for `signer` (None: none), and Istio's
    holding `istio_bundle` (None: not written)."""
    wanted = {}
    for root in roots:
        if signer is None:
            break
        name = root_bundle_name(signer, root.cert)
        labels = {
            **MANAGED_LABELS,
            **TRUST_SELECTOR,
            PHASE_LABEL: root.phase,
            TAINTED_LABEL: "true" if root.tainted else "false",
            AUTHORITY_LABEL: root.authority[:_LABEL_VALUE_MAX],
        }
        wanted[name] = Bundle(name, signer, cert_to_pem(root.cert), labels)
    if istio_bundle is not None:
        wanted[ISTIO_BUNDLE_NAME] = Bundle(
            ISTIO_BUNDLE_NAME, ISTIO_SIGNER, istio_bundle, dict(MANAGED_LABELS)
        )
    return wanted


def in_step(existing: Bundle, wanted: Bundle) -> bool:
    """Same signer and roots, and every label meshca sets (others' labels are kept)."""
    return (
        existing.signer == wanted.signer
        and existing.trust_bundle == wanted.trust_bundle
        and all(existing.labels.get(k) == v for k, v in wanted.labels.items())
    )


@dataclass(frozen=True)
class Plan:
    """One pass's writes: what to create, update (from what exists), and delete."""

    create: tuple[Bundle, ...]
    update: tuple[tuple[Bundle, Bundle], ...]  # (existing, wanted)
    delete: tuple[Bundle, ...]

    @property
    def empty(self) -> bool:
        return not (self.create or self.update or self.delete)


def plan(existing: Mapping[str, Bundle], wanted: Mapping[str, Bundle]) -> Plan:
    """What makes `existing` (every bundle of meshca's signer, and Istio's if watched) equal to
    `wanted`."""
    return Plan(
        create=tuple(w for name, w in sorted(wanted.items()) if name not in existing),
        update=tuple(
            (existing[name], w)
            for name, w in sorted(wanted.items())
            if name in existing and not in_step(existing[name], w)
        ),
        delete=tuple(e for name, e in sorted(existing.items()) if name not in wanted),
    )


def _bundle_info(obj: Any) -> Bundle:
    meta, spec = obj.metadata, obj.spec
    return Bundle(
        meta.name,
        spec.signer_name or "",
        spec.trust_bundle or "",
        dict(meta.labels or {}),
        dict(meta.annotations or {}),
        meta.resource_version,
    )


def _count_restart(counter: Any, resource: str, cause: str) -> None:
    counter.labels(resource, cause).inc()


class TrustBundlePublisher:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        is_leader: Callable[[], bool],
        metrics: CaMetrics,
        *,
        signer: str | None,
        istio_bundle: bool,
        resync_interval: timedelta = timedelta(seconds=60),
    ) -> None:
        self._api = kubernetes.client.CertificatesV1Api(api)
        self._is_leader = is_leader
        self._metrics = metrics
        self._signer = signer
        self._istio = istio_bundle
        self._resync = resync_interval.total_seconds()
        # Replaced whole, so a pass reads one version: (roots, whole bundle PEM).
        self._wanted: tuple[list[Root], str] | None = None
        # `self.reconcile()` looked up at each pass, not bound now (a test patches it).
        self._loop = ReconcileThread(
            "trust-bundles", lambda: self._resync, lambda: self.reconcile(), log
        )
        restarts = metrics.kube_watch_restarts
        self._informers: list[Informer[Bundle]] = []
        watched = []
        if signer is not None:
            watched.append(("clustertrustbundles", f"spec.signerName={signer}"))
        if istio_bundle:
            watched.append(("clustertrustbundles-istio", f"metadata.name={ISTIO_BUNDLE_NAME}"))
        for resource, selector in watched:
            self._informers.append(
                Informer(
                    resource,
                    self._api.list_cluster_trust_bundle,
                    _bundle_info,
                    list_kwargs={"field_selector": selector},
                    on_change=self.kick,
                    on_restart=functools.partial(_count_restart, restarts, resource),
                )
            )

    # -- called from other threads ---------------------------------------------------------

    def set_roots(self, roots: list[Root], bundle_pem: str) -> None:
        """The roots to publish one by one, and the whole bundle (Istio's)."""
        self._wanted = (list(roots), bundle_pem)
        self.kick()

    def kick(self) -> None:
        self._loop.kick()

    def start(self) -> None:
        for informer in self._informers:
            informer.start()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        for informer in self._informers:
            informer.stop()

    # -- the reconciler thread -------------------------------------------------------------

    def reconcile(self) -> bool:
        """One pass; False if a write failed and the pass should be retried soon."""
        wanted_input = self._wanted
        if wanted_input is None or not all(i.synced for i in self._informers):
            return True  # the sync itself will kick us
        roots, bundle_pem = wanted_input
        wanted = wanted_bundles(self._signer, roots, bundle_pem if self._istio else None)
        existing: dict[str, Bundle] = {}
        for informer in self._informers:
            existing.update({name: b for (_, name), b in informer.items().items()})
        todo = plan(existing, wanted)
        self._record_status(wanted, existing, todo)
        if todo.empty or not self._is_leader():
            return True
        ok = True
        for bundle in todo.create:
            ok &= self._write("create", bundle, None)
        for current, bundle in todo.update:
            ok &= self._write("update", bundle, current)
        for current in todo.delete:
            ok &= self._delete(current)
        return ok

    def _record_status(
        self, wanted: Mapping[str, Bundle], existing: Mapping[str, Bundle], todo: Plan
    ) -> None:
        published = sum(
            1 for name, w in wanted.items() if name in existing and in_step(existing[name], w)
        )
        self._metrics.trust_bundles_wanted.set(len(wanted))
        self._metrics.trust_bundles_published.set(published)
        self._metrics.trust_bundles_in_step.set(1 if todo.empty else 0)

    def _write(self, operation: str, wanted: Bundle, current: Bundle | None) -> bool:
        body = kubernetes.client.V1ClusterTrustBundle(
            api_version="certificates.k8s.io/v1",
            kind="ClusterTrustBundle",
            metadata=kubernetes.client.V1ObjectMeta(
                name=wanted.name,
                labels={**(current.labels if current else {}), **wanted.labels},
                annotations=dict(current.annotations) if current and current.annotations else None,
                resource_version=current.resource_version if current else None,
            ),
            spec=kubernetes.client.V1ClusterTrustBundleSpec(
                signer_name=wanted.signer, trust_bundle=wanted.trust_bundle
            ),
        )

        def call() -> object:
            if current is None:
                return self._api.create_cluster_trust_bundle(
                    body, _request_timeout=_REQUEST_TIMEOUT
                )
            return self._api.replace_cluster_trust_bundle(
                wanted.name, body, _request_timeout=_REQUEST_TIMEOUT
            )

        return guarded_write(
            f"{operation} ClusterTrustBundle {wanted.name}",
            call,
            lambda result: self._metrics.trust_bundle_writes.labels(operation, result).inc(),
            log,
        )

    def _delete(self, current: Bundle) -> bool:
        """Deletes a bundle meshca does not want, only as the watch saw it (a bundle rewritten
        since is looked at again in the next pass)."""
        options = kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(
                resource_version=current.resource_version
            )
        )
        return guarded_write(
            f"delete ClusterTrustBundle {current.name}",
            lambda: self._api.delete_cluster_trust_bundle(
                current.name, body=options, _request_timeout=_REQUEST_TIMEOUT
            ),
            lambda result: self._metrics.trust_bundle_writes.labels("delete", result).inc(),
            log,
        )
