"""Hostile CSRs, built with `cryptography` directly (meshca's `build_csr` only makes good ones).

One builder for the suite: `csr_with(names, key=, extensions=, subject=, algorithm=)` makes any
CSR `cryptography` will sign; `broken_signature`, `two_sans` and `compressed_point` edit the DER
for what it will not (a bad signature, a duplicated extension, a compressed EC point);
`pem_of` armours DER. The named cases below are the hostile suite's catalogue, all asking for
`SLEEP` unless they say otherwise.
"""

from __future__ import annotations

import base64
import ipaddress
import textwrap

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from certs import SpiffeId

SLEEP = SpiffeId("cluster.local", "default", "sleep")
_KEY = ec.generate_private_key(ec.SECP256R1())


def csr_with(
    names: list[x509.GeneralName] | None = None,
    *,
    key: object = None,
    extensions: list[tuple[x509.ExtensionType, bool]] = (),  # type: ignore[assignment]
    subject: x509.Name | None = None,
    algorithm: hashes.HashAlgorithm | None = None,
) -> str:
    private_key = key if key is not None else _KEY
    builder = x509.CertificateSigningRequestBuilder().subject_name(subject or x509.Name([]))
    if names is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=True)
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical)
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        signature_hash = None
    else:
        signature_hash = algorithm or hashes.SHA256()
    csr = builder.sign(private_key, signature_hash)  # type: ignore[arg-type]
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def uri(identity: SpiffeId | str = SLEEP) -> x509.UniformResourceIdentifier:
    return x509.UniformResourceIdentifier(identity if isinstance(identity, str) else identity.uri)


def many_dns_sans(count: int) -> str:
    return csr_with([uri(), *(x509.DNSName(f"host-{i}.evil.example") for i in range(count))])


def long_uri_san(length: int) -> str:
    return csr_with([x509.UniformResourceIdentifier(SLEEP.uri + "/" + "a" * length)])


def ip_san() -> str:
    return csr_with([uri(), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))])


def email_san() -> str:
    return csr_with([uri(), x509.RFC822Name("root@evil.example")])


def other_name_san() -> str:
    return csr_with([uri(), x509.RegisteredID(x509.ObjectIdentifier("1.2.3.4"))])


def wildcard_dns() -> str:
    return csr_with([uri(), x509.DNSName("*.cluster.local")])


def rsa_1024() -> str:
    return csr_with([uri()], key=rsa.generate_private_key(public_exponent=65537, key_size=1024))


def p521() -> str:
    return csr_with([uri()], key=ec.generate_private_key(ec.SECP521R1()))


def secp256k1() -> str:
    return csr_with([uri()], key=ec.generate_private_key(ec.SECP256K1()))


def ed25519_key() -> str:
    return csr_with([uri()], key=ed25519.Ed25519PrivateKey.generate())


def dsa_key() -> str:
    return csr_with([uri()], key=dsa.generate_private_key(key_size=2048))


def pem_of(der: bytes) -> str:
    """`der` armoured as a PEM CSR, whatever it holds."""
    body = "\n".join(textwrap.wrap(base64.b64encode(der).decode("ascii"), 64))
    return f"-----BEGIN CERTIFICATE REQUEST-----\n{body}\n-----END CERTIFICATE REQUEST-----\n"


def broken_signature(pem: str | None = None) -> str:
    """`pem` (a good CSR for `SLEEP` by default) with a byte of its signature value flipped:
    well-formed, and only the signature check can tell."""
    csr = x509.load_pem_x509_csr((pem or csr_with([uri()])).encode())
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0xFF  # inside the signature value at the end
    return pem_of(bytes(der))


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def _signature_algorithm(csr: x509.CertificateSigningRequest) -> bytes:
    """The DER of `csr`'s signatureAlgorithm, as it was (it follows the request info)."""
    der = csr.public_bytes(serialization.Encoding.DER)
    header = 2 + (der[1] & 0x7F if der[1] & 0x80 else 0)
    at = header + len(csr.tbs_certrequest_bytes)
    return der[at : at + 2 + der[at + 1]]


