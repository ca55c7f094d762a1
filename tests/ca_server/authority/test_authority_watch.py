"""The plugged-in driver (`PluggedDriver.run`) on a fake source and a fake clock: reloads on
change, refuses unusable material, and survives whatever else the source throws at it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.authority.driver_core import DriverSettings
from ca_server.authority.plugged import PluggedDriver
from ca_server.config import TtlPolicy
from ca_server.errors import CaSetupError
from ca_server.fleet.leaf_ledger import DirectoryLedgerSink
from ca_server.metrics import CaMetrics
from certs import SigningAuthority, build_root_certificate, generate_private_key
from meshca.clock import FakeClock

NOW = datetime(2030, 1, 1, tzinfo=UTC)
POLL = timedelta(seconds=5)


def _authority(
    lifetime: timedelta = timedelta(days=365), also_trusted: SigningAuthority | None = None
) -> SigningAuthority:
    """A self-signed root signing directly; `also_trusted`'s root rides in its bundle (so the
    guard lets signing move there: workloads already have it)."""
    key = generate_private_key()
    cert = build_root_certificate(key, "cluster.local", now=NOW, lifetime=lifetime)
    extra = (also_trusted.cert,) if also_trusted is not None else ()
    return SigningAuthority(cert=cert, key=key, intermediates=(), roots=(cert, *extra))


class ScriptedSource:
    """Each poll takes the next step: a fingerprint (or an exception to raise) and what `load`
    returns (or raises) should that fingerprint be new."""

    description = "scripted source"

    def __init__(
        self,
        initial: SigningAuthority,
        steps: list[tuple[str | Exception, SigningAuthority | Exception | None]],
    ):
        self._steps = steps
        self.polls = 0
        self._fingerprint: str | Exception = "initial"
        self._load: SigningAuthority | Exception | None = initial

    def fingerprint(self) -> str:
        if self.polls:  # the first call is the watcher's starting point
            self._fingerprint, self._load = self._steps[self.polls - 1]
        self.polls += 1
        if isinstance(self._fingerprint, Exception):
            raise self._fingerprint
        return self._fingerprint

    def load(self, now: datetime) -> SigningAuthority:
        if isinstance(self._load, Exception):
            raise self._load
        assert self._load is not None
        return self._load


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_watcher_reloads_and_outlives_failures(tmp_path: Path):
    replacement = _authority(timedelta(days=730))  # outlives the original: gauges tell them apart
    original, broken_meanwhile = _authority(also_trusted=replacement), _authority()
    source = ScriptedSource(
        original,
        [
            (PermissionError("cacerts/ca-key.pem: permission denied"), None),
            ("half-copied", CaSetupError("ca-key.pem does not match ca-cert.pem")),
            ("half-copied", broken_meanwhile),  # same content: not retried
            ("copied", RuntimeError("an unexpected bug while loading")),
            ("copied", replacement),  # an unexpected failure is retried at the next poll
            ("copied", None),
        ],
    )
    clock = FakeClock(NOW)
    reloaded: list[SigningAuthority] = []
    metrics = CaMetrics()
    sink = DirectoryLedgerSink(tmp_path, "ca-test")
    settings = DriverSettings(tmp_path, "ca-test", POLL.total_seconds(), sink)
    driver = PluggedDriver(source, metrics, clock, settings, TtlPolicy())

    def gauges() -> tuple[float | None, ...]:
        return tuple(
            metrics.registry.get_sample_value(name)
            for name in (
                "citadel_server_root_cert_expiry_timestamp",
                "citadel_server_cert_chain_expiry_timestamp",
                "meshca_ca_root_cert_lifetime_seconds",
                "meshca_ca_cert_chain_lifetime_seconds",
            )
        )

    async def scenario() -> None:
        await driver.start()
        signer = driver.signer
        driver.on_change = reloaded.append  # as the server does, after start
        watcher = asyncio.create_task(driver.run())
        await _until(lambda: source.polls == 1)
        for poll in range(2, 6):
            clock.advance(POLL)
            await _until(lambda: source.polls == poll)  # noqa: B023
            await asyncio.sleep(0.05)  # let a load in a worker thread finish
            assert not watcher.done(), watcher.exception()
            assert signer.authority is original
            assert gauges() == _expected_gauges(original)
        clock.advance(POLL)
        await _until(lambda: signer.authority is replacement)
        assert reloaded == [replacement]
        # Istio's gauges went stale after a reload (istio#55464); these are set with it.
        assert gauges() == _expected_gauges(replacement)
        assert (tmp_path / "root-cert.pem").read_text() == replacement.root_bundle_pem
        watcher.cancel()

    asyncio.run(scenario())


def _expected_gauges(authority: SigningAuthority) -> tuple[float, ...]:
    """Root expiry, chain expiry, root lifetime, chain lifetime, from the certificates."""
    cert = authority.cert
    expiry = cert.not_valid_after_utc.timestamp()
    lifetime = (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
    return (expiry, expiry, lifetime, lifetime)
