"""Restoring a previous run's certificate files: which sets are adopted, why others are refused,
and how the scheduler publishes and rotates an adopted one (FakeClock, no CA)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from agent.ca_client import CaRequestError
from agent.cert_state import (
    CertificateNotRestored,
    NoPreviousCertificate,
    load_previous_certificate,
)
from agent.config import AgentConfig
from agent.errors import TokenFileMissing
from agent.file_output import FileOutput
from agent.identity_sources import SingleIdentitySource
from agent.metrics import AgentMetrics
from agent.output_dir import CertificateFiles, write_generation
from agent.scheduler import CertificateScheduler
from agent.scheduler_state import IdentityState
from agent.secrets import RootSecret, SecretCache, TlsSecret
from certs import (
    SpiffeId,
    build_csr,
    generate_private_key,
    load_cert,
    private_key_to_pem,
)
from meshca.clock import FakeClock
from tests.support.agent_scheduler import scheduler_for
from tests.support.agent_wiring import until
from tests.support.fake_ca import IDENTITY, FakeSigner
from tests.support.pki import TestCa

ISSUED = datetime(2030, 1, 1, tzinfo=UTC)
TTL = timedelta(seconds=100)


def write_previous_run(
    directory: Path,
    pki: TestCa,
    *,
    issued: datetime = ISSUED,
    uri: str | None = None,
    root_pem: str | None = None,
    swap_key: bool = False,
) -> tuple[str, str]:
    """What a previous agent run leaves behind (via the real FileOutput); (chain, key) PEM."""
    key = generate_private_key()
    chain = pki.sign_csr(build_csr(key, IDENTITY), TTL, issued, uri)[0]
    key_pem = private_key_to_pem(generate_private_key() if swap_key else key).decode()
    write_generation(directory, CertificateFiles(chain, key_pem, root_pem or pki.root_pem), issued)
    return chain, key_pem


@pytest.fixture
def pki() -> TestCa:
    return TestCa(ISSUED - timedelta(days=1))


def refusal(directory: Path, now: datetime, identity: SpiffeId = IDENTITY) -> str:
    with pytest.raises(CertificateNotRestored) as info:
        load_previous_certificate(directory, identity, now)
    return str(info.value)


# -- load_previous_certificate ------------------------------------------------------------------


def test_a_valid_set_is_adopted_as_if_received_when_issued(tmp_path: Path, pki: TestCa) -> None:
    chain, key_pem = write_previous_run(tmp_path, pki)
    now = ISSUED + timedelta(seconds=30)
    restored = load_previous_certificate(tmp_path, IDENTITY, now)
    assert restored.signed.leaf.serial_number == load_cert(chain).serial_number
    assert restored.signed.chain_pem == chain
    assert restored.signed.root_bundle_pem == pki.root_pem
    assert restored.key_pem == key_pem
    # NotBefore is backdated by two minutes: the certificate was received at issue time.
    assert restored.signed.received_at == ISSUED
    assert restored.source == (tmp_path / "..data").resolve()
    assert "PRIVATE KEY" not in repr(restored)


def test_files_written_as_plain_files_are_adopted_too(tmp_path: Path, pki: TestCa) -> None:
    key = generate_private_key()
    chain = pki.sign_csr(build_csr(key, IDENTITY), TTL, ISSUED)[0]
    (tmp_path / "cert-chain.pem").write_text(chain)
    (tmp_path / "key.pem").write_text(private_key_to_pem(key).decode())
    (tmp_path / "root-cert.pem").write_text(pki.root_pem)
    assert load_previous_certificate(tmp_path, IDENTITY, ISSUED).source == tmp_path


def test_refused_for_another_identity(tmp_path: Path, pki: TestCa) -> None:
    write_previous_run(tmp_path, pki, uri="spiffe://cluster.local/ns/default/sa/other")
    reason = refusal(tmp_path, ISSUED)
    assert "sa/other" in reason and IDENTITY.uri in reason
    # The configured identity decides, not the files: same files, other agent.
    write_previous_run(tmp_path, pki)
    assert "sa/else" in refusal(tmp_path, ISSUED, SpiffeId("cluster.local", "default", "else"))


def test_refused_when_the_key_does_not_match(tmp_path: Path, pki: TestCa) -> None:
    write_previous_run(tmp_path, pki, swap_key=True)
    assert refusal(tmp_path, ISSUED).startswith("the certificate is for a different private key")


def test_refused_when_the_chain_does_not_verify_to_the_root_file(
    tmp_path: Path, pki: TestCa
) -> None:
    other_root = TestCa(ISSUED - timedelta(days=1)).root_pem
    write_previous_run(tmp_path, pki, root_pem=other_root)
    assert "does not verify" in refusal(tmp_path, ISSUED)


def test_refused_when_expired_not_yet_valid_or_nearly_expired(tmp_path: Path, pki: TestCa) -> None:
    chain, _ = write_previous_run(tmp_path, pki)
    not_after = load_cert(chain).not_valid_after_utc
    assert "expired at" in refusal(tmp_path, not_after)
    assert "not valid until" in refusal(tmp_path, ISSUED - timedelta(minutes=3))
    # Lifetime 100 s + 2 min backdate = 220 s; under 5 % (11 s) left is not worth restoring.
    assert "lifetime left" in refusal(tmp_path, not_after - timedelta(seconds=10))
    load_previous_certificate(tmp_path, IDENTITY, not_after - timedelta(seconds=12))


def test_refused_when_a_file_is_missing_or_does_not_parse(tmp_path: Path, pki: TestCa) -> None:
    write_previous_run(tmp_path, pki)
    generation = (tmp_path / "..data").resolve()
    (generation / "key.pem").unlink()
    assert refusal(tmp_path, ISSUED) == "cannot read key.pem: No such file or directory"
    (generation / "key.pem").write_text("garbage")
    assert "do not parse" in refusal(tmp_path, ISSUED)
    (generation / "cert-chain.pem").write_bytes(b"\xff\xfe")
    assert refusal(tmp_path, ISSUED) == "cert-chain.pem is not a PEM text file"


def test_an_empty_directory_is_a_first_start(tmp_path: Path) -> None:
    with pytest.raises(NoPreviousCertificate):
        load_previous_certificate(tmp_path, IDENTITY, ISSUED)
    with pytest.raises(NoPreviousCertificate):
        load_previous_certificate(tmp_path / "absent", IDENTITY, ISSUED)


# -- the scheduler adopting it ------------------------------------------------------------------

Harness = tuple[CertificateScheduler, FakeSigner, SecretCache, FakeClock, AgentMetrics]


def only(scheduler: CertificateScheduler) -> IdentityState:
    """The pod agent's one identity (a blank state until the source has reported it)."""
    return scheduler.states.get(IDENTITY) or IdentityState(IDENTITY, "default")


