"""The workload's service-account token: read from its file on every request, never cached.

Kubernetes rotates projected tokens in place, so a cached copy would go stale; re-reading costs a
small file read per CA call. A missing or empty file is an error the caller retries (the kubelet
may not have written it yet). The token itself never appears in a log line or exception message.

Also here: reading the identity (namespace, service account) out of the token's claims, for
agents started without POD_NAMESPACE/SERVICE_ACCOUNT. The signature is *not* verified: the CA
verifies the token; the agent only needs to know which identity to ask for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from agent.errors import TokenClaimsError, TokenError, TokenFileEmpty, TokenFileMissing
from certs import SpiffeId, SpiffeIdError
from meshca.accounts import account_from_username

__all__ = [
    "FileTokenProvider",
    "IdentityResolver",
    "TokenClaimsError",
    "TokenError",
    "TokenFileEmpty",
    "TokenFileMissing",
    "TokenProvider",
    "identity_from_token",
]


class TokenProvider(Protocol):
    def token(self) -> str:
        """The current token ("" when running without one), or raises `TokenError`."""
        ...


class FileTokenProvider:
    """Reads the token file each time it is asked.

    `required=False` is for agents that authenticate to the CA another way (a provisioning
    certificate, PROV_CERT): an empty or missing file then yields "" and the CA client omits the
    `authorization` header, as Istio's client does.
    """

    def __init__(self, path: Path, *, required: bool = True) -> None:
        self.path = path
        self.required = required

    def token(self) -> str:
        try:
            text = self.path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            if not self.required:
                return ""
            raise TokenFileMissing(
                f"token file {self.path} does not exist; mount the projected service-account "
                "token there or pass --token-file"
            ) from None
        except OSError as exc:
            raise TokenError(f"token file {self.path} cannot be read: {exc.strerror}") from None
        if not text and self.required:
            raise TokenFileEmpty(
                f"token file {self.path} is empty; the kubelet may not have written it yet"
            )
        return text


def identity_from_token(token: str, trust_domain: str) -> SpiffeId:
    """The SPIFFE ID a Kubernetes service-account token speaks for, from its claims.

    Looks at the `kubernetes.io` claim first (`namespace`, `serviceaccount.name`), then at
    `sub` = `system:serviceaccount:NS:SA`.

    pyjwt is imported here, not at the top: a sidecar told its identity (POD_NAMESPACE and
    SERVICE_ACCOUNT, as injected sidecars are) never reads the claims, and pyjwt brings
    `urllib.request` and its JWKS client with it (about 2 MiB in every pod).
    """
    import jwt

    try:
        claims: dict[str, Any] = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise TokenClaimsError(f"the token is not a readable JWT ({type(exc).__name__})") from None
    namespace = service_account = None
    k8s = claims.get("kubernetes.io")
    if isinstance(k8s, dict):
        namespace = k8s.get("namespace")
        account = k8s.get("serviceaccount")
        if isinstance(account, dict):
            service_account = account.get("name")
    if not (namespace and service_account):
        account = account_from_username(str(claims.get("sub", "")))
        if account is not None:
            namespace, service_account = account
    if not (isinstance(namespace, str) and isinstance(service_account, str)):
        raise TokenClaimsError(
            "the token names no service account (no kubernetes.io claim, sub is not "
            "system:serviceaccount:NS:SA); set POD_NAMESPACE and SERVICE_ACCOUNT"
        )
    try:
        return SpiffeId(trust_domain, namespace, service_account)
    except SpiffeIdError as exc:
        raise TokenClaimsError(f"the token's identity is unusable: {exc}") from None


class IdentityResolver:
    """Which identity to ask the CA for: the configured one, or else the token's.

    Called by `agent.identity_sources.SingleIdentitySource` until it answers, so an agent started
    before its token exists still finds its identity once the kubelet writes the token.
    """

    def __init__(self, fixed: SpiffeId | None, tokens: TokenProvider, trust_domain: str) -> None:
        self._fixed = fixed
        self._tokens = tokens
        self._trust_domain = trust_domain

    def __call__(self) -> SpiffeId:
        if self._fixed is not None:
            return self._fixed
        return identity_from_token(self._tokens.token(), self._trust_domain)
