"""The taint notice beside the root file (`agent.taint_file`) feeds the scheduler's one taint
path (`agent.taints`, `CertificateScheduler.taints_learned`), as the report answer does.

Real files in the kubelet's ConfigMap layout (`..data` swapped per generation, both keys of
`istio-ca-root-cert` side by side), followed by the real `PolledFile` on the real clock with
short intervals; the scheduler is a node agent's on a fake clock with a fake signer (its
pacing is the subject of tests/agent/test_taint_resign.py). What it shows: a notice's taint
re-signs every leaf of the authority, paced over the window, each once across both sources; a
notice that lags behind forgets the taints only notices named (not those the report's answer
confirmed) and cancels nothing, one that vanishes or is malformed forgets nothing; a
malformed or oversized one is one WARNING and a count; a future taint time counts from now; a
taint known before a previous run's leaf is restored re-signs it too; a CA that keeps
answering with a tainted authority gets one early re-sign per identity per taint, not one
per report; and no notice of any shape (10,000
random ones, Hypothesis) makes the watch raise or stop following the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from agent.cert_state import RestoredCertificate
from agent.config import AgentConfig
from agent.errors import NoPreviousCertificate
from agent.metrics import AgentMetrics
from agent.scheduler import CertificateScheduler, StartHook
from agent.secrets import SecretCache
from agent.signing import SignedCertificate
from agent.taint_file import TaintFileWatch, taint_notice_beside
from agent.taints import MAX_KNOWN_TAINTS, SOURCE_REPORT, SOURCE_TAINT_NOTICE, KnownTaints
from ca_server.authority.slots import authority_id
from certs import SpiffeId
from meshca.clock import FakeClock, SystemClock
from meshca.taint_notice import MAX_NOTICE_BYTES, TAINT_NOTICE_NAME, encode_taint_notice
from tests.agent.test_taint_resign import (
    IDENTITIES,
    START,
    TTL,
    WINDOW,
    report_taint,
)
from tests.support.agent_scheduler import scheduler_for
from tests.support.agent_wiring import advance_settled, until
from tests.support.fake_ca import FakeSigner
from tests.support.kubelet_volume import kubelet_project
from tests.support.pki import TestCa
from tests.support.taint_notices import any_notice

POLL = 0.02  # the watch's stat interval here (the agent's default is 1 s)
ROOT_PEM = "-----BEGIN CERTIFICATE-----\n(the bundle; not read here)\n-----END CERTIFICATE-----\n"


@pytest.fixture
def mount() -> Iterator[Path]:
    """A ConfigMap volume's directory (short path, removed after)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="tn-"))
    yield path / "istio"
    shutil.rmtree(path, ignore_errors=True)


def project(mount: Path, notice: str | None) -> None:
    """The kubelet projecting `istio-ca-root-cert`: the bundle, and the notice key if any."""
    files = {"root-cert.pem": ROOT_PEM}
    if notice is not None:
        files[TAINT_NOTICE_NAME] = notice
    kubelet_project(mount, files)


@dataclass
class Rig:
    scheduler: CertificateScheduler
    signer: FakeSigner
    clock: FakeClock
    metrics: AgentMetrics
    watch: TaintFileWatch

    def due_offsets(self) -> dict[SpiffeId, float]:
        """Seconds from now to each identity's pending timer."""
        now = self.clock.now()
        return {
            s.identity: (s.due_at - now).total_seconds()
            for s in self.scheduler.states.values()
            if s.due_at is not None
        }


@contextlib.asynccontextmanager
async def rig(
    mount: Path,
    identities: frozenset[SpiffeId] = IDENTITIES,
    start_hook: StartHook | None = None,
) -> AsyncIterator[Rig]:
    """A node scheduler whose identities all hold a leaf of `signer.pki`, and the taint file
    beside `mount/root-cert.pem` followed into it."""
    clock = FakeClock(START)
    signer = FakeSigner(TestCa(START), clock)
    config = AgentConfig(
        secret_ttl=TTL, node_mode=True, identities=(("ns", "static"),), taint_resign_window=WINDOW
    )
    metrics, cache = AgentMetrics(clock), SecretCache()
    scheduler = scheduler_for(
        config, signer, cache, clock, metrics, rng=random.Random(5), start_hook=start_hook
    )
    path = taint_notice_beside(mount / "root-cert.pem")
    assert path == mount / TAINT_NOTICE_NAME
    watch = TaintFileWatch(path, scheduler.taints_learned, SystemClock(), metrics, interval=POLL)
    await watch.start()
    task = asyncio.create_task(scheduler.run())
    try:
        scheduler.set_identities(identities)
        await until(lambda: scheduler.installs >= len(identities))
        yield Rig(scheduler, signer, clock, metrics, watch)
    finally:
        await watch.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await scheduler.aclose()


