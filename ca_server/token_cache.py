"""Verified bearer tokens, remembered per token digest until the token expires.

A workload's agent sends the same projected token on every call until the kubelet rotates it,
so caching turns "one verification per certificate request" (a TokenReview API call, a JWT
signature check) into "one per token". Only the SHA-256 of (scope, token) is kept, never the
token; the scope is the cluster id for TokenReview, so one cluster's answer is never reused
for another. The expiry is the token's own `exp` claim, capped so a revoked token (or a JWKS
key withdrawn after a leak) stops working within `max_ttl` even if the token lives far longer.

Concurrency: used by handler code, which runs on the completion-queue thread or on the event
loop (`ca_server.serving.cq_server`); a lock makes each lookup and insert one step.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

import jwt

V = TypeVar("V")


def token_digest(scope: str, token: str) -> str:
    return hashlib.sha256(f"{scope}\0{token}".encode()).hexdigest()


@dataclass(frozen=True)
class TokenShape:
    """What an unverified JWT says about itself: only good for refusing early or bounding a
    cache entry, never for trusting the token."""

    expires: datetime | None


def token_shape(token: str) -> TokenShape | None:
    """The unverified shape of a JWT; `None` when the token is not a JWT at all."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    exp = claims.get("exp")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        return TokenShape(expires=None)
    try:
        return TokenShape(expires=datetime.fromtimestamp(exp, UTC))
    except (OverflowError, OSError, ValueError):
        return TokenShape(expires=None)


def token_expiry(token: str) -> datetime | None:
    """The `exp` claim of a JWT, unverified (the caller has just vouched for the token; the
    claim only bounds how long that answer is trusted); `None` for an opaque token or no `exp`."""
    shape = token_shape(token)
    return shape.expires if shape is not None else None


class VerifiedTokenCache(Generic[V]):
    """A bounded LRU map from token digest to a value, each entry with its own expiry."""

    def __init__(self, max_entries: int = 10_000, max_ttl: timedelta = timedelta(minutes=5)):
        self._entries: OrderedDict[str, tuple[datetime, V]] = OrderedDict()
        self._max_entries = max_entries
        self.max_ttl = max_ttl
        self._lock = threading.Lock()

    def get(self, digest: str, now: datetime) -> V | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            expires, value = entry
            if now >= expires:
                del self._entries[digest]
                return None
            self._entries.move_to_end(digest)
            return value

    def put(self, digest: str, value: V, now: datetime, token_exp: datetime | None) -> None:
        expires = now + self.max_ttl
        if token_exp is not None:
            expires = min(expires, token_exp)
        if expires <= now:
            return
        with self._lock:
            self._entries[digest] = (expires, value)
            self._entries.move_to_end(digest)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
