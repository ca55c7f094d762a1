"""Issues istiod's DNS serving certificate into Secret `istiod-tls` (istiod with its CA off).

Why: istiod with `ENABLE_CA_SERVER=false` signs nothing for itself; it serves xDS over TLS only
with the files the istiod chart mounts from Secret `istiod-tls` (`tls.crt`, `tls.key`,
`ca.crt`) and disables its secure discovery port without them. cert-manager's istio-csr writes
that Secret; with meshca as the mesh's CA, meshca does.

What the Secret holds (`wanted_data`): a short-lived (`--istiod-tls-lifetime`, 1 h) serving
certificate for istiod's own DNS names (`istiod`, `istiod-remote`, `istio-pilot` and
`istiod-<revision>` for each listed revision, all `.<ns>.svc`), signed by the *active*
authority, followed by its CA chain; its key; and `ca.crt` = the whole trust bundle. `plan`
decides, from the Secret as it is and the authority now, whether to keep it, refresh only the
bundle and chain (a `prepare` adds the new root to `ca.crt` before any leaf from it exists), or
issue a new certificate: missing or unreadable, other names, not signed by the active authority
(after `activate`; a tainted or revoked one is never active), or past 40% of its life (so it is
renewed well before half-life).

Only the Lease holder writes (`is_leader`, the root publisher's election). The Secret is read by
name (`get`) at every pass rather than watched, so RBAC grants that one name only: a pass runs
when the authority changes, when leadership is gained, when the certificate is due, and every
`resync_interval` (which restores a deleted or edited Secret). Updates carry the
resourceVersion read, so a write racing another writer fails with 409 and the next pass re-reads.

Concurrency: one daemon thread, woken through a `threading.Event` by the event loop
(`set_authority`) and the election thread (`kick`); all its API calls block only that thread.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import kubernetes.client
import urllib3.exceptions
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ca_server.kube.reconcile_loop import ReconcileThread
from certs import (
    CLOCK_SKEW_BACKDATE,
    SigningAuthority,
    build_serving_certificate,
    cert_to_pem,
    certs_to_pem,
    generate_private_key,
    key_matches_certificate,
    load_private_key,
    private_key_to_pem,
)
from meshca.clock import Clock
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

SECRET_NAME = "istiod-tls"
SECRET_TYPE = "kubernetes.io/tls"
CERT_KEY, KEY_KEY, CA_KEY = "tls.crt", "tls.key", "ca.crt"
# The names istiod gives itself (pilot/pkg/bootstrap: its Service and its legacy aliases).
ISTIOD_SERVICE_NAMES = ("istiod", "istiod-remote", "istio-pilot")
LABELS = {"app.kubernetes.io/managed-by": "meshca"}
RENEW_AT_SHARE_OF_LIFE = 0.4
_REQUEST_TIMEOUT = (2.0, 5.0)
_MIN_WAIT = 0.5  # between passes a due date sets: a certificate that is due at once (its
# authority expires sooner than the lifetime) is not re-issued in a tight loop
_NOT_FOUND, _CONFLICT = 404, 409

Action = Literal["keep", "refresh", "issue"]


def istiod_hosts(namespace: str, revisions: Sequence[str] = ()) -> tuple[str, ...]:
    """istiod's DNS names in `namespace`, revisions' `istiod-<rev>` after the fixed ones."""
    names = [*ISTIOD_SERVICE_NAMES, *(f"istiod-{revision}" for revision in revisions)]
    return tuple(f"{name}.{namespace}.svc" for name in names)


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str


def _dns_names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return set(san.get_values_for_type(x509.DNSName))


def renew_at(cert: x509.Certificate) -> datetime:
    """When `cert` is due: 40% into its life, counted from when it was issued (its NotBefore is
    backdated for clock skew; counting from there would make a short lifetime due at once)."""
    end = cert.not_valid_after_utc
    issued = min(cert.not_valid_before_utc + CLOCK_SKEW_BACKDATE, end)
    return issued + (end - issued) * RENEW_AT_SHARE_OF_LIFE


def plan(
    data: Mapping[str, str] | None,
    authority: SigningAuthority,
    hosts: Sequence[str],
    *,
    now: datetime,
) -> Plan:
    """What the Secret (its decoded `data`, None if absent) needs under `authority`."""
    if data is None:
        return Plan("issue", "absent")
    try:
        leaf = x509.load_pem_x509_certificate(data[CERT_KEY].encode())
        key = load_private_key(data[KEY_KEY])
    except (KeyError, ValueError, TypeError):
        return Plan("issue", "unreadable")
    if not key_matches_certificate(key, leaf):
        return Plan("issue", "key does not match certificate")
    if _dns_names(leaf) != set(hosts):
        return Plan("issue", "names changed")
    try:
        leaf.verify_directly_issued_by(authority.cert)
    except (ValueError, TypeError, InvalidSignature):
        return Plan("issue", "not signed by the active authority")
    if now >= renew_at(leaf):
        return Plan("issue", "due for renewal")
    if data != wanted_data(cert_to_pem(leaf), data[KEY_KEY], authority):
        return Plan("refresh", "trust bundle or chain changed")
    return Plan("keep", "current")


def wanted_data(leaf_pem: str, key_pem: str, authority: SigningAuthority) -> dict[str, str]:
    """The Secret's keys: the leaf and its CA chain, its key, and the whole trust bundle."""
    return {
        CERT_KEY: leaf_pem + certs_to_pem(authority.ca_chain),
        KEY_KEY: key_pem,
        CA_KEY: authority.root_bundle_pem,
    }