def resigns(metrics: AgentMetrics) -> float:
    return metrics.taint_resigns._value.get()


def refusals(metrics: AgentMetrics) -> float:
    return metrics.taint_notice_refused._value.get()


def test_a_taint_in_the_configmap_mount_resigns_every_leaf_once_across_both_sources(
    mount: Path,
) -> None:
    async def main() -> None:
        project(mount, encode_taint_notice({}))
        async with rig(mount) as r:
            old = authority_id(r.signer.pki.cert)
            renewal = r.due_offsets()
            assert min(renewal.values()) > WINDOW.total_seconds()  # nothing due in the window
            assert r.watch.accepted == 1 and resigns(r.metrics) == 0

            r.signer.pki = TestCa(START)  # activation, then the taint, just now
            project(mount, encode_taint_notice({old: START}))
            await until(lambda: resigns(r.metrics) == len(IDENTITIES))
            drawn = r.due_offsets()
            assert all(0 < d <= WINDOW.total_seconds() for d in drawn.values()), drawn
            assert max(drawn.values()) - min(drawn.values()) > WINDOW.total_seconds() / 3

            # The notice lags behind (a CA process one poll late) or loses its key: a taint
            # only the notice named goes with it, but every scheduled re-sign stays as it was.
            project(mount, encode_taint_notice({}))
            await until(lambda: r.watch.accepted == 3)
            assert old not in r.scheduler.taints
            project(mount, None)
            await asyncio.sleep(10 * POLL)
            assert r.due_offsets() == drawn
            # The report then names the same taint: known again, and nothing moves twice.
            assert report_taint(r.scheduler, r.clock, {old: 0.0}) == 0
            assert r.due_offsets() == drawn and old in r.scheduler.taints
            # Confirmed by the CA's answer: a notice that does not name it forgets nothing.
            project(mount, encode_taint_notice({}))
            await until(lambda: r.watch.accepted == 4)
            assert old in r.scheduler.taints

            before = len(r.signer.calls)
            await advance_settled(r.clock, r.scheduler, WINDOW.total_seconds())
            assert sorted(r.signer.identities[before:]) == sorted(IDENTITIES)
            new = authority_id(r.signer.pki.cert)
            assert r.scheduler.leaf_authorities() == {new}
            assert resigns(r.metrics) == len(IDENTITIES)

    asyncio.run(main())


