"""CreateCertificate over real TLS gRPC against a real CA process: issuance and its profile."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from certs import (
    SpiffeId,
    build_csr,
    generate_private_key,
    key_matches_certificate,
    load_cert,
    load_certs,
    verify_chain,
)
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.token_issuer import RsaIssuer

SLEEP = SpiffeId("cluster.local", "default", "sleep")


def _issue(ca: CaProcess, root_pem: bytes, token: str, ttl: int = 0):
    key = generate_private_key()
    with ca_stub(ca.addr, root_pem) as stub:
        chain = create_certificate(stub, build_csr(key, SLEEP), token=token, ttl_seconds=ttl)
    return key, chain


def test_valid_request_gets_a_leaf_with_the_workload_profile(ca: CaProcess, root_pem: bytes):
    token = ca.mint_token("default", "sleep")
    key, chain = _issue(ca, root_pem, token, ttl=3600)

    assert len(chain) == 2, "self-signed mode: [leaf, root bundle]"
    leaf = load_cert(chain[0])
    roots = load_certs(ca.root_cert_path.read_bytes())
    assert load_certs(chain[-1]) == roots
    now = datetime.now(UTC)
    verify_chain([leaf], roots, now=now)
    assert key_matches_certificate(key, leaf)

    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical
    assert san.value.get_values_for_type(x509.UniformResourceIdentifier) == [SLEEP.uri]
    assert len(list(san.value)) == 1
    assert leaf.subject == x509.Name([])
    assert 0 < leaf.serial_number < 2**128
    ku = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and ku.value.key_encipherment
    assert not ku.value.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = roots[0].extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest

    backdate = now - leaf.not_valid_before_utc
    assert timedelta(minutes=1, seconds=50) < backdate < timedelta(minutes=2, seconds=30)
    granted = leaf.not_valid_after_utc - now
    assert timedelta(minutes=59) < granted <= timedelta(hours=1)


def test_default_ttl_is_24h_and_above_maximum_is_clamped(ca: CaProcess, root_pem: bytes):
    token = ca.mint_token("default", "sleep")
    _, default_chain = _issue(ca, root_pem, token, ttl=0)
    _, clamped_chain = _issue(ca, root_pem, token, ttl=200 * 86400)
    _, int64_max_chain = _issue(ca, root_pem, token, ttl=2**63 - 1)
    now = datetime.now(UTC)
    default_left = load_cert(default_chain[0]).not_valid_after_utc - now
    assert timedelta(hours=23, minutes=59) < default_left <= timedelta(hours=24)
    for chain in (clamped_chain, int64_max_chain):
        clamped_left = load_cert(chain[0]).not_valid_after_utc - now
        assert timedelta(days=89, hours=23) < clamped_left <= timedelta(days=90)


def test_token_from_a_jwks_file_issuer_is_accepted(
    ca: CaProcess, root_pem: bytes, rsa_issuer: RsaIssuer
):
    _, chain = _issue(ca, root_pem, rsa_issuer.token("default", "sleep"))
    assert load_cert(chain[0]).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.UniformResourceIdentifier) == [SLEEP.uri]


def test_health_and_reflection_services_answer(ca: CaProcess, root_pem: bytes):
    credentials = grpc.ssl_channel_credentials(root_pem)
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(ca.addr, credentials, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "istio.v1.auth.IstioCertificateService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(reflection.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in response.list_services_response.service}
        assert "istio.v1.auth.IstioCertificateService" in names


@pytest.mark.parametrize("host", ["localhost", "istiod.istio-system.svc"])
def test_serving_certificate_covers_the_default_names(ca: CaProcess, root_pem: bytes, host: str):
    token = ca.mint_token("default", "sleep")
    key = generate_private_key()
    with ca_stub(ca.addr, root_pem, server_name=host) as stub:
        assert len(create_certificate(stub, build_csr(key, SLEEP), token=token)) == 2