def issue(
    authority: SigningAuthority, hosts: Sequence[str], *, now: datetime, lifetime: timedelta
) -> dict[str, str]:
    """A new key and serving certificate for `hosts` from `authority`, as the Secret's data."""
    key = generate_private_key()
    leaf = build_serving_certificate(
        key.public_key(), authority.cert, authority.key, hosts=hosts, now=now, lifetime=lifetime
    )
    return wanted_data(cert_to_pem(leaf), private_key_to_pem(key).decode(), authority)


def _decoded(secret: kubernetes.client.V1Secret) -> dict[str, str] | None:
    try:
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
    except (ValueError, UnicodeDecodeError):
        return None


class IstiodTlsPublisher:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        is_leader: Callable[[], bool],
        namespace: str,
        hosts: Sequence[str],
        clock: Clock,
        *,
        lifetime: timedelta = timedelta(hours=1),
        resync_interval: timedelta = timedelta(seconds=60),
    ) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self._is_leader = is_leader
        self.namespace = namespace
        self.hosts = tuple(hosts)
        self._clock = clock
        self._lifetime = lifetime
        self._resync = resync_interval.total_seconds()
        self._authority: SigningAuthority | None = None  # replaced whole
        self._next_due: datetime | None = None
        # `self.reconcile()` looked up at each pass, not bound now (a test may patch it).
        self._loop = ReconcileThread(
            "istiod-tls", self._wait_seconds, lambda: self.reconcile(), log
        )

    # -- called from other threads ---------------------------------------------------------

    def set_authority(self, authority: SigningAuthority) -> None:
        self._authority = authority
        self.kick()

    def kick(self) -> None:
        self._loop.kick()

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    # -- the writer thread -----------------------------------------------------------------

    def _wait_seconds(self) -> float:
        if self._next_due is None:
            return self._resync
        until_due = (self._next_due - self._clock.now()).total_seconds()
        return max(_MIN_WAIT, min(self._resync, until_due))

    def reconcile(self) -> bool:
        """One pass; False if an API call failed and the pass should be retried soon."""
        authority = self._authority
        if authority is None or not self._is_leader():
            return True
        try:
            current = self._core.read_namespaced_secret(
                SECRET_NAME, self.namespace, _request_timeout=_REQUEST_TIMEOUT
            )
        except kubernetes.client.ApiException as exc:
            if exc.status != _NOT_FOUND:
                log.warning("could not read %s: %s", self._where, api_error_text(exc))
                return False
            current = None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("could not read %s: %s", self._where, exc)
            return False
        data = _decoded(current) if current is not None else None
        now = self._clock.now()
        decided = plan(data, authority, self.hosts, now=now)
        if decided.action == "keep":
            self._remember_due(data)
            return True
        if decided.action == "issue" or data is None:
            wanted = issue(authority, self.hosts, now=now, lifetime=self._lifetime)
        else:
            leaf_pem = cert_to_pem(x509.load_pem_x509_certificate(data[CERT_KEY].encode()))
            wanted = wanted_data(leaf_pem, data[KEY_KEY], authority)
        written = self._write(current, wanted, decided)
        if written is None:  # raced another writer: the kicked pass re-reads
            return True
        if written:
            self._remember_due(wanted)
        return written

    @property
    def _where(self) -> str:
        return f"Secret {self.namespace}/{SECRET_NAME}"

    def _remember_due(self, data: Mapping[str, str] | None) -> None:
        if data is None:
            return
        self._next_due = renew_at(x509.load_pem_x509_certificate(data[CERT_KEY].encode()))

    def _write(
        self,
        current: kubernetes.client.V1Secret | None,
        wanted: Mapping[str, str],
        decided: Plan,
    ) -> bool | None:
        """True once written, False on an error to retry, None on a conflict (409)."""
        meta = current.metadata if current is not None else None
        body = kubernetes.client.V1Secret(
            api_version="v1",
            kind="Secret",
            type=SECRET_TYPE,
            metadata=kubernetes.client.V1ObjectMeta(
                name=SECRET_NAME,
                namespace=self.namespace,
                labels={**((meta.labels or {}) if meta else {}), **LABELS},
                annotations=(meta.annotations or None) if meta else None,
                resource_version=meta.resource_version if meta else None,
            ),
            data={k: base64.b64encode(v.encode()).decode() for k, v in wanted.items()},
        )
        try:
            if current is None:
                self._core.create_namespaced_secret(
                    self.namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
            else:
                self._core.replace_namespaced_secret(
                    SECRET_NAME, self.namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
        except kubernetes.client.ApiException as exc:
            if exc.status == _CONFLICT:
                log.info("%s changed under us; will re-read", self._where)
                self.kick()
                return None
            log.warning("could not write %s: %s", self._where, api_error_text(exc))
            return False
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("could not write %s: %s", self._where, exc)
            return False
        verb = "issued a new certificate in" if decided.action == "issue" else "refreshed"
        log.info("%s %s (%s)", verb, self._where, decided.reason)
        return True