@contextlib.asynccontextmanager
async def manager_restoring(
    directory: Path, pki: TestCa, now: datetime, *, identity_known: bool = True
) -> AsyncIterator[Harness]:
    clock = FakeClock(now)
    config = AgentConfig(
        namespace=IDENTITY.namespace if identity_known else None,
        service_account=IDENTITY.service_account if identity_known else None,
        secret_ttl=TTL,
        grace_period_ratio_jitter=0.0,
    )
    signer = FakeSigner(pki, clock)
    cache = SecretCache()
    metrics = AgentMetrics(clock)
    output = FileOutput.single(directory, clock)
    cache.add_listener(output.on_secret)
    manager = scheduler_for(
        config, signer, cache, clock, metrics, start_hook=output.restore, rng=random.Random(3)
    )
    source = SingleIdentitySource(
        lambda: config.identity or IDENTITY, clock, manager.policy.backoff
    )
    if not identity_known:  # as with a token file that is never written
        source = SingleIdentitySource(
            _unknown_identity, clock, manager.policy.backoff, on_failure=manager.source_failed
        )
    task = asyncio.create_task(manager.run())
    source.start(manager.set_identities)
    try:
        yield manager, signer, cache, clock, metrics
    finally:
        await source.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await manager.aclose()


def _unknown_identity() -> SpiffeId:
    raise TokenFileMissing("token file /var/run/token does not exist")


