"""The mesh's authority slots shared by every CA replica, kept in Secret `istio-ca-secret`.

The Secret's shape: docs/reference.md#root-secret.

An `AuthorityStateStore` (see `ca_server.authority.state_store`). The Secret keeps Istio's
self-signed layout for everything that reads it — `ca-cert.pem` / `ca-key.pem` the *active*
authority, `root-cert.pem` the trust bundle (every slot's certificate while rotating),
`cert-chain.pem` empty (the signing cert is the root), `key.pem` empty as Istio writes it — plus
`meshca-authorities.json`: the slots themselves (see `authority.state_store.encode_state`).

Writes are optimistic: read, change, then create (only one create can win; the losers get 409
and retry on the winner's Secret) or replace with the resourceVersion read (a racing writer
gets 409 and retries on the new state). So replicas waking at the same instant perform a
scheduled step exactly once, and a `meshca authority` command is never lost.

Compatibility: a Secret without the slots key (made by Istio or an older meshca), or whose
`ca-cert.pem` no longer matches the stored active slot (an operator replaced the root the Istio
way), is adopted as it stands: its `ca-cert.pem`/`ca-key.pem` become the only, active slot and
its `root-cert.pem` is kept as written until the next change.

Concurrency: `read`/`transact` block on the API and are called from worker threads.
`fingerprint` must be cheap: it hashes the copy kept by a watch of the one Secret (an
`Informer` in its own thread), never calling the API itself.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
from datetime import datetime
from typing import Any

import kubernetes.client

from ca_server.authority.slots import AuthorityState
from ca_server.authority.state_store import (
    SlotFactory,
    StateChange,
    adopted_state,
    decode_state,
    encode_state,
)
from ca_server.errors import CaSetupError
from ca_server.kube.named_secret import NamedSecret
from certs import cert_to_pem, certs_to_pem, private_key_to_pem
from meshca.clock import Clock
from meshca.informer import Informer

log = logging.getLogger(__name__)

SECRET_NAME = "istio-ca-secret"
SECRET_TYPE = "istio.io/ca-root"
CA_CERT, CA_KEY, ROOT_CERT, CERT_CHAIN, KEY = (
    "ca-cert.pem",
    "ca-key.pem",
    "root-cert.pem",
    "cert-chain.pem",
    "key.pem",
)
SLOTS = "meshca-authorities.json"
SecretData = dict[str, str]  # key -> base64 value, as on the wire


def secret_data_for(state: AuthorityState) -> dict[str, bytes | str]:
    active = state.active
    raw = {
        CA_CERT: cert_to_pem(active.cert),
        CA_KEY: private_key_to_pem(active.key).decode(),
        ROOT_CERT: certs_to_pem(state.bundle),
        CERT_CHAIN: "",
        KEY: "",
        SLOTS: encode_state(state),
    }
    return {key: base64.b64encode(value.encode()).decode() for key, value in raw.items()}


def state_from_secret_data(data: SecretData, now: datetime) -> tuple[AuthorityState, bool]:
    """The slots in the Secret, and whether they had to be adopted from Istio's keys (so the
    caller writes them back). `CaSetupError` names what is wrong."""
    where = f"Secret {SECRET_NAME}"
    try:
        raw = {key: base64.b64decode(value) for key, value in data.items()}
    except ValueError as exc:
        raise CaSetupError(f"{where} holds data that is not base64: {exc}") from exc
    missing = [key for key in (CA_CERT, CA_KEY) if not raw.get(key)]
    if missing:
        raise CaSetupError(f"{where} lacks {missing}; restore it or delete it to start afresh")
    if raw.get(SLOTS):
        state = decode_state(raw[SLOTS], where)
        if cert_to_pem(state.active.cert).encode().strip() == raw[CA_CERT].strip():
            return state, False
        log.warning("%s's ca-cert.pem was replaced outside meshca; adopting it", where)
    return adopted_state(raw[CA_CERT], raw[CA_KEY], now, where), True


def data_fingerprint(data: SecretData | None) -> str:
    if data is None:
        return "<absent>"
    digest = hashlib.sha256()
    for key in sorted(data):
        digest.update(f"{key}={data[key]};".encode())
    return digest.hexdigest()


class KubeAuthorityStateStore:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        factory: SlotFactory,
        clock: Clock,
    ) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self._secret = NamedSecret(
            self._core, namespace, SECRET_NAME, self.description, "get/list/watch/update"
        )
        self._factory = factory
        self._clock = clock
        self._loaded_fingerprint = "<not loaded>"
        # The last state read or written: a deleted Secret is re-created from it, so deleting
        # the Secret cannot silently rotate the mesh's root.
        self._last: AuthorityState | None = None
        self._watch: Informer[SecretData | None] = Informer(
            "secrets",
            functools.partial(self._core.list_namespaced_secret, namespace),
            lambda secret: dict(secret.data or {}),
            list_kwargs={"field_selector": f"metadata.name={SECRET_NAME}"},
        )

    @property
    def description(self) -> str:
        return f"authority slots in Secret {self.namespace}/{SECRET_NAME}"

    def start_watch(self) -> None:
        self._watch.start()

    def stop_watch(self) -> None:
        self._watch.stop()

    def fingerprint(self) -> str:
        if not self._watch.synced:
            return self._loaded_fingerprint
        return data_fingerprint(self._watch.get((self.namespace, SECRET_NAME)))

    def read(self) -> AuthorityState:
        return self.transact(lambda state: None)

    def exists(self) -> bool:
        """Whether the Secret exists (`meshca authority` refuses to create a CA)."""
        return self._read() is not None

    def transact(self, change: StateChange) -> AuthorityState:
        self._last = self._secret.transact(self._decode, self._first, change, self._write)
        return self._last

    def _first(self) -> AuthorityState:
        """No Secret: the last state known (it was deleted), else a first authority."""
        return self._last or self._factory.first_state(self._clock.now())

    def _decode(self, secret: Any) -> tuple[AuthorityState, bool]:
        data = dict(secret.data or {})
        current, must_write = state_from_secret_data(data, self._clock.now())
        self._loaded_fingerprint = data_fingerprint(data)
        return current, must_write

    def _write(self, secret: Any, state: AuthorityState) -> bool:
        """Creates or replaces the Secret; False when another writer got there first."""
        data = secret_data_for(state)
        if not self._secret.write(secret, data, SECRET_TYPE):
            return False
        self._loaded_fingerprint = data_fingerprint({k: str(v) for k, v in data.items()})
        return True

    def _read(self) -> Any:
        return self._secret.read()
