"""The JWT-SVID keys shared by every CA replica in Kubernetes mode: Secret `meshca-jwt-keys`.

One key, `jwt-authority.json`, holding what `store.encode_jwt_state` writes to the data
directory. Writes are optimistic, as the X.509 slots' Secret (`ca_server.kube.secret_root`):
read, change, then create (one create wins; the losers get 409 and retry on the winner's
Secret) or replace with the resourceVersion read (a racing writer gets 409 and retries), so
replicas starting together create ONE first key and perform a scheduled step once.

A separate Secret from `istio-ca-secret`, so a plugged-in CA (which has no `istio-ca-secret`)
still has JWT-SVIDs and nothing that reads Istio's Secret sees a key it does not know. RBAC:
`get` and `update` on this one name, `create` on secrets (deploy/base/rbac.yaml).

`fingerprint` reads the Secret's resourceVersion (one GET per poll of the driver, in a worker
thread). The last state read or written is kept: a deleted Secret is re-created from it, so
deleting it cannot silently rotate the trust domain's JWT key.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import kubernetes.client

from ca_server.errors import CaSetupError
from ca_server.jwt_svid.keys import JwtKeyState
from ca_server.jwt_svid.store import (
    JWT_STATE_FILE,
    JwtKeyFactory,
    JwtStateChange,
    decode_jwt_state,
    encode_jwt_state,
)
from ca_server.kube.named_secret import NamedSecret
from meshca.clock import Clock

log = logging.getLogger(__name__)

JWT_SECRET_NAME = "meshca-jwt-keys"


class KubeJwtKeyStore:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        factory: JwtKeyFactory,
        clock: Clock,
    ) -> None:
        self.namespace = namespace
        self._secret = NamedSecret(
            kubernetes.client.CoreV1Api(api),
            namespace,
            JWT_SECRET_NAME,
            self.description,
            "get/update",
        )
        self._factory = factory
        self._clock = clock
        self._last: JwtKeyState | None = None

    @property
    def description(self) -> str:
        return f"JWT-SVID keys in Secret {self.namespace}/{JWT_SECRET_NAME}"

    def read(self) -> JwtKeyState:
        return self.transact(lambda state: None)

    def exists(self) -> bool:
        """Whether the Secret exists (`meshca authority --jwt` never creates the first key)."""
        return self._get() is not None

    def fingerprint(self) -> str:
        secret = self._get()
        return "<absent>" if secret is None else str(secret.metadata.resource_version)

    def transact(self, change: JwtStateChange) -> JwtKeyState:
        self._last = self._secret.transact(
            lambda secret: (self._decode(secret), False), self._first, change, self._write
        )
        return self._last

    def _first(self) -> JwtKeyState:
        """No Secret: the last state known (it was deleted), else a first key."""
        return self._last or self._factory.first_state(self._clock.now())

    def _decode(self, secret: Any) -> JwtKeyState:
        where = f"Secret {self.namespace}/{JWT_SECRET_NAME}"
        encoded = (secret.data or {}).get(JWT_STATE_FILE)
        if not encoded:
            raise CaSetupError(f"{where} lacks {JWT_STATE_FILE}; delete it to start afresh")
        try:
            text = base64.b64decode(encoded)
        except ValueError as exc:
            raise CaSetupError(f"{where} holds data that is not base64: {exc}") from None
        return decode_jwt_state(text, where)

    def _write(self, secret: Any, state: JwtKeyState) -> bool:
        """Creates or replaces the Secret; False when another writer got there first."""
        encoded = base64.b64encode(encode_jwt_state(state).encode()).decode()
        return self._secret.write(secret, {JWT_STATE_FILE: encoded}, "Opaque")

    def _get(self) -> Any:
        return self._secret.read()
