"""The secrets the agent serves, and the in-memory cache that connects producers to consumers.

Producers (the scheduler fetching from the CA, the file-mounted watcher) `publish()` secrets
by resource name; consumers (SDS streams, file output, metrics) iterate `updates(name)` and see
the current value first, then every change. Everything here runs on one asyncio event loop;
producers living on other threads (watchdog) must hop onto the loop first
(`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from certs import load_certs

DEFAULT_RESOURCE = "default"
ROOT_RESOURCE = "ROOTCA"
FILE_CERT_PREFIX = "file-cert:"
FILE_ROOT_PREFIX = "file-root:"


class SecretUpdates(Protocol):
    """Anything yielding a name's current secret (once it exists), then each new version: the
    `SecretCache`, and what SDS and the Workload API serve from (`agent.sds.SecretResolver`,
    `agent.file_mounted.FileSecretProvider`)."""

    def updates(self, name: str) -> AsyncIterator[Secret]: ...


@dataclass(frozen=True)
class TlsSecret:
    """A certificate chain and its private key (SDS `tls_certificate`)."""

    name: str
    cert_chain_pem: str
    private_key_pem: str = field(repr=False)

    @property
    def version(self) -> str:
        return _digest(self.cert_chain_pem)


@dataclass(frozen=True)
class RootSecret:
    """A trust bundle (SDS `validation_context.trusted_ca`)."""

    name: str
    trusted_ca_pem: str

    @property
    def version(self) -> str:
        return _digest(self.trusted_ca_pem)


Secret = TlsSecret | RootSecret


def not_after(secret: Secret) -> datetime:
    """The leaf's expiry, or the earliest expiry in a trust bundle (the one to alert on)."""
    if isinstance(secret, TlsSecret):
        return load_certs(secret.cert_chain_pem)[0].not_valid_after_utc
    return min(cert.not_valid_after_utc for cert in load_certs(secret.trusted_ca_pem))


def _digest(text: str) -> str:
    """Content-derived version: equal content never looks like a change to Envoy."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class SecretCache:
    """Latest secret per resource name, with change notification for any number of watchers."""

    def __init__(self) -> None:
        self._secrets: dict[str, Secret] = {}
        self._changed = asyncio.Condition()
        self._listeners: list[Callable[[Secret], None]] = []
        self._removal_listeners: list[Callable[[str], None]] = []

    def get(self, name: str) -> Secret | None:
        return self._secrets.get(name)

    def names(self) -> list[str]:
        return sorted(self._secrets)

    def add_listener(self, listener: Callable[[Secret], None]) -> None:
        """Calls `listener(secret)` synchronously on every change (metrics, file output)."""
        self._listeners.append(listener)

    def add_removal_listener(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(name)` synchronously when a resource is removed (node mode)."""
        self._removal_listeners.append(listener)

    async def publish(self, secret: Secret) -> bool:
        """Stores `secret`; wakes watchers if it differs from what was held. Returns changed."""
        previous = self._secrets.get(secret.name)
        if previous is not None and previous.version == secret.version:
            return False
        self._secrets[secret.name] = secret
        for listener in self._listeners:
            listener(secret)
        async with self._changed:
            self._changed.notify_all()
        return True

    async def remove(self, name: str) -> None:
        """Forgets a resource (node mode: an identity left the node)."""
        if self._secrets.pop(name, None) is not None:
            for listener in self._removal_listeners:
                listener(name)
            async with self._changed:
                self._changed.notify_all()

    async def updates(self, name: str) -> AsyncIterator[Secret]:
        """Yields the current secret for `name` (once it exists), then each new version."""
        last_version: str | None = None
        while True:
            secret = await self._next_version(name, last_version)
            last_version = secret.version
            yield secret

    async def _next_version(self, name: str, seen: str | None) -> Secret:
        def is_new() -> bool:
            current = self._secrets.get(name)
            return current is not None and current.version != seen

        async with self._changed:
            await self._changed.wait_for(is_new)
            return self._secrets[name]
