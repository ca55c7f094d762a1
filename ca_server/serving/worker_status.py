"""`/debug/ca` for `meshca ca --workers N`: each worker publishes its part, the supervisor merges.

Why files: the supervisor owns the monitoring port but holds no signing material and sees no
issuance; each worker knows its own authority and the leaves it signed. A worker writes both
(public certificates only, never the key) as one small JSON file in the supervisor's per-run
directory, atomically (`meshca.files.atomic_write`: a reader sees the old file or the new one),
at most once per `interval` while it keeps issuing and at once when its authority changes. The
supervisor reads the files of its live workers on each request and builds the document with the
single CA's builder (`ca_server.serving.status.ca_document`): the authority from the most recently
written file (after a rotation that is the newest one), the leaves merged through an
`IssuedLeaves` of the single CA's capacity, recorded oldest issuance first so that the latest leaf
per identity wins. The view is therefore at most about `interval` old.

The authority slots (`ca_server.authority.report`) are shared state: every worker converges on
the same slots and reads the same published figures, so any worker's section is the CA's. A
worker writes its section with its part (and again whenever its section changes); the
supervisor shows the section that changed most recently, i.e. the newest view of the slots (a
worker that has not seen the latest change yet, or whose figures are a round older, loses).

Each worker publishes every leaf it holds (bounded by `IssuedLeaves`' capacity), not only its
soonest ones: an identity renewed on another worker would otherwise show its stale leaf as
"expiring soon".

Concurrency: the publisher runs as a task on the worker's event loop and writes in a thread; the
merge runs in the supervisor's monitoring thread and only reads files.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ca_server.fleet import ISSUED_LEAVES_CAPACITY, IssuedLeaf, IssuedLeaves
from ca_server.serving.status import SigningChain, ca_document
from meshca.clock import Clock
from meshca.files import atomic_write

log = logging.getLogger(__name__)

PUBLISH_INTERVAL = 1.0
_POLL_FRACTION = 5  # the publisher looks `_POLL_FRACTION` times per interval for a new authority
FORMAT = 1


class SlotsSnapshot(Protocol):
    """The authority slots' latest report (`ca_server.authority.ReportSnapshot`)."""

    @property
    def section(self) -> dict[str, Any]: ...  # `authority_report.status_section`

    @property
    def changed_at(self) -> datetime: ...  # when the section last changed

    @property
    def version(self) -> int: ...  # bumped at each change


@dataclass(frozen=True)
class PublishedChain:
    """A worker's signing chain as read back by the supervisor: what `ca_document` shows."""

    cert: x509.Certificate
    intermediates: tuple[x509.Certificate, ...]
    roots: tuple[x509.Certificate, ...]
    not_after: datetime


@dataclass(frozen=True)
class WorkerPart:
    written_at: datetime
    chain: PublishedChain
    leaves: list[IssuedLeaf]
    slots: dict[str, Any] | None = None  # the worker's `authority.report.status_section`
    slots_changed_at: datetime | None = None  # when that section last changed


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(Encoding.PEM).decode()


def encode_part(
    chain: SigningChain,
    leaves: Iterable[IssuedLeaf],
    written_at: datetime,
    slots: SlotsSnapshot | None = None,
) -> str:
    return json.dumps(
        {
            "format": FORMAT,
            "written_at": written_at.isoformat(),
            "cert": _pem(chain.cert),
            "intermediates": [_pem(c) for c in chain.intermediates],
            "roots": [_pem(c) for c in chain.roots],
            "chain_not_after": chain.not_after.isoformat(),
            "leaves": [
                [
                    leaf.identity,
                    leaf.serial_hex,
                    leaf.issued_at.isoformat(),
                    leaf.not_after.isoformat(),
                ]
                for leaf in leaves
            ],
            "slots": slots.section if slots is not None else None,
            "slots_changed_at": slots.changed_at.isoformat() if slots is not None else None,
        }
    )


