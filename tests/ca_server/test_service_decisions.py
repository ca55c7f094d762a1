"""`CertificateService` decisions in-process: authentication, authorization and lifetime.

The real service, authenticators, CSR checks, TTL policy and signer, driven through a small fake
`ServicerContext` instead of a socket, so every refusal case and every lifetime rule runs in
milliseconds. `test_refusals.py` keeps one process-level smoke test per refusal family.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from cryptography import x509
from google.protobuf import struct_pb2

from ca_server.authn import AuthenticatorChain, Caller, ClientCertificateAuthenticator
from ca_server.authority.signer import LocalSigner
from ca_server.config import JwtIssuerConfig, TtlPolicy
from ca_server.errors import AuthenticationError
from ca_server.impersonation import DenyImpersonation
from ca_server.jwt_authn import JwtAuthenticator
from ca_server.metrics import CaMetrics
from ca_server.service import CertificateService
from certs import (
    CLOCK_SKEW_BACKDATE,
    KeySpec,
    SigningAuthority,
    SpiffeId,
    build_csr,
    cert_to_pem,
    generate_private_key,
    load_certs,
    new_self_signed_authority,
    verify_chain,
)
from meshca.clock import FakeClock
from meshca_proto import ca_pb2
from tests.ca_server.refusal_cases import CASES, SLEEP, Case, good_csr, good_token
from tests.support.token_issuer import K8S_ISSUER, RsaIssuer

POLICY = TtlPolicy(
    default=timedelta(hours=24), maximum=timedelta(days=90), minimum=timedelta(minutes=10)
)


class Aborted(Exception):
    """What the fake context raises on `abort`, as grpc.aio raises AbortError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """The parts of `grpc.aio.ServicerContext` the service reads: headers, peer, TLS, abort."""

    def __init__(self, token: str | None, peer_chain: Sequence[x509.Certificate] = ()) -> None:
        self._metadata = [("authorization", f"Bearer {token}")] if token is not None else []
        # As gRPC's server side holds them: the leaf alone, then what the client sent after it.
        self._peer_pems = [cert_to_pem(cert).encode() for cert in peer_chain]

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def auth_context(self) -> dict[str, list[bytes]]:
        if not self._peer_pems:
            return {}
        leaf, *rest = self._peer_pems
        return {"x509_pem_cert": [leaf], "x509_pem_cert_chain": [b"".join(rest)]}

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class AllowImpersonation:
    """A node authorizer that allows one (caller, target) pair and refuses the rest."""

    def __init__(self, caller: SpiffeId, target: SpiffeId) -> None:
        self._allowed = (caller, target)

    async def authorize(self, caller: Caller, target: SpiffeId) -> None:
        if (caller.identity, target) != self._allowed:
            raise AuthenticationError("impersonation-denied", f"{caller.identity.uri} may not")


class Ca:
    """One CertificateService on a fixed clock, with its metrics."""

    def __init__(
        self,
        issuer: RsaIssuer,
        *,
        now: datetime,
        authority: SigningAuthority,
        impersonation: Any = None,
    ) -> None:
        self.clock = FakeClock(now)
        self.metrics = CaMetrics()
        self.signer = LocalSigner(authority)
        jwt = JwtAuthenticator.from_config(
            [JwtIssuerConfig(K8S_ISSUER, str(issuer.jwks_path))], "cluster.local", self.clock
        )
        certs = ClientCertificateAuthenticator(
            "cluster.local", lambda: self.signer.authority.roots, self.clock
        )
        self.service = CertificateService(
            authenticators=AuthenticatorChain([certs, jwt]),
            impersonation=impersonation or DenyImpersonation(),
            signer=self.signer,
            ttl_policy=POLICY,
            metrics=self.metrics,
            clock=self.clock,
        )

    @property
    def now(self) -> datetime:
        return self.clock.now()

    def issued(self) -> float:
        value = self.metrics.registry.get_sample_value("meshca_ca_certificates_issued_total")
        return value or 0.0

    def call(
        self,
        csr: str,
        context: FakeContext,
        *,
        ttl_seconds: int = 0,
        metadata: dict[str, Any] | None = None,
    ) -> list[x509.Certificate]:
        request = ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=ttl_seconds)
        if metadata:
            request.metadata.CopyFrom(_struct(metadata))
        response = asyncio.run(self.service.CreateCertificate(request, context))
        return [cert for pem in response.cert_chain for cert in load_certs(pem.encode())]


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


@pytest.fixture(scope="module")
def authority() -> SigningAuthority:
    return new_self_signed_authority(
        KeySpec(), "cluster.local", now=datetime.now(UTC), lifetime=timedelta(days=3650)
    )


@pytest.fixture
def service(rsa_issuer: RsaIssuer, authority: SigningAuthority) -> Ca:
    return Ca(rsa_issuer, now=datetime.now(UTC), authority=authority)


