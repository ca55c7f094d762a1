"""Signing one JWT-SVID: the claims the CA decides, and the one claim the caller names.

`sub` is the identity the CA authenticated (or the pod a node agent may impersonate); `aud` is
the caller's list, bounded (`MAX_AUDIENCES` of at most `MAX_AUDIENCE_BYTES` each, none empty);
`iat` now, `exp` now + the configured TTL but never past the signing key's `not_after`; `iss`
the OIDC issuer when discovery is on; `jti` 128 random bits. The header carries `kid` (the key's
RFC 7638 thumbprint) and `alg` from the key itself; nothing else the caller sends reaches the
token.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

import jwt

from ca_server.errors import InvalidRequestError, SigningKeyUnavailableError
from ca_server.jwt_svid.keys import MIN_TOKEN_LIFETIME, JwtKey
from certs import SpiffeId

MAX_AUDIENCES = 32
MAX_AUDIENCE_BYTES = 512


@dataclass(frozen=True)
class MintedToken:
    token: str
    spiffe_id: str
    kid: str
    issued_at: datetime
    expires_at: datetime


def checked_audiences(audiences: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The audience list, refused (`InvalidRequestError`, INVALID_ARGUMENT) when empty, too
    long, or holding an empty or oversized entry; duplicates removed, order kept."""
    if not audiences:
        raise InvalidRequestError(
            "audience-missing",
            "a JWT-SVID needs at least one audience (`aud`); name the "
            "service that will validate the token",
        )
    if len(audiences) > MAX_AUDIENCES:
        raise InvalidRequestError(
            "audience-too-many",
            f"{len(audiences)} audiences asked for; a JWT-SVID may name at most {MAX_AUDIENCES}",
        )
    for audience in audiences:
        if not audience or len(audience.encode()) > MAX_AUDIENCE_BYTES:
            raise InvalidRequestError(
                "audience-invalid",
                f"each audience must be 1 to {MAX_AUDIENCE_BYTES} bytes "
                f"(got {len(audience.encode())})",
            )
    return tuple(dict.fromkeys(audiences))


def mint_jwt_svid(
    key: JwtKey,
    identity: SpiffeId,
    audiences: tuple[str, ...],
    ttl: timedelta,
    now: datetime,
    issuer: str | None = None,
) -> MintedToken:
    """Signs the token with `key` (the active one). A key too close to its end to sign a
    useful token is `SigningKeyUnavailableError` (UNAVAILABLE: the caller retries; the message
    tells the operator what replaces the key)."""
    expires = min(now + ttl, key.not_after)
    if expires - now < MIN_TOKEN_LIFETIME:
        raise SigningKeyUnavailableError(
            "jwt-key-expired",
            f"the active JWT-SVID key {key.kid} expires at {key.not_after.isoformat()} and can "
            "no longer sign a token (was the CA down past its key rotation?). With automatic "
            "rotation the CA activates a new key at its next key poll: retry shortly. With "
            "--no-root-rotation run `meshca authority prepare --jwt` then `meshca authority "
            "activate --jwt --force`; `meshca authority show --jwt` shows the keys",
        )
    issued_at = int(now.timestamp())
    claims: dict[str, object] = {
        "sub": identity.uri,
        "aud": list(audiences) if len(audiences) > 1 else audiences[0],
        "iat": issued_at,
        "exp": int(expires.timestamp()),
        "jti": secrets.token_urlsafe(16),
    }
    if issuer:
        claims["iss"] = issuer
    kid = key.kid
    token = jwt.encode(claims, key.key, algorithm=key.algorithm, headers={"kid": kid, "typ": "JWT"})
    return MintedToken(
        token,
        identity.uri,
        kid,
        datetime.fromtimestamp(issued_at, now.tzinfo),
        datetime.fromtimestamp(int(expires.timestamp()), now.tzinfo),
    )