def decode_part(text: str) -> WorkerPart:
    """Raises `ValueError` (or `KeyError`/`TypeError`) for a file that is not a worker part."""
    raw: dict[str, Any] = json.loads(text)
    if raw.get("format") != FORMAT:
        raise ValueError(f"unknown format {raw.get('format')!r}")
    chain = PublishedChain(
        cert=x509.load_pem_x509_certificate(raw["cert"].encode()),
        intermediates=tuple(
            x509.load_pem_x509_certificate(c.encode()) for c in raw["intermediates"]
        ),
        roots=tuple(x509.load_pem_x509_certificate(c.encode()) for c in raw["roots"]),
        not_after=datetime.fromisoformat(raw["chain_not_after"]),
    )
    leaves = [
        IssuedLeaf(identity, serial, datetime.fromisoformat(issued), datetime.fromisoformat(until))
        for identity, serial, issued, until in raw["leaves"]
    ]
    slots = raw.get("slots")
    if slots is not None and not isinstance(slots, dict):
        raise ValueError("slots is not an object")
    changed_at = raw.get("slots_changed_at")
    return WorkerPart(
        datetime.fromisoformat(raw["written_at"]),
        chain,
        leaves,
        slots,
        datetime.fromisoformat(changed_at) if slots is not None and changed_at else None,
    )


class WorkerStatusPublisher:
    """Keeps `path` holding this worker's part: the current `authority`, its leaves and (with
    self-signed slots) the `slots` report."""

    def __init__(
        self,
        path: Path,
        authority: Callable[[], SigningChain],
        leaves: IssuedLeaves,
        clock: Clock,
        interval: float = PUBLISH_INTERVAL,
        slots: Callable[[], SlotsSnapshot | None] = lambda: None,
    ) -> None:
        self._path = path
        self._authority = authority
        self._leaves = leaves
        self._clock = clock
        self._interval = interval
        self._slots = slots
        self._published_authority: object = None
        self._published_recorded = -1
        self._published_slots = 0
        self._published_at = float("-inf")

    def publish(self) -> None:
        """Writes the part now (blocking: file I/O and fsync)."""
        authority, recorded, slots = self._authority(), self._leaves.recorded, self._slots()
        part = encode_part(authority, self._leaves.latest(), self._clock.now(), slots)
        atomic_write(self._path, part)
        self._published_authority, self._published_recorded = authority, recorded
        self._published_slots = slots.version if slots is not None else 0
        self._published_at = self._clock.monotonic()

    def due(self) -> bool:
        if self._authority() is not self._published_authority:
            return True
        slots = self._slots()
        if slots is not None and slots.version != self._published_slots:
            return True
        return (
            self._leaves.recorded != self._published_recorded
            and self._clock.monotonic() - self._published_at >= self._interval
        )

    async def run(self) -> None:
        """Publishes whenever `due`, until cancelled; a failed write is logged and retried at
        the next interval (the supervisor keeps showing the previous part meanwhile)."""
        while True:
            await self._clock.sleep(self._interval / _POLL_FRACTION)
            if not self.due():
                continue
            try:
                await asyncio.to_thread(self.publish)
            except OSError as exc:
                log.warning("cannot write /debug/ca part %s: %s", self._path, exc)
                self._published_at = self._clock.monotonic()

    def remove(self) -> None:
        self._path.unlink(missing_ok=True)


def merged_document(
    part_files: Iterable[Path],
    started: datetime,
    now: datetime,
    capacity: int = ISSUED_LEAVES_CAPACITY,
) -> dict[str, Any] | None:
    """The `/debug/ca` document over the workers whose parts are in `part_files`; `None` when no
    worker has published yet. A missing file (a worker exiting) is skipped; an unreadable one
    is logged and skipped, so one bad part never hides the others."""
    parts: list[WorkerPart] = []
    for path in part_files:
        try:
            parts.append(decode_part(path.read_text()))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable /debug/ca part %s: %s", path, exc)
    if not parts:
        return None
    newest = max(parts, key=lambda part: part.written_at)
    merged = IssuedLeaves(capacity)
    for leaf in sorted(
        (leaf for part in parts for leaf in part.leaves), key=lambda leaf: leaf.issued_at
    ):
        merged.record(leaf)
    document = ca_document(newest.chain, merged, started, now, _newest_slots(parts))
    document["workers_reporting"] = len(parts)
    return document


def _newest_slots(parts: list[WorkerPart]) -> dict[str, Any] | None:
    """The slots section that changed most recently (see the module docstring)."""
    with_slots = [p for p in parts if p.slots is not None and p.slots_changed_at is not None]
    if not with_slots:
        return None
    return max(with_slots, key=lambda part: part.slots_changed_at or part.written_at).slots