def test_manager_publishes_the_previous_certificate_without_asking_the_ca(
    tmp_path: Path, pki: TestCa, caplog: pytest.LogCaptureFixture
) -> None:
    chain, key_pem = write_previous_run(tmp_path, pki)
    now = ISSUED + timedelta(seconds=30)

    async def main() -> None:
        async with manager_restoring(tmp_path, pki, now) as (manager, signer, cache, clock, m):
            await until(lambda: only(manager).generation == 1)
            tls, root = cache.get("default"), cache.get("ROOTCA")
            assert isinstance(tls, TlsSecret) and isinstance(root, RootSecret)
            assert (tls.cert_chain_pem, tls.private_key_pem) == (chain, key_pem)
            assert root.trusted_ca_pem == pki.root_pem
            assert only(manager).restored and manager.has_valid_certificate()
            assert len(signer.calls) == 0
            assert m.restores._value.get() == 1 and m.rotations._value.get() == 0
            # Rotation by the normal rule, counted from issue (= NotBefore + 2 min): half of
            # the 100 s lifetime, i.e. 50 s after issue, 20 s from now.
            assert only(manager).next_rotation_at == ISSUED + timedelta(seconds=50)
            clock.advance(19.9)
            await asyncio.sleep(0.05)
            assert len(signer.calls) == 0
            clock.advance(0.2)
            await until(lambda: only(manager).generation == 2)
            assert len(signer.calls) == 1 and not only(manager).restored
            renewed = cache.get("default")
            assert renewed is not None and renewed.version != tls.version

    with caplog.at_level(logging.INFO, logger="agent"):
        asyncio.run(main())
    restored_lines = [r.getMessage() for r in caplog.records if "restored from" in r.getMessage()]
    assert len(restored_lines) == 1
    assert "PRIVATE KEY" not in caplog.text


def test_manager_renews_an_overdue_adoption_at_once_serving_it_while_the_ca_is_down(
    tmp_path: Path, pki: TestCa
) -> None:
    write_previous_run(tmp_path, pki)
    now = ISSUED + timedelta(seconds=70)  # past the 50 s rotation point, 30 s left

    async def main() -> None:
        async with manager_restoring(tmp_path, pki, now) as (manager, signer, cache, clock, _):
            signer.fail_always = CaRequestError(grpc.StatusCode.UNAVAILABLE, "CA is down")
            await until(lambda: len(signer.calls) >= 1)
            served = cache.get("default")
            assert served is not None and only(manager).generation == 1
            for _ in range(5):  # backoff retries; the adopted certificate stays served
                clock.advance(5.0)
                await asyncio.sleep(0.01)
            assert len(signer.calls) >= 3
            assert cache.get("default") is served and manager.has_valid_certificate()
            assert manager.last_error == "CA returned UNAVAILABLE: CA is down"
            signer.fail_always = None
            clock.advance(5.0)
            await until(lambda: only(manager).generation == 2)
            assert manager.last_error is None

    asyncio.run(main())


