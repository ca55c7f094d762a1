"""Private keys: which kinds meshca issues for, how they are made, serialized and matched.

Workload keys default to ECDSA P-256 (what ztunnel and modern Istio use); RSA 2048/3072/4096 and
P-384 exist for the Istio variables that ask for them. Ed25519 is deliberately absent: Envoy and
Istio peers do not accept it for workload certificates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from certs.errors import KeyMaterialError

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey

_CURVES: dict[str, ec.EllipticCurve] = {"P256": ec.SECP256R1(), "P384": ec.SECP384R1()}
_RSA_SIZES = (2048, 3072, 4096)


@dataclass(frozen=True)
class KeySpec:
    """What kind of key to generate: `ECDSA` with a curve, or `RSA` with a modulus size."""

    algorithm: Literal["ECDSA", "RSA"] = "ECDSA"
    curve: str = "P256"
    rsa_bits: int = 2048

    def __post_init__(self) -> None:
        if self.algorithm == "ECDSA" and self.curve not in _CURVES:
            raise KeyMaterialError(
                f"unsupported ECDSA curve {self.curve!r}; use one of {sorted(_CURVES)}"
            )
        if self.algorithm == "RSA" and self.rsa_bits not in _RSA_SIZES:
            raise KeyMaterialError(
                f"unsupported RSA key size {self.rsa_bits}; use one of {_RSA_SIZES}"
            )
        if self.algorithm not in ("ECDSA", "RSA"):
            raise KeyMaterialError(
                f"unsupported key algorithm {self.algorithm!r}; use ECDSA or RSA"
            )

    @classmethod
    def parse(cls, text: str) -> KeySpec:
        """Reads `ec-p256`, `ec-p384`, `rsa-2048`, `rsa-3072` or `rsa-4096` (case-insensitive)."""
        kind, _, size = text.strip().lower().partition("-")
        if kind in ("ec", "ecdsa"):
            return cls("ECDSA", curve=(size or "p256").upper())
        if kind == "rsa":
            try:
                return cls("RSA", rsa_bits=int(size or "2048"))
            except ValueError:
                pass
        raise KeyMaterialError(
            f"unknown key type {text!r}; use ec-p256, ec-p384, rsa-2048/3072/4096"
        )

    def __str__(self) -> str:
        if self.algorithm == "ECDSA":
            return f"ec-{self.curve.lower()}"
        return f"rsa-{self.rsa_bits}"


def generate_private_key(spec: KeySpec | None = None) -> PrivateKey:
    """A fresh key of the given kind (default ECDSA P-256)."""
    spec = spec or KeySpec()
    if spec.algorithm == "ECDSA":
        return ec.generate_private_key(_CURVES[spec.curve])
    return rsa.generate_private_key(public_exponent=65537, key_size=spec.rsa_bits)


def private_key_to_pem(key: PrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM: what Envoy, Istio's file layout and Kubernetes Secrets hold."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_private_key(pem: bytes | str) -> PrivateKey:
    """Parses an unencrypted PEM private key (PKCS#8, SEC1 or PKCS#1) of a supported kind."""
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # the last: an unknown key OID
        raise KeyMaterialError(
            "not an unencrypted PEM private key (expected PKCS#8, SEC1 or PKCS#1)"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise KeyMaterialError(
            f"unsupported private key type {type(key).__name__}; use ECDSA or RSA"
        )
    return key


def public_key_of(cert: x509.Certificate | x509.CertificateSigningRequest) -> PublicKey:
    """The certificate's or CSR's public key, refused if not ECDSA or RSA."""
    try:
        key = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:  # an unknown key or curve OID
        raise KeyMaterialError(f"unsupported or malformed public key ({exc})") from None
    if key_family(key) is None:
        raise KeyMaterialError(
            f"unsupported public key type {type(key).__name__}; use ECDSA or RSA"
        )
    return cast(PublicKey, key)


def key_family(key: Any) -> KeyFamily | None:
    """ "ec" or "rsa" for a supported public or private key, else `None`.

    Why not `isinstance`: against cryptography's ABCs it runs a Python-level
    `__instancecheck__` on every call, on the CA's per-request path. The answer depends only on
    the concrete type, of which there are a handful, so it is memoised per type (a pure
    function of the type: the memo holds no state that could differ between callers)."""
    kind = type(key)
    try:
        return _FAMILY_BY_TYPE[kind]
    except KeyError:
        family: KeyFamily | None = None
        if issubclass(kind, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey):
            family = "ec"
        elif issubclass(kind, rsa.RSAPublicKey | rsa.RSAPrivateKey):
            family = "rsa"
        _FAMILY_BY_TYPE[kind] = family
        return family


KeyFamily = Literal["ec", "rsa"]
_FAMILY_BY_TYPE: dict[type, KeyFamily | None] = {}


def public_key_bytes(key: PrivateKey | PublicKey) -> bytes:
    """DER SubjectPublicKeyInfo, the canonical form to compare two keys by."""
    public = (
        key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) else key
    )
    return public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def key_matches_certificate(key: PrivateKey, cert: x509.Certificate) -> bool:
    """True when `cert` certifies the public half of `key`."""
    return public_key_bytes(key) == public_key_bytes(public_key_of(cert))


def signature_hash_for(key: PrivateKey) -> hashes.SHA256 | hashes.SHA384:
    """SHA-384 for P-384 keys (matching strength), SHA-256 for everything else."""
    if key_family(key) == "ec" and cast(ec.EllipticCurvePrivateKey, key).curve.key_size >= 384:
        return hashes.SHA384()
    return hashes.SHA256()


def describe_key(key: PrivateKey | PublicKey) -> str:
    """A short human name such as `ec-p256` or `rsa-2048`, for logs and errors."""
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        return f"ec-{key.curve.name}"
    return f"rsa-{key.key_size}"
