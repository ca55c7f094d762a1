"""Which replica writes the root ConfigMaps: a `coordination.k8s.io/v1` Lease.

The classic Kubernetes election (client-go's `leaderelection`, simplified): every replica tries
to acquire or renew the Lease every few seconds. A replica may take the Lease only when it is
free or its holder has not renewed for `leaseDurationSeconds`; every write carries the
resourceVersion it read, so two replicas racing for an expired Lease cannot both win (one gets
409 Conflict). A leader considers itself leader only until `renew_deadline` after its last
successful renewal — shorter than the lease duration — so it stops writing before anyone else
may take over, even if it cannot reach the API server to learn it lost.

Concurrency: runs in its own daemon thread. `is_leader()` may be called from any thread (it
reads one float). `on_change(bool)` is called from the election thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from meshca.clock import Clock
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "meshca-root-publisher"
_REQUEST_TIMEOUT = (2.0, 5.0)
_NOT_FOUND, _CONFLICT = 404, 409


class LeaseElector:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        identity: str,
        *,
        name: str = DEFAULT_LEASE_NAME,
        lease_duration: timedelta = timedelta(seconds=15),
        clock: Clock,
        on_change: Callable[[bool], None] = lambda leading: None,
    ) -> None:
        self._api = kubernetes.client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._duration = lease_duration
        self._renew_deadline = lease_duration.total_seconds() * 2 / 3
        self._retry = max(lease_duration.total_seconds() / 5, 0.2)
        self._on_change = on_change
        self._clock = clock
        self._leading_until = 0.0
        self._was_leading = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-elector", daemon=True)

    def is_leader(self) -> bool:
        return self._clock.monotonic() < self._leading_until

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the election loop and, if leading, releases the Lease so a peer takes over now
        instead of after it expires. Blocking: call from a worker thread."""
        self._stopping.set()
        self._thread.join(timeout=self._renew_deadline)
        if self.is_leader():
            self._leading_until = 0.0
            self._release()

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = self._clock.monotonic()
            try:
                acquired = self.try_acquire_or_renew()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                # Unknown outcome: keep leading until the renew deadline runs out.
                detail = api_error_text(exc) if isinstance(exc, ApiException) else exc
                log.warning("could not renew Lease %s/%s: %s", self.namespace, self.name, detail)
            except Exception:
                # Same, for the unexpected: the election thread must not end (a replica that
                # silently stops competing can never take over from a failed leader).
                log.exception("election round for Lease %s/%s failed", self.namespace, self.name)
            else:
                self._leading_until = started + self._renew_deadline if acquired else 0.0
            self._notify()
            self._stopping.wait(self._retry)

    def _notify(self) -> None:
        leading = self.is_leader()
        if leading != self._was_leading:
            self._was_leading = leading
            log.info(
                "%s the root-publisher Lease %s/%s",
                "acquired" if leading else "lost",
                self.namespace,
                self.name,
            )
            self._on_change(leading)

    def try_acquire_or_renew(self) -> bool:
        """One election round: True if this replica holds the Lease afterwards."""
        now = self._clock.now()
        try:
            lease = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=_REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status != _NOT_FOUND:
                raise
            return self._create(now)
        spec = lease.spec or kubernetes.client.V1LeaseSpec()
        holder = spec.holder_identity
        if holder and holder != self.identity and not _expired(spec, now):
            return False
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = int(self._duration.total_seconds())
        spec.renew_time = now
        lease.spec = spec
        return self._replace(lease)

    def _create(self, now: datetime) -> bool:
        body = kubernetes.client.V1Lease(
            api_version="coordination.k8s.io/v1",
            kind="Lease",
            metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=kubernetes.client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=int(self._duration.total_seconds()),
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        try:
            self._api.create_namespaced_lease(
                self.namespace, body, _request_timeout=_REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == _CONFLICT:
                return False
            raise
        return True

    def _replace(self, lease: Any) -> bool:
        """Writes with the resourceVersion read: a concurrent writer makes this a 409."""
        try:
            self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=_REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == _CONFLICT:
                return False
            raise
        return True

    def _release(self) -> None:
        try:
            lease = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=_REQUEST_TIMEOUT
            )
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.renew_time = None
            lease.spec.acquire_time = None
            self._replace(lease)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            log.info("could not release Lease %s/%s: %s", self.namespace, self.name, exc)


def _expired(spec: Any, now: datetime) -> bool:
    renewed = spec.renew_time or spec.acquire_time
    if renewed is None:
        return True
    if renewed.tzinfo is None:
        renewed = renewed.replace(tzinfo=UTC)
    duration = timedelta(seconds=spec.lease_duration_seconds or 0)
    return bool(now >= renewed + duration)
