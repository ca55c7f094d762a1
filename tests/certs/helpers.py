"""PKI views for the `certs` unit tests: the keys and certificates themselves, so those tests
can call `certs` functions directly on them (built by `tests.support.pki.TestCa`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from certs import PrivateKey, SpiffeId, build_workload_certificate, generate_private_key
from tests.support.pki import TestCa

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)
TRUST_DOMAIN = "cluster.local"
IDENTITY = SpiffeId(TRUST_DOMAIN, "default", "httpbin")


@dataclass(frozen=True)
class Pki:
    root_key: PrivateKey
    root: x509.Certificate
    intermediate_key: PrivateKey
    intermediate: x509.Certificate
    leaf_key: PrivateKey


def make_leaf(
    pki: Pki,
    *,
    issuer: x509.Certificate | None = None,
    issuer_key: PrivateKey | None = None,
    not_before: datetime = NOW - timedelta(minutes=2),
    not_after: datetime = NOW + timedelta(hours=24),
) -> x509.Certificate:
    return build_workload_certificate(
        pki.leaf_key.public_key(),
        IDENTITY,
        issuer if issuer is not None else pki.intermediate,
        issuer_key if issuer_key is not None else pki.intermediate_key,
        not_before=not_before,
        not_after=not_after,
    )


def make_pki() -> Pki:
    """A root and an intermediate under it (both valid around `NOW`), plus a leaf key, from the
    suite's one test PKI (`tests.support.pki.TestCa`). ECDSA P-256 throughout: fast to generate.
    """
    root = TestCa(NOW - timedelta(days=1), trust_domain=TRUST_DOMAIN)
    intermediate = root.child_ca(lifetime=timedelta(days=365))
    return Pki(root.key, root.cert, intermediate.key, intermediate.cert, generate_private_key())


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def csr_with_two_sans(identity: SpiffeId, smuggled_dns: str = "evil.example") -> str:
    """A correctly signed PEM CSR carrying subjectAltName twice: `identity`, then `smuggled_dns`.

    cryptography's builder refuses to make one, so it is built with a stand-in extension OID of
    the same encoded length, renamed to subjectAltName, and the request info signed again.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    original = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), True
        )
        .add_extension(
            x509.UnrecognizedExtension(
                x509.ObjectIdentifier("2.5.29.99"),
                x509.SubjectAlternativeName([x509.DNSName(smuggled_dns)]).public_bytes(),
            ),
            False,
        )
        .sign(key, hashes.SHA256())
    )
    stand_in, san = b"\x06\x03\x55\x1d\x63", b"\x06\x03\x55\x1d\x11"  # 2.5.29.99, .17
    info = original.tbs_certrequest_bytes.replace(stand_in, san)
    der = original.public_bytes(Encoding.DER)
    header = 2 + (der[1] & 0x7F if der[1] & 0x80 else 0)
    at = header + len(original.tbs_certrequest_bytes)
    algorithm = der[at : at + 2 + der[at + 1]]
    signature = b"\x00" + key.sign(info, ec.ECDSA(hashes.SHA256()))
    body = info + algorithm + b"\x03" + _der_length(len(signature)) + signature
    return (
        x509.load_der_x509_csr(b"\x30" + _der_length(len(body)) + body)
        .public_bytes(Encoding.PEM)
        .decode("ascii")
    )


def csr_with_compressed_point(key: ec.EllipticCurvePrivateKey, identity: SpiffeId) -> str:
    """A correctly signed PEM CSR for `identity` whose SubjectPublicKeyInfo carries the EC point
    compressed (02/03 || X), a shape cryptography's CSR builder never writes but may read."""
    original = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), True
        )
        .sign(key, hashes.SHA256())
    )
    public = key.public_key()
    uncompressed = public.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    point = public.public_bytes(Encoding.X962, PublicFormat.CompressedPoint)
    algorithm = uncompressed[2 : 2 + 2 + uncompressed[3]]  # AlgorithmIdentifier, as it was
    bits = b"\x03" + _der_length(len(point) + 1) + b"\x00" + point
    compressed = b"\x30" + _der_length(len(algorithm) + len(bits)) + algorithm + bits
    info = original.tbs_certrequest_bytes
    header = 2 + (info[1] & 0x7F if info[1] & 0x80 else 0)
    content = info[header:].replace(uncompressed, compressed)
    info = b"\x30" + _der_length(len(content)) + content
    der = original.public_bytes(Encoding.DER)
    header = 2 + (der[1] & 0x7F if der[1] & 0x80 else 0)
    at = header + len(original.tbs_certrequest_bytes)
    signature_algorithm = der[at : at + 2 + der[at + 1]]
    signature = b"\x00" + key.sign(info, ec.ECDSA(hashes.SHA256()))
    body = info + signature_algorithm + b"\x03" + _der_length(len(signature)) + signature
    return (
        x509.load_der_x509_csr(b"\x30" + _der_length(len(body)) + body)
        .public_bytes(Encoding.PEM)
        .decode("ascii")
    )
