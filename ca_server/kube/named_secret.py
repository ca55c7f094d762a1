"""One Secret the CA owns, by name: read it (absent → None) and create or replace it with the
resourceVersion read, so concurrent writers never overwrite each other.

Both stores of shared signing state use it — the authority slots (`secret_root`, Secret
`istio-ca-secret`) and the JWT-SVID keys (`ca_server.jwt_svid.kube_store`, Secret
`meshca-jwt-keys`) — so both say the same about a conflict, a refusal and what RBAC to grant,
and both change their state with one optimistic loop (`transact`).

Concurrency: blocking calls; the stores run them in worker threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.errors import CaSetupError
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT = (3.0, 10.0)
_NOT_FOUND, _CONFLICT = 404, 409
ATTEMPTS = 10

State = TypeVar("State")


class NamedSecret:
    """Secret `namespace/name`, called `description` in logs and errors; `verbs` is what RBAC
    must grant on it by name (said on a 401 or 403, with `create` on secrets)."""

    def __init__(self, core: Any, namespace: str, name: str, description: str, verbs: str) -> None:
        self._core = core
        self.namespace = namespace
        self.name = name
        self.description = description
        self._verbs = verbs

    def read(self) -> Any:
        """The Secret, or None when it does not exist."""
        try:
            return self._core.read_namespaced_secret(
                self.name, self.namespace, _request_timeout=_REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == _NOT_FOUND:
                return None
            raise CaSetupError(self._api_failure("read", exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise CaSetupError(f"cannot read {self.description}: {exc}") from exc

    def write(self, current: Any, data: Mapping[str, str | bytes], secret_type: str) -> bool:
        """Creates the Secret (`current` None) or replaces `current` with `data`; False when
        another writer got there first (409, or it was deleted meanwhile): re-read and retry."""
        metadata = kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace)
        if current is not None:
            metadata = current.metadata
        body = kubernetes.client.V1Secret(
            api_version="v1", kind="Secret", metadata=metadata, type=secret_type, data={**data}
        )
        try:
            if current is None:
                self._core.create_namespaced_secret(
                    self.namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
                log.info("created %s", self.description)
            else:
                self._core.replace_namespaced_secret(
                    self.name, self.namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
        except ApiException as exc:
            if exc.status in (_CONFLICT, _NOT_FOUND):
                log.info(
                    "%s changed concurrently (HTTP %s); re-reading", self.description, exc.status
                )
                return False
            raise CaSetupError(self._api_failure("write", exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise CaSetupError(f"cannot write {self.description}: {exc}") from exc
        return True

    def transact(
        self,
        decode: Callable[[Any], tuple[State, bool]],
        first: Callable[[], State],
        change: Callable[[State], State | None],
        write: Callable[[Any, State], bool],
    ) -> State:
        """Read, `change`, write with the resourceVersion read, again after a conflict:
        `decode` turns the Secret into (state, whether it must be rewritten even unchanged),
        `first` is the state to create when there is none, `write(secret, state)` is False
        when another writer got there first. Returns the state stored (`change` returning
        None: nothing to write). Raises `CaSetupError` after `ATTEMPTS` conflicts."""
        for _ in range(ATTEMPTS):
            secret = self.read()
            current, must_write = (first(), True) if secret is None else decode(secret)
            updated = change(current)
            if updated is None and not must_write:
                return current
            final = updated or current
            if write(secret, final):
                return final
        raise CaSetupError(
            f"{self.description} kept changing under {ATTEMPTS} attempts to update it; retry"
        )

    def _api_failure(self, verb: str, exc: ApiException) -> str:
        hint = ""
        if exc.status in (401, 403):
            hint = (
                f"; grant the CA's service account {self._verbs} on Secret {self.name} and "
                f"create on secrets in {self.namespace} (deploy/base/rbac.yaml)"
            )
        return f"cannot {verb} {self.description}: {api_error_text(exc)}{hint}"
