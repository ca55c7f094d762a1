"""What Istio's agent (`pilot-agent`) puts on the wire to its CA, rebuilt with `cryptography`
so the compatibility tests send exactly that rather than what meshca's own agent sends.

Recorded at a meshca CA from the real `pilot-agent` (issue #22) and matching Istio's source:

- the CSR: an RSA-2048 key by default (`WORKLOAD_RSA_KEY_SIZE`), EC P-256 with
  `ECC_SIGNATURE_ALGORITHM=ECDSA`; a subject holding one *empty* organization attribute (Go's
  `pkix.Name{Organization: []string{""}}`, a PrintableString of length 0); one SubjectAltName
  extension, critical, holding only the SPIFFE URI; signed with SHA-256;
- the request: `validity_duration` from `SECRET_TTL` (24 h), the request metadata
  `CertSigner: ""`, the headers `authorization: Bearer <token>` and `ClusterID: Kubernetes`;
- `cert-chain.pem`, which `PROV_CERT` later presents over mTLS: every element of the CA's
  `cert_chain` concatenated, so the leaf, its intermediates, then the whole root bundle (both
  roots during a root overlap).
"""

from __future__ import annotations

from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.name import _ASN1Type
from cryptography.x509.oid import NameOID

from certs import SpiffeId

KeyKind = Literal["rsa-2048", "ec-p256"]
SECRET_TTL_SECONDS = 24 * 3600
# `ISTIO_META_CERT_SIGNER` unset: the key is sent all the same, with an empty value.
CERT_SIGNER_METADATA = {"CertSigner": ""}
# `ISTIO_META_CLUSTER_ID`'s default, sent as a header on every CSR.
CLUSTER_ID_HEADER = ("clusterid", "Kubernetes")


def istio_key(kind: KeyKind) -> rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey:
    if kind == "rsa-2048":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return ec.generate_private_key(ec.SECP256R1())


def istio_csr(identity: SpiffeId, key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    """The CSR `pilot-agent` sends for `identity`."""
    subject = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "", _type=_ASN1Type.PrintableString)]
    )
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)])
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(san, critical=True)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def key_pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    """`key.pem` as Istio writes it (PKCS#8)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def istio_cert_chain_pem(cert_chain: list[str]) -> bytes:
    """`cert-chain.pem` as Istio writes it from a CA response: all elements, root bundle
    included."""
    return "".join(
        element if element.endswith("\n") else element + "\n" for element in cert_chain
    ).encode()