def test_a_taint_the_report_brought_first_is_not_moved_by_the_notice(mount: Path) -> None:
    async def main() -> None:
        async with rig(mount) as r:  # no notice yet: a CA that has not published one
            old = authority_id(r.signer.pki.cert)
            assert report_taint(r.scheduler, r.clock, {old: 0.0}) == len(IDENTITIES)
            drawn = r.due_offsets()
            project(mount, encode_taint_notice({old: START - timedelta(seconds=30)}))
            await until(lambda: r.watch.accepted == 1)
            assert r.due_offsets() == drawn
            assert resigns(r.metrics) == len(IDENTITIES)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"version": 1, "tainted": [{"authority": "AB"}]}', "missing ['tainted_at']"),
        ("-----BEGIN CERTIFICATE-----\n", "not a JSON document"),
        (" " * (MAX_NOTICE_BYTES + 1), f"the limit is {MAX_NOTICE_BYTES}"),
    ],
)
def test_a_malformed_or_oversized_notice_is_one_warning_and_untaints_nothing(
    mount: Path, content: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        old_at = START  # nobody is due at once: every re-sign is pending while the test looks
        async with rig(mount) as r:
            old = authority_id(r.signer.pki.cert)
            r.signer.pki = TestCa(START)
            project(mount, encode_taint_notice({old: old_at}))
            await until(lambda: resigns(r.metrics) == len(IDENTITIES))
            drawn = r.due_offsets()
            with caplog.at_level(logging.WARNING, logger="agent.taint_file"):
                project(mount, content)
                await until(lambda: refusals(r.metrics) == 1)
                await asyncio.sleep(20 * POLL)  # polls of the same bad version say nothing
            warnings = [
                rec.getMessage() for rec in caplog.records if rec.name == "agent.taint_file"
            ]
            assert len(warnings) == 1, warnings
            assert said in warnings[0] and "taints already known stay" in warnings[0]
            assert refusals(r.metrics) == 1
            assert r.scheduler.taints.get(old) == old_at and r.due_offsets() == drawn
            # A good notice after it is read again; an authority that signed none of the
            # agent's leaves moves nothing.
            project(mount, encode_taint_notice({old: old_at, "cd" * 20: START}))
            await until(lambda: "cd" * 20 in r.scheduler.taints)
            assert resigns(r.metrics) == len(IDENTITIES) and r.due_offsets() == drawn

    asyncio.run(main())


def test_a_missing_notice_is_said_once_at_info_and_read_when_it_appears(
    mount: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        project(mount, None)  # Istio's CA, or an older meshca: no notice key
        with caplog.at_level(logging.INFO, logger="agent.taint_file"):
            async with rig(mount) as r:
                await asyncio.sleep(10 * POLL)
                said = [(x.levelno, x.getMessage()) for x in caplog.records]
                assert [level for level, _ in said] == [logging.INFO], said
                assert "no taint notice at" in said[0][1]
                assert refusals(r.metrics) == 0
                old = authority_id(r.signer.pki.cert)
                project(mount, encode_taint_notice({old: START}))
                await until(lambda: resigns(r.metrics) == len(IDENTITIES))

    asyncio.run(main())


def test_a_taint_time_ahead_of_the_agent_clock_counts_from_now(
    mount: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with rig(mount) as r:
            old = authority_id(r.signer.pki.cert)
            with caplog.at_level(logging.WARNING, logger="agent.taints"):
                project(mount, encode_taint_notice({old: START + timedelta(days=1)}))
                await until(lambda: resigns(r.metrics) == len(IDENTITIES))
            assert "86400 s ahead of this agent's clock; counting the taint from now" in caplog.text
            assert r.scheduler.taints.get(old) == START
            drawn = r.due_offsets()
            assert all(0 <= d <= WINDOW.total_seconds() for d in drawn.values()), drawn
            assert max(drawn.values()) > WINDOW.total_seconds() / 2  # from now, the whole window

    asyncio.run(main())


def test_a_taint_known_before_a_previous_runs_leaf_is_restored_resigns_it(mount: Path) -> None:
    """The notice is read before the identities start (`CaCertificateSource.start`): a leaf a
    previous run left, signed by an authority tainted since, is re-signed within the window."""
    previous = TestCa(START - timedelta(days=1))
    (only,) = sorted(IDENTITIES)[:1]
    project(mount, encode_taint_notice({authority_id(previous.cert): START - timedelta(hours=1)}))

    def restore(identity: SpiffeId, name: str, now: datetime) -> RestoredCertificate:
        if identity != only:
            raise NoPreviousCertificate("none")
        issued = previous.issue(identity, ttl=TTL, now=now - timedelta(seconds=60))
        signed = SignedCertificate(issued.cert_pem, previous.root_pem, issued.cert, now)
        return RestoredCertificate(signed, issued.key_pem, mount)

    async def main() -> None:
        async with rig(mount, frozenset({only}), start_hook=restore) as r:
            # Tainted an hour ago, window long over: re-signed at once, by the current CA.
            await until(lambda: r.scheduler.installs == 2)
            state = r.scheduler.states[only]
            assert not state.restored and state.authority == authority_id(r.signer.pki.cert)
            assert resigns(r.metrics) == 1
            assert r.signer.identities == [only]

    asyncio.run(main())


def test_a_ca_still_answering_with_a_tainted_authority_gets_one_early_resign_per_taint(
    mount: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The CA answers the re-sign with a leaf of the authority the notice names (a CA process
    that has not caught up, or a notice naming the active authority): each identity is
    re-signed early once for the taint, and its new leaf rotates at its normal point however
    many reports follow. Before: one more CSR per identity at every report ("learnt from the
    report", though the answers named no taint). Taken back and named again, it is a new
    taint: once more, and again only once."""

    async def reports(r: Rig, count: int) -> None:
        for _ in range(count):  # a report interval each; the CA's answers name no taint
            await advance_settled(r.clock, r.scheduler, 10)
            assert report_taint(r.scheduler, r.clock, {}) == 0

    async def main() -> None:
        async with rig(mount) as r:
            old = authority_id(r.signer.pki.cert)  # the signer keeps signing with it
            before = len(r.signer.calls)
            with caplog.at_level(logging.INFO):
                project(mount, encode_taint_notice({old: START - timedelta(hours=1)}))
                await until(lambda: len(r.signer.calls) == before + len(IDENTITIES))
                await reports(r, 12)
            assert len(r.signer.calls) == before + len(IDENTITIES)  # once each, not again
            assert resigns(r.metrics) == len(IDENTITIES)
            assert r.scheduler.leaf_authorities() == {old}
            assert "(learnt from the taint-notice): re-signing 40 certificate(s)" in caplog.text
            assert "learnt from the report" not in caplog.text
            assert caplog.text.count("not re-signing it early again for the same taint") == 40

            project(mount, encode_taint_notice({}))  # taken back: forgotten
            await until(lambda: old not in r.scheduler.taints)
            project(mount, encode_taint_notice({old: r.clock.now()}))
            await until(lambda: resigns(r.metrics) == 2 * len(IDENTITIES))
            await advance_settled(r.clock, r.scheduler, WINDOW.total_seconds())
            await reports(r, 12)
            assert len(r.signer.calls) == before + 2 * len(IDENTITIES)

    asyncio.run(main())


def test_known_taints_stay_bounded() -> None:
    known = KnownTaints()
    for n in range(MAX_KNOWN_TAINTS + 10):
        learnt = known.learn({f"{n:040x}": START - timedelta(seconds=n)}, SOURCE_REPORT, START)
    assert len(known) == MAX_KNOWN_TAINTS
    assert f"{0:040x}" in known and f"{MAX_KNOWN_TAINTS:040x}" not in known  # the oldest go
    assert learnt.forgotten == [f"{MAX_KNOWN_TAINTS + 9:040x}"]  # said, for the scheduler


def test_the_notice_forgets_only_the_taints_only_notices_named() -> None:
    """`agent.taints` rule 1: the notice is the whole list, the report's answer confirms."""
    known = KnownTaints()
    a, b, c = "aa" * 20, "bb" * 20, "cc" * 20
    assert known.learn({a: START, b: START}, SOURCE_TAINT_NOTICE, START).fresh == [a, b]
    assert known.learn({b: START, c: START}, SOURCE_REPORT, START).fresh == [c]
    learnt = known.learn({}, SOURCE_TAINT_NOTICE, START)
    assert learnt.fresh == [] and learnt.forgotten == [a]  # b and c: the CA confirmed them
    assert a not in known and b in known and c in known
    assert known.source(b) == SOURCE_TAINT_NOTICE  # the first to name it, for log lines
    assert known.learn({}, SOURCE_REPORT, START).forgotten == []  # an answer forgets nothing


# --- whatever the notice holds --------------------------------------------------------------

RANDOM_NOTICES = settings(
    max_examples=10_000,
    derandomize=True,  # every run tries the same notices
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_no_notice_escapes_the_watch_or_stops_it(
    mount: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """10,000 notices of every shape through the watch's own callback (the one its poll hands
    each new version to: decode, then the scheduler's taint path with the real `KnownTaints`):
    each is taken in or refused with what is wrong in it, never an exception. Then the real
    poll of the real file still picks up a bad notice and a valid one after it. Before the
    fix: a time that overflows once in UTC raised `OverflowError` out of the callback."""
    two = frozenset(sorted(IDENTITIES)[:2])

    async def main() -> None:
        project(mount, encode_taint_notice({}))
        async with rig(mount, two) as r:
            active = authority_id(r.signer.pki.cert)
            loop = asyncio.get_running_loop()
            handed = 0

            @RANDOM_NOTICES
            @given(data=any_notice(active))
            def hand_over(data: bytes) -> None:
                nonlocal handed
                handed += 1
                asyncio.run_coroutine_threadsafe(r.watch._changed(data), loop).result(10)

            with caplog.at_level(logging.WARNING):
                await asyncio.to_thread(hand_over)
                assert r.watch.accepted + r.watch.refused == 1 + handed
                assert handed >= 10_000
                assert r.watch.refused > 1000 and r.watch.accepted > 100  # both paths taken
                # Each refusal said what was wrong: none needed the decoder's last resort, and
                # nothing was logged as an error (an exception the poll's guard caught).
                assert "cannot be read as a taint notice" not in caplog.text
                assert not [x for x in caplog.records if x.levelno >= logging.ERROR]

                # The real poll of the real file: the overflow, then a valid notice.
                refused = r.watch.refused
                overflow = {"authority": active, "tainted_at": "9999-12-31T23:59:59-14:00"}
                project(mount, json.dumps({"version": 1, "tainted": [overflow]}))
                await until(lambda: r.watch.refused == refused + 1)
                project(mount, encode_taint_notice({"ef" * 20: START}))
                await until(lambda: "ef" * 20 in r.scheduler.taints)
            assert r.scheduler.has_valid_certificate()

    asyncio.run(main())
