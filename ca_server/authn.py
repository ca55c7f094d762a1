"""Who is calling? Authenticators tried in order, first success wins (Istio's model).

An authenticator returns `None` when the request carries no credential of its kind (so the next
one is tried) and raises `AuthenticationError` when it carries one that is not valid. New kinds
(Kubernetes TokenReview) implement the same `Authenticator` protocol and join the chain in
`ca_server.server.build_authenticators`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from cryptography import x509

from ca_server.errors import AuthenticationError
from certs import (
    CertsError,
    ChainOrderError,
    ForeignCertificateError,
    SpiffeId,
    build_path,
    describe_certificate,
    issuer_key_id,
)
from meshca.clock import Clock


@dataclass(frozen=True)
class AuthnRequest:
    """What an authenticator may look at: request headers and the verified TLS peer chain
    (the client's leaf first, then what it sent after it).
    `advisory`: the request may be refused rather than wait for a budget certificate requests
    share (an agent report: the TokenReview rate limit, `ca_server.kube.ratelimit`)."""

    headers: Mapping[str, str]
    peer_chain: tuple[x509.Certificate, ...] = ()
    advisory: bool = False

    @property
    def bearer_token(self) -> str | None:
        value = self.headers.get("authorization", "")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()

    @property
    def cluster_id(self) -> str | None:
        return self.headers.get("clusterid") or None


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: the identity it may be issued, and facts for audit/impersonation."""

    identity: SpiffeId
    authenticator: str
    subject: str
    pod_name: str | None = None
    pod_uid: str | None = None
    # The ServiceAccount object's uid, from a projected token's `kubernetes.io` claim.
    service_account_uid: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)


class Authenticator(Protocol):
    name: str

    async def authenticate(self, request: AuthnRequest) -> Caller | None: ...


class AuthenticatorChain:
    """Runs authenticators in order; the first `Caller` wins.

    If none succeeds the error names every failure, so an operator sees e.g. both "no client
    certificate" and "token expired" rather than only the last one.
    """

    def __init__(self, authenticators: Sequence[Authenticator]) -> None:
        self._authenticators = list(authenticators)

    async def authenticate(self, request: AuthnRequest) -> Caller:
        failures: list[AuthenticationError] = []
        for authenticator in self._authenticators:
            try:
                caller = await authenticator.authenticate(request)
            except AuthenticationError as exc:
                failures.append(exc)
                continue
            if caller is not None:
                return caller
        if not failures:
            raise AuthenticationError(
                "no-credentials",
                "request carries no credential: send 'authorization: Bearer <service-account "
                "token>' (audience istio-ca) or connect with a client certificate",
            )
        if len(failures) == 1:
            raise failures[0]
        raise AuthenticationError(
            failures[0].reason, "; ".join(f"{exc.message}" for exc in failures)
        )


class ClientCertificateAuthenticator:
    """Renewal over mTLS: the identity is the SPIFFE URI of the verified client certificate.

    `AuthnRequest.peer_chain` is the client's leaf followed by whatever it sent after it (Istio's
    agent sends its `cert-chain.pem`: leaf, intermediates, then its whole root bundle). gRPC
    has already verified the handshake; the path is built again here from the leaf to the CA's
    current roots, with the rest as candidates (`certs.build_path`), so a certificate from a
    retired root stops working without a restart and a malformed chain is refused with what to
    fix. Only the leaf's identity counts. A leaf signed by an authority the CA has tainted
    (`tainted`: authority ID -> when) is refused saying so, not as one from some unknown root:
    the operator and the workload learn why, and that a token gets a new certificate.
    """

    name = "client-certificate"

    def __init__(
        self,
        trust_domain: str,
        roots: Callable[[], Sequence[x509.Certificate]],
        clock: Clock,
        tainted: Callable[[], Mapping[str, datetime]] = dict,
    ) -> None:
        self._trust_domain = trust_domain
        self._roots = roots
        self._clock = clock
        self._tainted = tainted

    async def authenticate(self, request: AuthnRequest) -> Caller | None:
        if not request.peer_chain:
            return None
        leaf, *presented = request.peer_chain
        try:
            build_path(leaf, presented, self._roots(), now=self._clock.now())
        except ChainOrderError as exc:
            raise AuthenticationError(
                "client-cert-chain-order", f"client certificate chain out of order: {exc}"
            ) from exc
        except ForeignCertificateError as exc:
            raise AuthenticationError(
                "client-cert-foreign-intermediate", f"client certificate chain: {exc}"
            ) from exc
        except CertsError as exc:
            raise AuthenticationError(
                "client-cert-invalid", self._tainted_authority(leaf) or f"client certificate: {exc}"
            ) from exc
        identity = describe_certificate(leaf).identity
        if identity is None:
            raise AuthenticationError(
                "client-cert-no-identity", "client certificate carries no SPIFFE URI SAN"
            )
        try:
            spiffe_id = SpiffeId.parse(identity)
        except CertsError as exc:
            raise AuthenticationError(
                "client-cert-no-identity", f"client certificate: {exc}"
            ) from exc
        if spiffe_id.trust_domain != self._trust_domain:
            raise AuthenticationError(
                "client-cert-trust-domain",
                f"client certificate is for trust domain {spiffe_id.trust_domain}, "
                f"this CA serves {self._trust_domain}",
            )
        return Caller(spiffe_id, self.name, subject=f"x509:{spiffe_id.uri}")

    def _tainted_authority(self, leaf: x509.Certificate) -> str | None:
        """Why `leaf` failed, when the authority that signed it (its Authority Key Identifier)
        is one this CA tainted; else None. Only the wording of a refusal rests on the label."""
        authority = issuer_key_id(leaf)
        tainted_at = self._tainted().get(authority) if authority is not None else None
        if tainted_at is None:
            return None
        return (
            f"client certificate signed by authority {authority}, which this CA tainted at "
            f"{tainted_at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} (its leaves no longer "
            "authenticate a renewal): request a new certificate with the workload's token"
        )
