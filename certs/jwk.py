"""JWT signing keys as the SPIFFE JWT bundle and OIDC discovery publish them (RFC 7517/7518/7638).

A JWT-SVID key is named by its RFC 7638 thumbprint (`jwk_thumbprint`): the base64url SHA-256 of
the public key's required members in a fixed JSON form, so every replica, every agent and every
relying party computes the same `kid` from the key alone, and a `kid` cannot be claimed by a
different key. The algorithms are those every SPIFFE client verifies (py-spiffe has no EdDSA);
`none` and HMAC never appear here, so a token that names them finds no key.

Pure: keys in, dictionaries and bytes out.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, rsa

from certs.errors import KeyMaterialError
from certs.keys import PrivateKey, PublicKey

JWT_SVID_USE = "jwt-svid"  # the SPIFFE bundle's `use` for a JWT-SVID key
JWT_ALGORITHMS = ("ES256", "ES384", "RS256")
DEFAULT_JWT_ALGORITHM = "ES256"
_CURVES: dict[str, tuple[type[ec.EllipticCurve], str, int]] = {
    "ES256": (ec.SECP256R1, "P-256", 32),
    "ES384": (ec.SECP384R1, "P-384", 48),
}
_RSA_BITS = 2048


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _uint(value: int, size: int | None = None) -> str:
    length = size if size is not None else max(1, (value.bit_length() + 7) // 8)
    return _b64(value.to_bytes(length, "big"))


def new_jwt_key(algorithm: str) -> PrivateKey:
    """A fresh key for `algorithm` (one of `JWT_ALGORITHMS`)."""
    if algorithm in _CURVES:
        return ec.generate_private_key(_CURVES[algorithm][0]())
    if algorithm == "RS256":
        return rsa.generate_private_key(public_exponent=65537, key_size=_RSA_BITS)
    raise KeyMaterialError(
        f"JWT-SVID key algorithm {algorithm!r} is not supported; use one of "
        f"{', '.join(JWT_ALGORITHMS)}"
    )


def key_algorithm(key: PrivateKey | PublicKey) -> str:
    """The JWS algorithm a key signs with (an EC key's curve decides it)."""
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        for algorithm, (curve, _name, _size) in _CURVES.items():
            if isinstance(key.curve, curve):
                return algorithm
        raise KeyMaterialError(f"EC curve {key.curve.name} signs no supported JWT algorithm")
    if isinstance(key, rsa.RSAPrivateKey | rsa.RSAPublicKey):
        return "RS256"
    raise KeyMaterialError(f"{type(key).__name__} signs no supported JWT algorithm")


def _required_members(public: PublicKey) -> dict[str, str]:
    """The members RFC 7638 hashes, for an EC or RSA public key."""
    if isinstance(public, ec.EllipticCurvePublicKey):
        _curve, name, size = _CURVES[key_algorithm(public)]
        numbers = public.public_numbers()
        return {"crv": name, "kty": "EC", "x": _uint(numbers.x, size), "y": _uint(numbers.y, size)}
    if isinstance(public, rsa.RSAPublicKey):
        rsa_numbers = public.public_numbers()
        return {"e": _uint(rsa_numbers.e), "kty": "RSA", "n": _uint(rsa_numbers.n)}
    raise KeyMaterialError(f"{type(public).__name__} has no JWK form here")


def _public(key: PrivateKey | PublicKey) -> PublicKey:
    if isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        return key.public_key()
    return key


def jwk_thumbprint(key: PrivateKey | PublicKey) -> str:
    """RFC 7638 SHA-256 thumbprint, base64url: the key's `kid`."""
    members = _required_members(_public(key))
    canonical = json.dumps(members, separators=(",", ":"), sort_keys=True).encode("ascii")
    return _b64(hashlib.sha256(canonical).digest())


def public_jwk(key: PrivateKey | PublicKey) -> dict[str, str]:
    """The public key as a SPIFFE bundle entry: its members, `kid`, `alg` and `use`."""
    public = _public(key)
    return {
        **_required_members(public),
        "kid": jwk_thumbprint(public),
        "alg": key_algorithm(public),
        "use": JWT_SVID_USE,
    }


def jwks_document(keys: Iterable[Mapping[str, Any]], refresh_hint: int | None = None) -> bytes:
    """A JWKS (`{"keys": [...]}`) as bytes, with the SPIFFE bundle's optional refresh hint."""
    document: dict[str, Any] = {"keys": [dict(key) for key in keys]}
    if refresh_hint is not None:
        document["spiffe_refresh_hint"] = refresh_hint
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode("ascii")
