"""Requests whose shape is hostile: bytes that are not an `IstioCertificateRequest`, a `csr`
that is not UTF-8 (issue #11 item 2), odd TTLs and metadata."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from certs import SpiffeId, build_csr, generate_private_key, key_matches_certificate, load_cert
from meshca_proto import ca_pb2
from tests.support.inprocess_ca import SLEEP, InProcessCa, good_csr, refused

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def _with_csr_bytes(csr: bytes) -> bytes:
    """A serialized request whose field 1 (`csr`) holds raw bytes, as a non-Python client could
    send (the Python stub refuses to encode a non-UTF-8 `string`)."""
    marker = "M" * 16
    encoded = ca_pb2.IstioCertificateRequest(csr=marker, validity_duration=3600)
    raw = encoded.SerializeToString()
    prefix = b"\x0a" + bytes([len(marker)]) + marker.encode()
    assert raw.startswith(prefix)
    return _field1(csr) + raw[len(prefix) :]


def _field1(value: bytes) -> bytes:
    length = len(value)
    varint = bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return b"\x0a" + bytes(varint) + value


def _der_csr() -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    return x509.load_pem_x509_csr(good_csr().encode()).public_bytes(Encoding.DER)


NON_UTF8_CSRS = {
    "raw DER": _der_csr,
    "stray byte before the PEM": lambda: b"\xff" + good_csr().encode(),
    "latin-1 inside the PEM": lambda: good_csr().encode().replace(b"\n", b"\xe9\n", 1),
    "lone continuation byte": lambda: b"\x80",
}


@pytest.mark.parametrize("make", NON_UTF8_CSRS.values(), ids=list(NON_UTF8_CSRS))
def test_csr_that_is_not_utf8_is_invalid_argument_audited_and_counted(
    hostile_ca: InProcessCa, make: object
) -> None:
    """Before: UNKNOWN with a protobuf decode message, a traceback, no audit line, no metric."""
    body = _with_csr_bytes(make())  # type: ignore[operator]
    details = refused(
        hostile_ca,
        lambda: hostile_ca.call(
            raw_request=body, token=hostile_ca.issuer.token("default", "sleep")
        ),
        INVALID,
        "not UTF-8",
        reason="csr-invalid",
    )
    assert "PEM" in details


def test_der_csr_message_says_it_looks_like_der(hostile_ca: InProcessCa) -> None:
    body = _with_csr_bytes(_der_csr())
    refused(
        hostile_ca,
        lambda: hostile_ca.call(
            raw_request=body, token=hostile_ca.issuer.token("default", "sleep")
        ),
        INVALID,
        "like DER",
    )


GARBAGE_BODIES = {
    "random bytes": b"\xff\xfe\xfd\xfc",
    "truncated length-delimited field": b"\x0a\x10abc",
    "field number zero": b"\x00\x01",
    "metadata that is not a Struct": b"\x22\x03\xff\xff\xff",
}


@pytest.mark.parametrize("body", GARBAGE_BODIES.values(), ids=list(GARBAGE_BODIES))
def test_undecodable_request_is_invalid_argument(hostile_ca: InProcessCa, body: bytes) -> None:
    refused(
        hostile_ca,
        lambda: hostile_ca.call(
            raw_request=body, token=hostile_ca.issuer.token("default", "sleep")
        ),
        INVALID,
        "does not decode",
        reason="request-malformed",
    )


def test_undecodable_request_without_credentials_is_unauthenticated_first(
    hostile_ca: InProcessCa,
) -> None:
    """Authentication comes first: an anonymous caller learns nothing about request parsing."""
    refused(hostile_ca, lambda: hostile_ca.call(raw_request=b"\xff\xfe"), UNAUTH, "no credential")


def test_empty_body_is_a_request_without_csr(hostile_ca: InProcessCa) -> None:
    refused(
        hostile_ca,
        lambda: hostile_ca.call(raw_request=b"", token=hostile_ca.issuer.token("default", "sleep")),
        INVALID,
        "not PEM",
    )


@pytest.mark.parametrize("ttl", [-1, 10**15, 2**63 - 1, 59])
def test_extreme_ttls_never_exceed_policy(hostile_ca: InProcessCa, ttl: int) -> None:
    """Extreme TTLs are clamped into policy or refused; never an error from deep inside."""
    try:
        chain = hostile_ca.call(
            good_csr(), token=hostile_ca.issuer.token("default", "sleep"), ttl_seconds=ttl
        )
    except grpc.RpcError as error:
        assert error.code() == INVALID
        return
    leaf = load_cert(chain[0])
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert lifetime <= hostile_ca.config.ttl.maximum + hostile_ca.config.ttl.minimum


def test_unknown_metadata_keys_are_ignored_not_trusted(hostile_ca: InProcessCa) -> None:
    chain = hostile_ca.call(
        good_csr(),
        token=hostile_ca.issuer.token("default", "sleep"),
        metadata={"CertSigner": "root", "x": "y" * 1000},
    )
    assert chain


def test_concurrent_mixed_requests_never_cross_talk(hostile_ca: InProcessCa) -> None:
    """200 requests from 16 threads, every third one hostile (a CSR for another identity):
    each valid one gets a certificate for its own CSR's key, each hostile one is refused, and
    the issued counter and audit lines match the valid ones exactly."""
    token = hostile_ca.issuer.token("default", "sleep")
    other = SpiffeId("cluster.local", "kube-system", "admin")
    issued_before = hostile_ca.issued_count()
    lines_before = len(hostile_ca.issued_lines())

    def one(index: int) -> str:
        key = generate_private_key()
        hostile = index % 3 == 0
        csr = build_csr(key, other if hostile else SLEEP)
        try:
            chain = hostile_ca.call(csr, token=token)
        except grpc.RpcError as error:
            assert hostile, error
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            return "refused"
        assert not hostile
        assert key_matches_certificate(key, load_cert(chain[0]))
        return "issued"

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(200)))
    valid = sum(1 for index in range(200) if index % 3)
    assert outcomes.count("issued") == valid
    assert hostile_ca.issued_count() == issued_before + valid
    assert len(hostile_ca.issued_lines()) == lines_before + valid