def test_manager_asks_the_ca_when_the_files_are_refused(
    tmp_path: Path, pki: TestCa, caplog: pytest.LogCaptureFixture
) -> None:
    write_previous_run(tmp_path, pki, uri="spiffe://cluster.local/ns/default/sa/other")

    async def main() -> None:
        async with manager_restoring(tmp_path, pki, ISSUED) as (manager, signer, _, _, m):
            await until(lambda: only(manager).generation == 1)
            assert len(signer.calls) == 1 and not only(manager).restored
            assert m.restores._value.get() == 0

    with caplog.at_level(logging.INFO, logger="agent"):
        asyncio.run(main())
    refused = [r for r in caplog.records if "not restoring" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    assert "sa/other" in refused[0].getMessage()


def test_manager_does_not_adopt_before_it_knows_its_identity(
    tmp_path: Path, pki: TestCa, caplog: pytest.LogCaptureFixture
) -> None:
    write_previous_run(tmp_path, pki)

    async def main() -> None:
        async with manager_restoring(tmp_path, pki, ISSUED, identity_known=False) as h:
            manager, _, cache, _, _ = h
            await until(lambda: manager.source_failure is not None)
            assert cache.get("default") is None and not manager.states
            assert "does not exist" in (manager.last_error or "")

    with caplog.at_level(logging.INFO, logger="agent"):
        asyncio.run(main())
    assert "identity not known yet" in caplog.text


def test_file_output_does_not_rewrite_the_restored_set(tmp_path: Path, pki: TestCa) -> None:
    chain, key_pem = write_previous_run(tmp_path, pki)
    generation = (tmp_path / "..data").resolve()
    output = FileOutput.single(tmp_path, FakeClock(ISSUED))
    restored = output.restore(IDENTITY, "default", ISSUED)
    assert restored.source == generation
    assert (restored.signed.chain_pem, restored.key_pem) == (chain, key_pem)
    output.on_secret(RootSecret("ROOTCA", restored.signed.root_bundle_pem))
    output.on_secret(TlsSecret("default", restored.signed.chain_pem, restored.key_pem))
    assert output.writes == 0 and (tmp_path / "..data").resolve() == generation
    # The next certificate is written as usual.
    next_chain, next_key = write_previous_run(tmp_path / "scratch", pki)
    output.on_secret(TlsSecret("default", next_chain, next_key))
    assert output.writes == 1 and (tmp_path / "cert-chain.pem").read_text() == next_chain


def test_file_output_writes_a_set_it_did_not_restore(tmp_path: Path, pki: TestCa) -> None:
    """Without a restore, the same text is written as a new generation: the output never
    reads its own files back to decide."""
    chain, key_pem = write_previous_run(tmp_path, pki)
    generation = (tmp_path / "..data").resolve()
    output = FileOutput.single(tmp_path, FakeClock(ISSUED))
    output.on_secret(RootSecret("ROOTCA", pki.root_pem))
    output.on_secret(TlsSecret("default", chain, key_pem))
    assert output.writes == 1 and (tmp_path / "..data").resolve() != generation


def test_node_scheduler_restores_each_identity_from_its_own_directory(
    tmp_path: Path, pki: TestCa
) -> None:
    """Node mode restores too: each identity from OUTPUT/<ns>/<sa>/, none of it rewritten,
    while the CA refuses every call."""
    cart = SpiffeId("cluster.local", "shop", "cart")
    orders = SpiffeId("cluster.local", "shop", "orders")
    chains = {
        identity: write_previous_run(
            tmp_path / identity.namespace / identity.service_account, pki, uri=identity.uri
        )[0]
        for identity in (cart, orders)
    }

    async def main() -> None:
        clock = FakeClock(ISSUED + timedelta(seconds=30))
        cache, metrics = SecretCache(), AgentMetrics(clock)
        output = FileOutput.node(tmp_path, clock)
        cache.add_listener(output.on_secret)
        signer = FakeSigner(pki, clock)
        signer.fail_always = CaRequestError(grpc.StatusCode.UNAVAILABLE, "CA is down")
        config = AgentConfig(
            secret_ttl=TTL, node_mode=True, identities=(("shop", "cart"),), output_certs=tmp_path
        )
        scheduler = scheduler_for(config, signer, cache, clock, metrics, start_hook=output.restore)
        task = asyncio.create_task(scheduler.run())
        scheduler.set_identities(frozenset({cart, orders}))
        try:
            await until(scheduler.has_valid_certificate)
            for identity, chain in chains.items():
                tls = cache.get(identity.uri)
                assert isinstance(tls, TlsSecret) and tls.cert_chain_pem == chain
                assert scheduler.states[identity].restored
            assert len(signer.calls) == 0 and output.writes == 0
            assert metrics.restores._value.get() == 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await scheduler.aclose()

    asyncio.run(main())
