"""The Pod Certificate signer: answers this CA's PodCertificateRequests, one status each.

Only the holder of the CA's Lease (`ca_server.kube.leader`, the one the root publisher
follows) watches the requests for its signer name (`meshca.paged_informer`, field selector
`spec.signerName`) and answers them, so each request is signed by one replica and the others
hold nothing. A replica that gains the Lease first reads the pending requests fresh from the
API server (one LIST) while its watch starts, so it neither waits for the watch to sync nor
re-signs a request the previous leader answered a moment before it stopped. Every status
update carries the resourceVersion the decision was made on: a write that races another writer
is refused (409, or 422 once the request is terminal) and counted as `conflict`, never applied
twice. Under `--workers N` each worker is a
replica with its own Lease identity, so the same rule makes one process the signer (and the
one that watches).

For each pending request (`checks`): the stub CSR's key must be one meshca signs (else
`Denied`/`UnsupportedKeyType`); the pod it names must be in the CA's pod cache with that UID,
service account (and the account's UID when the CA caches accounts), node, and a
`podCertificate` volume for this signer (else `Failed`, saying what did not match — or, for a
pod the cache has not seen yet, wait up to `checks.POD_GRACE`). Then the pod's SPIFFE identity
is signed by the CA's one signer (`ca_server.authority.LocalSigner`, which records the leaf in
the ledger) with the times `timing` chooses, and written with the chain (leaf and CA chain, no
root: the pod trusts the roots the ClusterTrustBundles carry). Each decision is audit-logged
(no key material) and counted (`CaMetrics.pod_certificate_*`).

Concurrency: one daemon thread runs the passes (`reconcile_loop`), woken by the watch, by
leadership changes and by the retry timer of requests waiting for their pod; its API calls and
signing block only that thread. The watch runs in the informer's thread, started and stopped
by the election thread (`leadership_changed`, under a lock with `stop`); pod lookups go to the
local cache (a dictionary read) or, in a worker, over the supervisor's socket.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.authority import Signer
from ca_server.config import TtlPolicy
from ca_server.errors import DependencyUnavailableError
from ca_server.fleet import IssuedLeaf
from ca_server.kube.pod_cache import PodLookup
from ca_server.kube.pod_certificates.checks import (
    POD_GRACE,
    WAIT,
    Refusal,
    request_refusal,
    stub_public_key,
)
from ca_server.kube.pod_certificates.requests import (
    PendingRequest,
    StoredRequest,
    request_from_json,
)
from ca_server.kube.pod_certificates.status import (
    issued_status,
    refused_status,
    status_body,
)
from ca_server.kube.pod_certificates.timing import (
    LifetimeError,
    PodCertificateTimes,
    certificate_times,
    with_not_after,
)
from ca_server.kube.reconcile_loop import run_reconcile_loop
from ca_server.kube.service_account_cache import AccountLookup
from ca_server.metrics import CaMetrics
from ca_server.ttl import Validity
from certs import CertsError, SpiffeId
from meshca.clock import Clock
from meshca.kube_client import api_error_text
from meshca.logs import audit
from meshca.paged_informer import PagedInformer

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT = (2.0, 10.0)
_RETRY_SECONDS = 1.0  # a cache still syncing, a supervisor restarting
_LIST_PAGE = 500
_REUSE_SIGNED = timedelta(minutes=1)  # a status whose write failed is retried as it was
_TERMINAL_MARK = "immutable after PodCertificateRequest is issued"
_NOT_SIGNER = 'is not permitted to "sign"'
Key = tuple[str, str]


@dataclass(frozen=True)
class _Signed:
    """A signed leaf's status, until it is written."""

    at: datetime
    status: dict[str, Any]
    identity: str
    serial: str
    times: PodCertificateTimes


def _full_message(exc: ApiException) -> str:
    """The API server's whole `Status.message` (empty if the body is not a Status)."""
    try:
        status = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return ""
    message = status.get("message") if isinstance(status, dict) else None
    return message if isinstance(message, str) else ""


