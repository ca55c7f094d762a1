"""The rotation driver in-process on a fake clock: it sleeps until the next step is due, applies
it, and the signer, `root-cert.pem`, gauges and audit follow — no waiting for real time."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from prometheus_client import generate_latest

from ca_server.authority.driver_core import DriverSettings
from ca_server.authority.self_signed import SelfSignedDriver, cap_leaf_lifetimes
from ca_server.authority.slots import (
    AuthorityState,
    Phase,
    SlotRotationPolicy,
    authority_id,
    next_due,
)
from ca_server.authority.state_store import LocalAuthorityStateStore, SlotFactory, encode_state
from ca_server.config import TtlPolicy
from ca_server.fleet.leaf_ledger import DirectoryLedgerSink
from ca_server.metrics import CaMetrics
from ca_server.ttl import grant_validity
from certs import KeySpec, SpiffeId, generate_private_key, load_certs
from meshca.clock import FakeClock
from meshca.logs import configure_logging
from meshca.taint_notice import TAINT_NOTICE_NAME, decode_taint_notice
from tests.support.metrics import sample_value

START = datetime(2030, 1, 1, tzinfo=UTC)
LIFE = timedelta(minutes=60)
SLEEP = SpiffeId("cluster.local", "default", "sleep")


def _published(data_dir: Path) -> set[str]:
    return {authority_id(c) for c in load_certs((data_dir / "root-cert.pem").read_bytes())}


def test_driver_on_a_fake_clock_runs_a_whole_cycle(tmp_path: Path):
    audit_stream = io.StringIO()
    configure_logging("WARNING", audit_stream=audit_stream)
    clock = FakeClock(START)
    factory = SlotFactory(KeySpec(), "cluster.local", LIFE)
    store = LocalAuthorityStateStore(tmp_path, factory, clock)
    policy = SlotRotationPolicy(lifetime=LIFE, convergence=timedelta(seconds=15))
    metrics = CaMetrics()
    roots_seen: list[int] = []
    capped_ttl = cap_leaf_lifetimes(TtlPolicy(), policy)
    rotator = SelfSignedDriver(
        store,
        policy,
        factory,
        metrics,
        clock,
        DriverSettings(tmp_path, "ca-test", 5, DirectoryLedgerSink(tmp_path, "ca-test")),
        TtlPolicy(),
        on_change=lambda authority: roots_seen.append(len(authority.roots)),
    )

    async def scenario() -> None:
        await rotator.start()
        signer = rotator.signer
        first = rotator.state.active.id
        task = asyncio.create_task(rotator.run())

        async def at(minutes: float, updated: Callable[[], bool] = lambda: True) -> None:
            """Moves the clock, then waits until the driver has applied and converged on
            everything due (its steps run in worker threads) and the round's gauge and ledger
            updates are seen (`updated`): polled, not slept on, so a loaded machine only
            waits longer. The clock moves only once the driver sleeps on it: moved during a
            round, the driver would next wake a poll interval of fake time later, which never
            comes."""
            for _ in range(1000):
                if clock.sleepers:
                    break
                await asyncio.sleep(0.01)
            clock.advance(START + timedelta(minutes=minutes) - clock.now())
            for _ in range(1000):
                await asyncio.sleep(0.01)
                stored = await asyncio.to_thread(store.read)
                due = next_due(stored, policy)
                settled = encode_state(stored) == encode_state(rotator.state)
                if settled and due is not None and due > clock.now() and updated():
                    return
            raise AssertionError(f"the driver did not settle at {minutes} min")

        def sign() -> str:
            """Signs one leaf as the service would; returns the ID of the authority that did."""
            validity = grant_validity(
                0,
                capped_ttl,
                ca_not_after=signer.authority.not_after,
                now=clock.now(),
            )
            leaf = signer.sign(generate_private_key().public_key(), SLEEP, validity).leaf
            aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
            return aki.key_identifier.hex() if aki.key_identifier else ""

        def gauges() -> str:
            return generate_latest(metrics.registry).decode()

        def phase(authority: str, name: str) -> float | None:
            labels = {"authority": authority, "phase": name}
            return sample_value(gauges(), "meshca_ca_authority_phase", labels)

        def live_leaves(authority: str) -> float | None:
            labels = {"authority": authority}
            return sample_value(gauges(), "meshca_ca_authority_live_leaves", labels)

        try:
            assert sign() == first
            await at(29.9)
            assert _published(tmp_path) == {first}
            await at(30)
            prepared = rotator.state.prepared
            assert prepared is not None
            assert _published(tmp_path) == {first, prepared.id}
            assert sign() == first, "preparing does not change who signs"
            await at(50, lambda: phase(first, "old") == 1)
            assert rotator.state.active.id == prepared.id and sign() == prepared.id
            assert _published(tmp_path) == {first, prepared.id}
            assert phase(first, "old") == 1
            await at(51, lambda: (live_leaves(first), live_leaves(prepared.id)) == (0, 1))
            text = gauges()
            assert sample_value(text, "meshca_ca_authority_live_leaves", {"authority": first}) == 0
            assert (
                sample_value(text, "meshca_ca_authority_live_leaves", {"authority": prepared.id})
                == 1
            )
            await at(60, lambda: first not in gauges())
            # The first authority has expired and is dropped; the new one is at half its life,
            # so its successor is prepared in the same round.
            assert first not in _published(tmp_path) and prepared.id in _published(tmp_path)
            assert len(_published(tmp_path)) == 2
            text = gauges()
            assert first not in text
            assert sample_value(text, "citadel_server_root_cert_expiry_timestamp") == (
                prepared.not_after.timestamp()
            )
        finally:
            task.cancel()

    asyncio.run(scenario())
    assert roots_seen == [1, 2, 2, 2], "the ConfigMap publisher hears each bundle change"
    events = [json.loads(line) for line in audit_stream.getvalue().splitlines()]
    assert [e["msg"] for e in events] == [
        "authority-prepared",
        "authority-activated",
        "authority-retired",
        "authority-dropped",
        "authority-prepared",
    ]


def _notice(data_dir: Path) -> dict[str, datetime]:
    return decode_taint_notice((data_dir / TAINT_NOTICE_NAME).read_bytes())


def test_a_taint_made_elsewhere_is_published_beside_the_bundle(tmp_path: Path):
    """`meshca authority taint` changes only the shared state; the rotator's next round writes
    the taint (with the time the command recorded) into `meshca-taints.json` beside
    `root-cert.pem` — what agents read within a second — and `revoke` empties it. The bundle
    file stays a bundle: a taint does not touch it."""
    configure_logging("WARNING", audit_stream=io.StringIO())
    clock = FakeClock(START)
    factory = SlotFactory(KeySpec(), "cluster.local", LIFE)
    store = LocalAuthorityStateStore(tmp_path, factory, clock)
    policy = SlotRotationPolicy(lifetime=LIFE, automatic=False)
    rotator = SelfSignedDriver(
        store,
        policy,
        factory,
        CaMetrics(),
        clock,
        DriverSettings(tmp_path, "ca-test", 0.01, DirectoryLedgerSink(tmp_path, "ca-test")),
        TtlPolicy(),
    )

    async def scenario() -> None:
        await rotator.start()
        old = rotator.state.active.id
        assert _notice(tmp_path) == {}
        task = asyncio.create_task(rotator.run())

        async def operator(change: Callable[[AuthorityState], AuthorityState]) -> None:
            stored = await asyncio.to_thread(store.transact, change)
            for _ in range(500):
                clock.advance(0.02)  # the rotator polls on the fake clock
                await asyncio.sleep(0.01)
                if encode_state(rotator.state) == encode_state(stored):
                    return
            raise AssertionError("the rotator did not follow")

        try:
            fresh = factory.new(clock.now(), Phase.PREPARED)
            await operator(lambda s: s.prepare(lambda: fresh, clock.now(), "operator"))
            await operator(lambda s: s.activate(None, clock.now(), "operator"))
            new = rotator.state.active.id
            bundle = (tmp_path / "root-cert.pem").read_bytes()
            assert _notice(tmp_path) == {}
            tainted_at = clock.now() + timedelta(seconds=7)  # the command's clock, not the CA's
            await operator(lambda s: s.taint(old, tainted_at))
            assert _notice(tmp_path) == {old: tainted_at} == rotator.state.tainted_since()
            assert (tmp_path / "root-cert.pem").read_bytes() == bundle
            assert _published(tmp_path) == {old, new}
            await operator(lambda s: s.revoke(old, clock.now()))
            assert _notice(tmp_path) == {} and _published(tmp_path) == {new}
            leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            assert leftovers == []  # both written atomically (temporary file, then rename)
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_the_planned_handover_is_the_successors_activation_point(tmp_path: Path):
    """What Pod Certificates refresh by (`ca_server.kube.pod_certificates.timing`): the 5/6
    point of the active authority's life; with the activation gate waiting past it, the gate's
    deadline; under manual rotation, none."""
    clock = FakeClock(START)
    factory = SlotFactory(KeySpec(), "cluster.local", LIFE)

    def started(policy: SlotRotationPolicy, where: str) -> SelfSignedDriver:
        directory = tmp_path / where
        directory.mkdir()
        store = LocalAuthorityStateStore(directory, factory, clock)
        settings = DriverSettings(directory, "ca", 5, DirectoryLedgerSink(directory, "ca"))
        driver = SelfSignedDriver(store, policy, factory, CaMetrics(), clock, settings, TtlPolicy())
        asyncio.run(driver.start())
        return driver

    scheduled = started(SlotRotationPolicy(lifetime=LIFE), "scheduled")
    active = scheduled.state.active
    assert scheduled.planned_handover() == active.not_after - LIFE / 6
    gated_policy = SlotRotationPolicy(lifetime=LIFE, activate_at_coverage=0.9)
    gated = started(gated_policy, "gated")
    assert gated.planned_handover() == gated.state.active.not_after - LIFE / 6
    clock.advance(LIFE * 5 / 6 + timedelta(seconds=1))  # the 5/6 point passed, gate waiting
    assert gated.planned_handover() == gated_policy.activation_deadline(gated.state.active)
    manual = started(SlotRotationPolicy(lifetime=LIFE, automatic=False), "manual")
    assert manual.planned_handover() is None
