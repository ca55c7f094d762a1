"""The mesh root shared by every CA replica, kept in Secret `istio-ca-secret`.

The Secret's shape: docs/reference.md#root-secret.

An `AuthoritySource` (see `ca_server.root_store`). `load` reads the Secret; if there is none it
generates a root and *creates* the Secret. Creation is the only write and the API server lets
exactly one create win, so replicas starting at the same instant converge: the losers get 409
AlreadyExists, re-read, and use the winner's root. An existing Secret is never overwritten. If the
Secret is deleted later, the replica re-creates it from the root it is signing with (not a new
one), so a deletion cannot silently rotate the mesh's root.

Layout, as Istio writes it for a self-signed root: `ca-cert.pem` / `ca-key.pem` are the signing
certificate and key, `root-cert.pem` the trust bundle, `cert-chain.pem` the chain from the
signing cert towards the root (empty when the signing cert is the root); `key.pem` is unused by
the CA and written empty, as Istio does.

Concurrency: `load` blocks on the API and is called from a worker thread (`asyncio.to_thread`).
`fingerprint` must be cheap, as the server polls it every few seconds: it hashes the copy kept
by a watch of the one Secret (an `Informer` in its own thread), never calling the API itself.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
from datetime import datetime, timedelta
from typing import Any

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.root_store import CaSetupError
from certs import (
    CertsError,
    KeySpec,
    SigningAuthority,
    cert_to_pem,
    certs_to_pem,
    load_cert,
    load_certs,
    load_private_key,
    make_authority,
    new_self_signed_authority,
    private_key_to_pem,
)
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
_REQUEST_TIMEOUT = (3.0, 10.0)
_NOT_FOUND, _CONFLICT = 404, 409

SecretData = dict[str, str]  # key -> base64 value, as on the wire


def secret_data_for(authority: SigningAuthority) -> dict[str, bytes | str]:
    chain = authority.ca_chain
    raw = {
        CA_CERT: cert_to_pem(authority.cert),
        CA_KEY: private_key_to_pem(authority.key).decode(),
        ROOT_CERT: authority.root_bundle_pem,
        CERT_CHAIN: certs_to_pem(chain) if chain else "",
        KEY: "",
    }
    return {key: base64.b64encode(value.encode()).decode() for key, value in raw.items()}


def authority_from_secret_data(data: SecretData, now: datetime) -> SigningAuthority:
    """Parses and validates the Secret's contents; `CaSetupError` names what is wrong."""
    try:
        raw = {key: base64.b64decode(value) for key, value in data.items()}
        missing = [key for key in (CA_CERT, CA_KEY, ROOT_CERT) if not raw.get(key)]
        if missing:
            raise CaSetupError(f"Secret {SECRET_NAME} lacks {missing}")
        cert = load_cert(raw[CA_CERT], what=CA_CERT)
        key = load_private_key(raw[CA_KEY])
        roots = load_certs(raw[ROOT_CERT], what=ROOT_CERT)
        chain = load_certs(raw[CERT_CHAIN], what=CERT_CHAIN) if raw.get(CERT_CHAIN) else [cert]
        authority = make_authority(cert, key, chain, roots)
        authority.validate(now=now)
    except (CertsError, ValueError) as exc:
        raise CaSetupError(f"Secret {SECRET_NAME} holds an unusable CA: {exc}") from exc
    return authority


def data_fingerprint(data: SecretData | None) -> str:
    if data is None:
        return "<absent>"
    digest = hashlib.sha256()
    for key in sorted(data):
        digest.update(f"{key}={data[key]};".encode())
    return digest.hexdigest()


class KubeSecretRootStore:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        trust_domain: str,
        key_spec: KeySpec,
        lifetime: timedelta,
    ) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self._trust_domain = trust_domain
        self._key_spec = key_spec
        self._lifetime = lifetime
        self._current: SigningAuthority | None = None
        self._loaded_fingerprint = "<not loaded>"
        self._watch: Informer[SecretData | None] = Informer(
            "secrets",
            functools.partial(self._core.list_namespaced_secret, namespace),
            lambda secret: dict(secret.data or {}),
            list_kwargs={"field_selector": f"metadata.name={SECRET_NAME}"},
        )

    @property
    def description(self) -> str:
        return f"shared root in Secret {self.namespace}/{SECRET_NAME}"

    def start_watch(self) -> None:
        self._watch.start()

    def stop_watch(self) -> None:
        self._watch.stop()

    def fingerprint(self) -> str:
        if not self._watch.synced:
            return self._loaded_fingerprint
        return data_fingerprint(self._watch.get((self.namespace, SECRET_NAME)))

    def load(self, now: datetime) -> SigningAuthority:
        secret = self._read()
        if secret is None:
            secret = self._create(now)
        data = dict(secret.data or {})
        authority = authority_from_secret_data(data, now)
        self._current = authority
        self._loaded_fingerprint = data_fingerprint(data)
        return authority

    def _read(self) -> Any:
        try:
            return self._core.read_namespaced_secret(
                SECRET_NAME, self.namespace, _request_timeout=_REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == _NOT_FOUND:
                return None
            raise CaSetupError(self._api_failure("read", exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise CaSetupError(f"cannot read {self.description}: {exc}") from exc

    def _create(self, now: datetime) -> Any:
        """Creates the Secret from the current root (after a deletion) or a new one; if another
        replica won the race, returns the winner's Secret instead."""
        authority = self._current or self._new_root(now)
        body = kubernetes.client.V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=kubernetes.client.V1ObjectMeta(name=SECRET_NAME, namespace=self.namespace),
            type=SECRET_TYPE,
            data=secret_data_for(authority),
        )
        try:
            created = self._core.create_namespaced_secret(
                self.namespace, body, _request_timeout=_REQUEST_TIMEOUT
            )
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise CaSetupError(f"cannot create {self.description}: {exc}") from exc
        except ApiException as exc:
            if exc.status != _CONFLICT:
                raise CaSetupError(self._api_failure("create", exc)) from exc
            log.info("another CA replica created %s first; using its root", self.description)
            winner = self._read()
            if winner is None:
                raise CaSetupError(
                    f"{self.description} was created and deleted concurrently; restart to retry"
                ) from exc
            return winner
        log.info("%s %s", "restored" if self._current else "created", self.description)
        return created

    def _new_root(self, now: datetime) -> SigningAuthority:
        log.info("generating a new %s root for %s", self._key_spec, self._trust_domain)
        return new_self_signed_authority(
            self._key_spec, self._trust_domain, now=now, lifetime=self._lifetime
        )

    def _api_failure(self, verb: str, exc: ApiException) -> str:
        hint = ""
        if exc.status in (401, 403):
            hint = f"; grant the CA's service account get/create on secrets in {self.namespace}"
        return f"cannot {verb} {self.description}: HTTP {exc.status} {exc.reason}{hint}"