class PodCertificateSigner:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        signer_name: str,
        *,
        is_leader: Callable[[], bool],
        pods: PodLookup,
        accounts: AccountLookup | None,
        trust_domain: str,
        metrics: CaMetrics,
        clock: Clock,
        resync_interval: timedelta = timedelta(seconds=60),
    ) -> None:
        self.signer_name = signer_name
        # Typed Any: it is called with raw-JSON bodies and `_preload_content=False`.
        self._api: Any = kubernetes.client.CertificatesV1Api(api)
        self._is_leader = is_leader
        self._pods = pods
        self._accounts = accounts
        self._trust_domain = trust_domain
        self._metrics = metrics
        self._clock = clock
        self._resync = resync_interval.total_seconds()
        # Set by `use` once the authority driver has started.
        self._signer: Signer | None = None
        self._ttl: TtlPolicy | None = None
        self._handover: Callable[[], datetime | None] = lambda: None
        self._selector = f"spec.signerName={signer_name}"
        # The watch of the requests, while this replica holds the Lease (None otherwise).
        self.requests: PagedInformer[StoredRequest] | None = None
        self._watch_lock = threading.Lock()
        self._seen: dict[Key, float] = {}  # monotonic time each pending request was first seen
        # (request, resourceVersion) this replica answered, until the watch shows the answer.
        self._written: set[tuple[Key, str]] = set()
        # A signed status whose write failed (not refused): retried as it was, briefly.
        self._unsent: dict[tuple[Key, str], _Signed] = {}
        self._fresh = True  # the next pass lists from the API server (leadership gained)
        self._wait = self._resync
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-certificates", daemon=True)

    # -- called from other threads ---------------------------------------------------------

    def use(
        self,
        signer: Signer,
        ttl_policy: TtlPolicy,
        planned_handover: Callable[[], datetime | None],
    ) -> None:
        """What to sign with: the CA's signer, its TTL policy, its authority's planned handover."""
        self._signer, self._ttl, self._handover = signer, ttl_policy, planned_handover
        self.kick()

    def leadership_changed(self, leading: bool) -> None:
        """Gained: watch the requests and answer the pending ones at once (listed fresh);
        lost: stop watching (the new leader answers)."""
        with self._watch_lock:
            if self._stopping.is_set():
                return
            if leading:
                if self.requests is None:
                    self.requests = self._watch()
                    self.requests.start()
                self._fresh = True
            elif self.requests is not None:
                self.requests.stop()
                self.requests = None
        self.kick()

    def kick(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._watch_lock:
            self._stopping.set()
            if self.requests is not None:
                self.requests.stop()
                self.requests = None
        self._wake.set()

    def _watch(self) -> PagedInformer[StoredRequest]:
        restarts = self._metrics.kube_watch_restarts
        return PagedInformer(
            "podcertificaterequests",
            self._api.list_pod_certificate_request_for_all_namespaces,
            self._first_seen,
            list_kwargs={"field_selector": self._selector},
            on_change=self.kick,
            on_restart=lambda cause: restarts.labels("podcertificaterequests", cause).inc(),
        )

    # -- the informer's transform (watch thread) -------------------------------------------

    def _first_seen(self, obj: dict[str, Any]) -> StoredRequest:
        value = request_from_json(obj)
        if isinstance(value, PendingRequest):
            self._seen.setdefault(value.key, self._clock.monotonic())
        else:
            metadata = obj.get("metadata") or {}
            self._seen.pop((metadata.get("namespace") or "", metadata.get("name") or ""), None)
        return value

    # -- the signer thread -----------------------------------------------------------------

    def _run(self) -> None:
        run_reconcile_loop(self._stopping, self._wake, lambda: self._wait, self._pass_guarded)

    def _pass_guarded(self) -> bool:
        try:
            return self.answer_pending()
        except Exception:
            log.exception("PodCertificateRequest pass failed unexpectedly; retrying")
            return False

    def answer_pending(self) -> bool:
        """One pass over the pending requests (leader only); False: retry soon."""
        self._wait = self._resync
        if not self._is_leader() or self._signer is None:
            return True
        if not self._pods.synced:
            self._wait = _RETRY_SECONDS
            return True
        if self._fresh:
            try:
                pending = self._list_pending()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                detail = api_error_text(exc) if isinstance(exc, ApiException) else exc
                log.warning("could not list the pending PodCertificateRequests: %s", detail)
                return False
            self._fresh = False
        else:
            requests = self.requests
            if requests is None or not requests.synced:
                return True  # the sync will kick
            pending = [v for v in requests.items().values() if isinstance(v, PendingRequest)]
        self._forget_answered(pending)
        pending.sort(key=lambda r: (r.created or self._clock.now(), r.key))
        retry_at: datetime | None = None
        for request in pending:
            if self._stopping.is_set() or not self._is_leader():
                return True
            if (request.key, request.resource_version) in self._written:
                continue
            try:
                waiting = self._answer(request)
            except DependencyUnavailableError as exc:
                log.info("PodCertificateRequests wait for the pod cache: %s", exc.message)
                self._wait = _RETRY_SECONDS
                return True
            if waiting is not None:
                retry_at = waiting if retry_at is None else min(retry_at, waiting)
        if retry_at is not None:
            until = (retry_at - self._clock.now()).total_seconds()
            self._wait = min(self._resync, max(until, _RETRY_SECONDS))
        return True

    def _list_pending(self) -> list[PendingRequest]:
        """The pending requests as the API server holds them now (a consistent read)."""
        pending: list[PendingRequest] = []
        token: str | None = None
        while True:
            response = self._api.list_pod_certificate_request_for_all_namespaces(
                field_selector=self._selector,
                limit=_LIST_PAGE,
                _continue=token,
                _preload_content=False,
                _request_timeout=_REQUEST_TIMEOUT,
            )
            page = json.loads(response.data)
            for obj in page.get("items") or ():
                value = self._first_seen(obj)
                if isinstance(value, PendingRequest):
                    pending.append(value)
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                return pending

    def _forget_answered(self, pending: list[PendingRequest]) -> None:
        still = {(r.key, r.resource_version) for r in pending}
        self._written &= still
        now = self._clock.now()
        self._unsent = {
            k: v for k, v in self._unsent.items() if k in still and now - v.at < _REUSE_SIGNED
        }
        keys = {r.key for r in pending}
        for key in list(self._seen):  # one C call: safe against the watch thread's inserts
            if key not in keys:
                self._seen.pop(key, None)

    def _answer(self, request: PendingRequest) -> datetime | None:
        """Decides and writes one request; returns when to look again if it must wait."""
        now = self._clock.now()
        unsent = self._unsent.get((request.key, request.resource_version))
        if unsent is not None:
            self._issue(request, unsent)
            return None
        key = stub_public_key(request.stub_csr)
        if isinstance(key, Refusal):
            self._refuse(request, key, now)
            return None
        pod = self._pods.get(request.namespace, request.pod_name)
        account_uid = None
        if self._accounts is not None and self._accounts.synced:
            account_uid = self._accounts.uid(request.namespace, request.service_account)
        verdict = request_refusal(request, self.signer_name, pod, account_uid, now)
        if verdict is WAIT:
            return (request.created or now) + POD_GRACE
        if isinstance(verdict, Refusal):
            self._refuse(request, verdict, now)
            return None
        public_key, csr = key
        try:
            identity = SpiffeId(self._trust_domain, request.namespace, request.service_account)
        except CertsError as exc:
            self._refuse(request, Refusal("Failed", "InvalidIdentity", str(exc)), now)
            return None
        assert self._signer is not None and self._ttl is not None
        signer = self._signer
        try:
            times = certificate_times(
                now,
                request.max_expiration_seconds,
                self._ttl,
                signer.authority.not_after,
                self._handover(),
            )
        except LifetimeError as exc:
            self._refuse(request, Refusal("Failed", "LifetimeUnavailable", str(exc)), now)
            return None
        validity = Validity(
            times.not_before,
            times.not_after,
            timedelta(seconds=request.max_expiration_seconds),
            None,
        )
        issued = signer.sign(public_key, identity, validity, csr=csr)
        if issued.not_after != times.not_after:
            # The authority changed between reading its expiry and signing, and cut the leaf
            # short: the status must carry the leaf's own times (the API server re-checks them).
            times = with_not_after(times, issued.not_after, self._handover())
        chain = "".join(issued.cert_chain[:-1])  # leaf and CA chain; the roots come from CTBs
        status = issued_status(chain, times, identity.uri, now)
        self._issue(request, _Signed(now, status, identity.uri, format(issued.serial, "x"), times))
        return None

    def _issue(self, request: PendingRequest, signed: _Signed) -> None:
        """Writes a signed leaf's status; kept for a retry when the write failed."""
        written = self._write(
            request, signed.status, "issued", "Issued", signed.identity, serial=signed.serial
        )
        key = (request.key, request.resource_version)
        if written:
            self._unsent.pop(key, None)
            leaf = IssuedLeaf(signed.identity, signed.serial, signed.at, signed.times.not_after)
            self._metrics.leaves.record(leaf)
        else:
            self._unsent[key] = signed

    def _refuse(self, request: PendingRequest, refusal: Refusal, now: datetime) -> None:
        outcome = refusal.condition.lower()
        self._write(
            request, refused_status(refusal, now), outcome, refusal.reason, None, refusal.message
        )

    def _write(
        self,
        request: PendingRequest,
        status: dict[str, Any],
        outcome: str,
        reason: str,
        identity: str | None,
        detail: str | None = None,
        *,
        serial: str | None = None,
    ) -> bool:
        """The one status update; True when written or answered by someone else (nothing to
        retry), False when it should be retried."""
        try:
            self._api.replace_namespaced_pod_certificate_request_status(
                request.name,
                request.namespace,
                status_body(request, status),
                _request_timeout=_REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            text = api_error_text(exc)
            body = _full_message(exc)  # the logged text is cut short
            raced = exc.status == 409 or (exc.status == 422 and _TERMINAL_MARK in body)
            if raced or exc.status == 404:
                # Another writer answered first, or the request is gone: nothing to do.
                self._written.add((request.key, request.resource_version))
                self._account(request, "conflict", reason, identity, serial, text)
                return True
            if exc.status == 403 or _NOT_SIGNER in body:
                # RBAC (`update` on the status, or `sign` for this signer name): the operator's
                # to fix; the next resync tries again with the status already signed.
                log.error(
                    "could not answer %s: %s (grant what deploy/overlays/pod-certificates "
                    "grants, for signer %s)",
                    request.where,
                    text,
                    self.signer_name,
                )
                self._account(request, "error", reason, identity, serial, text)
                return False
            if exc.status == 422 and outcome == "issued":
                # The API server refused what meshca signed (a bug to report): fail the request
                # rather than leave the kubelet waiting on it.
                log.error("the API server refused the status of %s: %s", request.where, text)
                self._account(request, "error", reason, identity, serial, text)
                refusal = Refusal("Failed", "SignerError", f"the API server refused: {text}")
                return self._write(
                    request,
                    refused_status(refusal, self._clock.now()),
                    "failed",
                    "SignerError",
                    None,
                    refusal.message,
                )
            log.warning("could not write the status of %s: %s", request.where, text)
            self._account(request, "error", reason, identity, serial, text)
            self._wait = _RETRY_SECONDS
            return False
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("could not write the status of %s: %s", request.where, exc)
            self._account(request, "error", reason, identity, serial, str(exc))
            self._wait = _RETRY_SECONDS
            return False
        self._written.add((request.key, request.resource_version))
        seen = self._seen.pop(request.key, None)
        if seen is not None:
            self._metrics.pod_certificate_latency.observe(self._clock.monotonic() - seen)
        self._account(request, outcome, reason, identity, serial, detail)
        return True

    def _account(
        self,
        request: PendingRequest,
        outcome: str,
        reason: str,
        identity: str | None,
        serial: str | None,
        detail: str | None,
    ) -> None:
        self._metrics.pod_certificate_requests.labels(outcome, reason).inc()
        audit(
            "pod-certificate",
            outcome=outcome,
            reason=reason,
            request=request.where,
            request_uid=request.uid,
            pod=f"{request.namespace}/{request.pod_name}",
            node=request.node_name,
            identity=identity,
            serial=serial,
            detail=detail,
            signer=self.signer_name,
        )
