"""Property-based tests of the parsers that face the network: `certs.load_csr` (and the CSR
policy after it), the bearer-token path, CA request decoding, and SDS request handling.

The property is the same everywhere: whatever the input, the code answers with its own typed
refusal (CsrError, AuthenticationError, a RequestError, UnknownResourceError...) or a result,
never another exception type (which the RPC edge would turn into INTERNAL/UNKNOWN and a
traceback). Examples are bounded and derandomized so CI spends a few seconds and every run
tries the same inputs; raise `MESHCA_HYPOTHESIS_EXAMPLES` locally to search longer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import jwt
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.file_mounted import (
    FileResource,
    FileSecretProvider,
    FileWatcher,
    UnknownFileResourceError,
)
from agent.sds_decoding import sds_request_decoder
from ca_server.authn import AuthnRequest
from ca_server.errors import AuthenticationError
from ca_server.jwt_authn import JwksFile, JwtAuthenticator, TrustedIssuer
from ca_server.request_decoding import decode_certificate_request
from ca_server.token_cache import token_expiry, token_shape
from certs import CertsError, load_certs
from meshca.clock import SystemClock
from meshca.grpc_services import Undecodable
from meshca_proto import ca_pb2
from tests.support.inprocess_ca import good_csr
from tests.support.parser_checks import check_csr
from tests.support.pki import TestCa
from tests.support.token_issuer import K8S_ISSUER, RsaIssuer, k8s_claims, make_rsa_issuer

EXAMPLES = int(os.environ.get("MESHCA_HYPOTHESIS_EXAMPLES", "150"))
BOUNDED = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
VALID_PEM = good_csr()
VALID_CERT_PEM = TestCa().issue("app").cert_pem


def _with_version_64(pem: str, label: str = "CERTIFICATE REQUEST") -> bytes:
    """The PEM with its version field changed to 64 (a CSR's `INTEGER 0`, a certificate's
    `[0] INTEGER 2`)."""
    der = base64.b64decode("".join(line for line in pem.splitlines() if "-----" not in line))
    if label == "CERTIFICATE":
        der = der.replace(b"\xa0\x03\x02\x01\x02", b"\xa0\x03\x02\x01\x40", 1)
    else:
        der = der.replace(b"\x02\x01\x00", b"\x02\x01\x40", 1)
    body = base64.encodebytes(der).decode()
    return f"-----BEGIN {label}-----\n{body}-----END {label}-----\n".encode()


# --- certs.load_csr --------------------------------------------------------------------------


def _mutated_pem() -> st.SearchStrategy[bytes]:
    """A valid CSR PEM with a few bytes flipped, inserted, deleted or the tail cut."""
    raw = VALID_PEM.encode()

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
            at = draw(st.integers(0, max(0, len(data) - 1)))
            if kind == "flip" and data:
                data[at] ^= draw(st.integers(1, 255))
            elif kind == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
            elif kind == "delete" and data:
                del data[at : at + draw(st.integers(1, 8))]
            else:
                del data[at:]
        return bytes(data)

    return mutate()


def _mutated_der(pem: str, label: str) -> st.SearchStrategy[bytes]:
    """The DER inside a valid PEM block mutated (so the mutations reach the ASN.1 parser
    instead of breaking the base64), re-armoured."""
    der = base64.b64decode("".join(line for line in pem.splitlines() if "-----" not in line))

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(der)
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] = draw(st.integers(0, 255))
        body = base64.encodebytes(bytes(data)).decode()
        return f"-----BEGIN {label}-----\n{body}-----END {label}-----\n".encode()

    return mutate()


@BOUNDED
@given(st.binary(max_size=2048))
def test_load_csr_on_arbitrary_bytes(data: bytes) -> None:
    check_csr(data)


@BOUNDED
@given(st.text(max_size=1024))
def test_load_csr_on_arbitrary_text(text: str) -> None:
    check_csr(text)


@BOUNDED
@given(_mutated_pem())
def test_load_csr_on_mutated_csrs(data: bytes) -> None:
    check_csr(data)


@BOUNDED
@given(_mutated_der(VALID_PEM, "CERTIFICATE REQUEST"))
@example(_with_version_64(VALID_PEM))  # found by atheris: InvalidVersion is not a ValueError
def test_load_csr_on_mutated_der(data: bytes) -> None:
    check_csr(data)


@BOUNDED
@given(_mutated_der(VALID_CERT_PEM, "CERTIFICATE"))
@example(_with_version_64(VALID_CERT_PEM, "CERTIFICATE"))
def test_load_certs_on_mutated_der(data: bytes) -> None:
    with contextlib.suppress(CertsError):
        load_certs(data, what="fuzzed")


@BOUNDED
@given(st.binary(max_size=1024))
def test_ca_request_decoding_never_raises(data: bytes) -> None:
    decoded = decode_certificate_request(data)
    assert isinstance(decoded, ca_pb2.IstioCertificateRequest | Undecodable)


# --- the bearer-token path -------------------------------------------------------------------


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> RsaIssuer:
    return make_rsa_issuer(tmp_path_factory.mktemp("issuer"))


def _authenticate(issuer: RsaIssuer, header: str) -> None:
    authenticator = JwtAuthenticator(
        [TrustedIssuer(K8S_ISSUER, JwksFile(issuer.jwks_path), ("istio-ca",))],
        "cluster.local",
        SystemClock(),
    )
    request = AuthnRequest(headers={"authorization": header})
    with contextlib.suppress(AuthenticationError):
        asyncio.run(authenticator.authenticate(request))


@BOUNDED
@given(st.text(max_size=512))
def test_token_path_on_arbitrary_headers(issuer: RsaIssuer, header: str) -> None:
    _authenticate(issuer, header)
    _authenticate(issuer, f"Bearer {header}")
    token_shape(header)
    token_expiry(header)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3)
    ),
    max_leaves=8,
)
CLAIMS = ["iss", "sub", "aud", "exp", "nbf", "iat", "kubernetes.io"]
# Time claims of every numeric shape: far past/future, huge, fractional, infinite.
TIMES = st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | JSON
CLAIM_VALUES = st.dictionaries(st.sampled_from(CLAIMS), JSON, max_size=4) | st.dictionaries(
    st.sampled_from(["exp", "nbf", "iat"]), TIMES, min_size=1, max_size=3
)


@BOUNDED
@given(CLAIM_VALUES)
def test_token_path_on_validly_signed_tokens_with_hostile_claims(
    issuer: RsaIssuer, overrides: dict[str, Any]
) -> None:
    """Claim smuggling: the signature is good, the claims are anything JSON can hold."""
    claims = {**k8s_claims("default", "sleep"), **overrides}
    try:
        token = issuer.sign(claims)
    except (TypeError, ValueError, OverflowError):
        return  # PyJWT refuses to encode it: nothing to send
    _authenticate(issuer, f"Bearer {token}")
    token_expiry(token)


@BOUNDED
@given(JSON, JSON)
def test_token_path_on_tokens_with_hostile_headers(issuer: RsaIssuer, alg: Any, kid: Any) -> None:
    """Header confusion: `alg` and `kid` of any JSON type, over a valid signature."""
    token = issuer.sign(k8s_claims("default", "sleep"))
    _, payload, signature = token.split(".")
    header = json.dumps({"alg": alg, "kid": kid, "typ": "JWT"}).encode()
    forged_header = jwt.utils.base64url_encode(header).decode()
    _authenticate(issuer, f"Bearer {forged_header}.{payload}.{signature}")


# --- SDS request handling --------------------------------------------------------------------


@BOUNDED
@given(st.binary(max_size=1024))
def test_sds_decoding_never_raises(data: bytes) -> None:
    for message in (discovery_pb2.DiscoveryRequest, discovery_pb2.DeltaDiscoveryRequest):
        decoded = sds_request_decoder(message)(data)
        assert isinstance(decoded, message | Undecodable)


NAMES = st.one_of(
    st.text(max_size=200),
    st.builds(lambda rest: "file-cert:" + rest, st.text(max_size=200)),
    st.builds(lambda rest: "file-root:" + rest, st.text(max_size=200)),
    st.builds(
        lambda a, b: f"file-cert:/etc/certs/{a}~/{b}", st.text(max_size=50), st.text(max_size=50)
    ),
)


@BOUNDED
@given(NAMES)
def test_file_resource_names_are_parsed_or_refused(name: str) -> None:
    provider = FileSecretProvider(
        FileWatcher(clock=SystemClock()), allowed_dirs=(Path("/etc/certs"),)
    )
    try:
        FileResource.parse(name)
        iterator = provider.updates(name)
    except UnknownFileResourceError:
        return
    except ValueError as exc:  # e.g. an embedded NUL byte in a path
        assert "null" in str(exc).lower() or "NUL" in str(exc), exc
        return
    assert iterator is not None