def _signed_again(
    info: bytes, algorithm: bytes, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateSigningRequest:
    """A CSR of request info `info` (DER), signed by `key` with ECDSA-SHA256."""
    signature = b"\x00" + key.sign(info, ec.ECDSA(hashes.SHA256()))
    body = info + algorithm + b"\x03" + _der_length(len(signature)) + signature
    return x509.load_der_x509_csr(b"\x30" + _der_length(len(body)) + body)


def two_sans(identity: SpiffeId = SLEEP, smuggled_dns: str = "evil.example") -> str:
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
    forged = _signed_again(info, _signature_algorithm(original), key)
    return forged.public_bytes(serialization.Encoding.PEM).decode("ascii")


def compressed_point(key: ec.EllipticCurvePrivateKey, identity: SpiffeId = SLEEP) -> str:
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
    uncompressed = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    point = public.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint
    )
    algorithm = uncompressed[2 : 2 + 2 + uncompressed[3]]  # AlgorithmIdentifier, as it was
    bits = b"\x03" + _der_length(len(point) + 1) + b"\x00" + point
    compressed = b"\x30" + _der_length(len(algorithm) + len(bits)) + algorithm + bits
    info = original.tbs_certrequest_bytes
    header = 2 + (info[1] & 0x7F if info[1] & 0x80 else 0)
    content = info[header:].replace(uncompressed, compressed)
    info = b"\x30" + _der_length(len(content)) + content
    forged = _signed_again(info, _signature_algorithm(original), key)
    return forged.public_bytes(serialization.Encoding.PEM).decode("ascii")


def with_name_constraints() -> str:
    constraints = x509.NameConstraints(
        permitted_subtrees=[x509.DNSName("evil")], excluded_subtrees=None
    )
    return csr_with([uri()], extensions=[(constraints, True)])


def with_ca_true() -> str:
    return csr_with([uri()], extensions=[(x509.BasicConstraints(ca=True, path_length=0), True)])


def with_key_cert_sign() -> str:
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    return csr_with([uri()], extensions=[(usage, True)])


def with_subject_cn_of_admin() -> str:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "system:masters")])
    return csr_with([uri()], subject=subject)


def no_san() -> str:
    return csr_with(None)


def other_identity() -> str:
    return csr_with([uri("spiffe://cluster.local/ns/kube-system/sa/admin")])


def other_trust_domain() -> str:
    return csr_with([uri("spiffe://evil.example/ns/default/sa/sleep")])


def uri_with_query() -> str:
    return csr_with([uri(SLEEP.uri + "?x=1")])


def uri_case_changed() -> str:
    return csr_with([uri(SLEEP.uri.upper())])


def uri_with_dot_segments() -> str:
    return csr_with([uri("spiffe://cluster.local/ns/default/sa/../sa/sleep")])


def uri_with_nul() -> str:
    return csr_with([uri(SLEEP.uri + "\x00.evil")])


def der_as_base64_without_armor() -> str:
    pem = csr_with([uri()])
    return "".join(line for line in pem.splitlines() if not line.startswith("-----"))


def armor_swapped_to_certificate() -> str:
    return csr_with([uri()]).replace("CERTIFICATE REQUEST", "CERTIFICATE")


def truncated_pem() -> str:
    pem = csr_with([uri()])
    return pem[: len(pem) // 2]


def unknown_version() -> str:
    """Version 64 instead of 0 (found by atheris: cryptography raises InvalidVersion, which is
    not a ValueError, and the CA answered INTERNAL with a traceback)."""
    der = x509.load_pem_x509_csr(csr_with([uri()]).encode()).public_bytes(
        serialization.Encoding.DER
    )
    return pem_of(der.replace(b"\x02\x01\x00", b"\x02\x01\x40", 1))


def body_not_base64() -> str:
    return "-----BEGIN CERTIFICATE REQUEST-----\n!!!!\n-----END CERTIFICATE REQUEST-----\n"


def body_is_not_asn1() -> str:
    return pem_of(b"\x30\x03\x02\x01")


def concatenated_two_csrs() -> str:
    return csr_with([uri()]) + csr_with([uri("spiffe://cluster.local/ns/kube-system/sa/admin")])


def csr_then_private_key() -> str:
    key_pem = _KEY.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return csr_with([uri()]) + key_pem


def text_before_block() -> str:
    return "Certificate Request:\n    Data: forged\n" + csr_with([uri()])