# -- authentication and authorization: every refusal case ------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refusal_has_its_status_and_message_and_issues_nothing(
    service: Ca, rsa_issuer: RsaIssuer, case: Case
):
    with pytest.raises(Aborted) as refused:
        service.call(case.csr(), FakeContext(case.token(rsa_issuer)), metadata=case.metadata)
    assert refused.value.code == case.code, refused.value.details
    assert case.message in refused.value.details
    assert service.issued() == 0
    # The same service still signs a good request afterwards.
    chain = service.call(good_csr(), FakeContext(good_token(rsa_issuer)))
    assert len(chain) == 2 and service.issued() == 1


def test_a_valid_token_gets_its_own_identity(service: Ca, rsa_issuer: RsaIssuer, authority):
    chain = service.call(good_csr(), FakeContext(good_token(rsa_issuer)))
    verify_chain(chain, authority.roots, now=service.now)
    assert chain[0].extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.UniformResourceIdentifier) == [SLEEP.uri]


def test_client_certificate_renewal_and_a_foreign_one(service: Ca, rsa_issuer: RsaIssuer):
    first = service.call(good_csr(), FakeContext(good_token(rsa_issuer)))
    renewed = service.call(good_csr(), FakeContext(None, peer_chain=first))
    assert renewed[0].serial_number != first[0].serial_number
    stranger = new_self_signed_authority(
        KeySpec(), "cluster.local", now=service.now, lifetime=timedelta(days=1)
    )
    foreign = Ca(rsa_issuer, now=service.now, authority=stranger).call(
        good_csr(), FakeContext(good_token(rsa_issuer))
    )
    with pytest.raises(Aborted) as refused:
        service.call(good_csr(), FakeContext(None, peer_chain=foreign))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "client certificate" in refused.value.details


@pytest.mark.parametrize(
    ("caller", "target", "allowed"),
    [
        (
            SpiffeId("cluster.local", "default", "sleep"),
            "spiffe://cluster.local/ns/shop/sa/cart",
            True,
        ),
        (
            SpiffeId("cluster.local", "default", "sleep"),
            "spiffe://cluster.local/ns/shop/sa/pay",
            False,
        ),
        (SpiffeId("cluster.local", "default", "sleep"), "not-a-spiffe-id", False),
    ],
)
def test_impersonation_is_the_policys_decision(
    rsa_issuer: RsaIssuer, authority: SigningAuthority, caller: SpiffeId, target: str, allowed: bool
):
    cart = SpiffeId("cluster.local", "shop", "cart")
    ca = Ca(
        rsa_issuer,
        now=datetime.now(UTC),
        authority=authority,
        impersonation=AllowImpersonation(caller, cart),
    )
    csr = build_csr(generate_private_key(), cart)
    context = FakeContext(good_token(rsa_issuer))
    if allowed:
        chain = ca.call(csr, context, metadata={"ImpersonatedIdentity": target})
        assert chain[0].extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.UniformResourceIdentifier) == [target]
    else:
        with pytest.raises(Aborted) as refused:
            ca.call(csr, context, metadata={"ImpersonatedIdentity": target})
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert ca.issued() == 0


# -- lifetime ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "granted"),
    [
        (0, POLICY.default),
        (-5, POLICY.default),
        (3600, timedelta(hours=1)),
        (60, POLICY.minimum),
        (365 * 86400, POLICY.maximum),
        (2**62, POLICY.maximum),
    ],
)
def test_lifetime_is_clamped_into_the_policy(
    service: Ca, rsa_issuer: RsaIssuer, requested: int, granted: timedelta
):
    leaf = service.call(good_csr(), FakeContext(good_token(rsa_issuer)), ttl_seconds=requested)[0]
    assert leaf.not_valid_before_utc == (service.now - CLOCK_SKEW_BACKDATE).replace(microsecond=0)
    assert leaf.not_valid_after_utc == (service.now + granted).replace(microsecond=0)


def test_lifetime_never_outlives_the_ca_and_an_expired_ca_issues_nothing(
    rsa_issuer: RsaIssuer,
):
    now = datetime.now(UTC)
    short = new_self_signed_authority(
        KeySpec(), "cluster.local", now=now, lifetime=timedelta(hours=2)
    )
    ca = Ca(rsa_issuer, now=now, authority=short)
    leaf = ca.call(good_csr(), FakeContext(good_token(rsa_issuer)), ttl_seconds=86400)[0]
    assert leaf.not_valid_after_utc == short.not_after.replace(microsecond=0)
    ca.clock.advance(timedelta(hours=3))  # the token is still valid: issued "now" by the issuer
    with pytest.raises(Aborted) as refused:
        ca.call(good_csr(), FakeContext(good_token(rsa_issuer)))
    assert refused.value.code == grpc.StatusCode.INTERNAL
    assert "expired" in refused.value.details
    assert ca.issued() == 1
