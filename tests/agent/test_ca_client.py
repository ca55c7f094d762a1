"""CaClient against an in-process TLS gRPC CA: headers, retries, response validation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from agent.ca_client import (
    CaClient,
    CaConnectionError,
    CaRequestError,
    CaResponseError,
    SignedCertificate,
    SigningRequest,
    channel_options,
)
from agent.metrics import AgentMetrics
from agent.propagation import AgentReport
from agent.token import FileTokenProvider, TokenFileEmpty
from certs import (
    PrivateKey,
    SpiffeId,
    build_csr,
    generate_private_key,
    key_matches_certificate,
    private_key_to_pem,
)
from meshca.clock import SystemClock
from tests.support.fake_ca import IDENTITY, FakeCaServicer, start_fake_ca
from tests.support.pki import TestCa
from tests.support.processes import free_port

Scenario = Callable[[CaClient, FakeCaServicer, Path], Awaitable[None]]


def run(
    tmp_path: Path,
    scenario: Scenario,
    token: str = "tok-123",
    metrics: AgentMetrics | None = None,
) -> None:
    async def main() -> None:
        clock = SystemClock()
        servicer = FakeCaServicer(TestCa(datetime.now(UTC)), clock)
        server, addr = await start_fake_ca(servicer, tmp_path, clock.now())
        (tmp_path / "token").write_text(token)
        client = CaClient(
            addr,
            tmp_path / "root-cert.pem",
            FileTokenProvider(tmp_path / "token"),
            clock,
            cluster_id="c1",
            extra_headers=[("tenant", "blue")],
            timeout=timedelta(seconds=5),
            metrics=metrics or AgentMetrics(clock),
        )
        try:
            await scenario(client, servicer, tmp_path)
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(main())


async def sign(
    client: CaClient, identity: SpiffeId = IDENTITY
) -> tuple[PrivateKey, SignedCertificate]:
    key = generate_private_key()
    request = SigningRequest(build_csr(key, identity), identity, key, timedelta(minutes=5))
    return key, await client.sign(request)


def test_signs_with_headers_and_validates(tmp_path: Path) -> None:
    async def scenario(client: CaClient, ca: FakeCaServicer, _: Path) -> None:
        key, signed = await sign(client)
        assert key_matches_certificate(key, signed.leaf)
        assert signed.root_bundle_pem == ca.pki.root_pem
        headers = ca.metadata[0]
        assert headers["authorization"] == "Bearer tok-123"
        assert headers["clusterid"] == "c1"
        assert headers["tenant"] == "blue"

    run(tmp_path, scenario)


def test_transient_codes_are_retried_others_are_not(tmp_path: Path) -> None:
    async def scenario(client: CaClient, ca: FakeCaServicer, _: Path) -> None:
        ca.abort_with = [(grpc.StatusCode.INTERNAL, "signer busy")]
        await sign(client)
        assert len(ca.metadata) == 2
        ca.abort_with = [(grpc.StatusCode.UNAUTHENTICATED, "token rejected")]
        with pytest.raises(
            CaRequestError, match="CA returned UNAUTHENTICATED: token rejected"
        ) as info:
            await sign(client)
        assert not info.value.retryable
        assert len(ca.metadata) == 3

    run(tmp_path, scenario)


def test_reachability_gauges_tell_an_unanswered_call_from_a_refusal(tmp_path: Path) -> None:
    """What MeshcaCaUnreachable compares: the last unanswered call against the last answer."""
    metrics = AgentMetrics(SystemClock())

    def stamp(name: str) -> float:
        value = metrics.registry.get_sample_value(f"meshca_agent_ca_last_{name}_timestamp_seconds")
        assert value is not None
        return value

    async def scenario(client: CaClient, ca: FakeCaServicer, _: Path) -> None:
        assert stamp("answer") == stamp("unanswered") == 0
        ca.abort_with = [(grpc.StatusCode.UNAVAILABLE, "connection refused")] * 10
        with pytest.raises(CaRequestError):
            await sign(client)
        assert stamp("unanswered") > stamp("answer") == 0
        ca.abort_with = [(grpc.StatusCode.PERMISSION_DENIED, "not your identity")]
        with pytest.raises(CaRequestError):
            await sign(client)
        assert stamp("answer") >= stamp("unanswered") > 0

    run(tmp_path, scenario, metrics=metrics)


def test_the_periodic_report_also_tells_whether_the_ca_answers(tmp_path: Path) -> None:
    """A report the CA answers (here `UNIMPLEMENTED`: the fake CA has no report service, as
    istiod) moves the answer stamp; one to an address nobody listens on, the unanswered one."""
    metrics = AgentMetrics(SystemClock())
    report = AgentReport("agent-1", None, frozenset())

    def stamp(name: str) -> float:
        value = metrics.registry.get_sample_value(f"meshca_agent_ca_last_{name}_timestamp_seconds")
        assert value is not None
        return value

    async def scenario(client: CaClient, _ca: FakeCaServicer, root_dir: Path) -> None:
        with pytest.raises(CaRequestError) as answered:
            await client.report(report)
        assert answered.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert stamp("answer") > 0 == stamp("unanswered")
        nobody = CaClient(
            f"127.0.0.1:{free_port()}",
            root_dir / "root-cert.pem",
            FileTokenProvider(root_dir / "token"),
            SystemClock(),
            timeout=timedelta(seconds=2),
            metrics=metrics,
        )
        try:
            with pytest.raises(CaRequestError):
                await nobody.report(report)
        finally:
            await nobody.close()
        assert stamp("unanswered") > stamp("answer") > 0

    run(tmp_path, scenario, metrics=metrics)


def test_rejects_wrong_identity_short_chain_and_foreign_root(tmp_path: Path) -> None:
    async def scenario(client: CaClient, ca: FakeCaServicer, _: Path) -> None:
        ca.issue_uri = "spiffe://cluster.local/ns/default/sa/other"
        with pytest.raises(CaResponseError, match="sa/other"):
            await sign(client)
        ca.issue_uri = None
        ca.rewrite = lambda elements: elements[:1]
        with pytest.raises(CaResponseError, match="1 certificate element"):
            await sign(client)
        other_root = TestCa(datetime.now(UTC)).root_pem
        ca.rewrite = lambda elements: [elements[0], other_root]
        with pytest.raises(CaResponseError, match="does not verify"):
            await sign(client)

    run(tmp_path, scenario)


def test_empty_token_fails_before_calling(tmp_path: Path) -> None:
    async def scenario(client: CaClient, ca: FakeCaServicer, _: Path) -> None:
        with pytest.raises(TokenFileEmpty):
            await sign(client)
        assert ca.metadata == []

    run(tmp_path, scenario, token="")


def test_missing_root_file_is_a_clear_error(tmp_path: Path) -> None:
    async def scenario(client: CaClient, _ca: FakeCaServicer, root_dir: Path) -> None:
        (root_dir / "root-cert.pem").unlink()
        with pytest.raises(CaConnectionError, match="CA_ROOT_CA"):
            await sign(client)

    run(tmp_path, scenario)


def test_channel_options_reconnect_fast_and_override_unknown_hosts() -> None:
    options = dict(channel_options("127.0.0.1:15012"))
    assert int(options["grpc.max_reconnect_backoff_ms"]) <= 1000
    assert "grpc.ssl_target_name_override" not in options
    assert "grpc.ssl_target_name_override" not in dict(channel_options("localhost:1"))
    override = dict(channel_options("10.0.0.7:15012"))
    assert override["grpc.ssl_target_name_override"] == "istiod.istio-system.svc"


def test_the_channel_follows_prov_cert_but_never_takes_a_half_updated_pair(tmp_path: Path):
    """`PROV_CERT` pointing at files that change (Istio's VM pattern, `OUTPUT_CERTS`): a new
    certificate + key is presented from the next call on; a key that does not match the leaf
    beside it (a writer caught between the two files) is not taken, the working channel kept."""
    ca = TestCa(datetime.now(UTC))
    prov = tmp_path / "prov"
    prov.mkdir()

    def provision(issued_key: PrivateKey, cert_for: PrivateKey) -> None:
        (prov / "key.pem").write_text(private_key_to_pem(issued_key).decode())
        (prov / "cert-chain.pem").write_text(ca.issue("sleep", key=cert_for).cert_pem)

    first = generate_private_key()
    provision(first, first)

    async def main() -> None:
        clock = SystemClock()
        client = CaClient(
            "127.0.0.1:1",
            None,
            FileTokenProvider(tmp_path / "no-token", required=False),
            clock,
            metrics=AgentMetrics(clock),
            prov_cert=prov,
        )
        try:
            channel = client._get_channel()
            assert client._get_channel() is channel, "unchanged files: the same channel"
            second = generate_private_key()
            provision(second, first)  # key rewritten, leaf still the old key's
            assert client._get_channel() is channel, "a mismatched pair was taken"
            provision(second, second)
            renewed = client._get_channel()
            assert renewed is not channel, "the renewed pair was not presented"
            assert client._get_channel() is renewed
        finally:
            await client.close()

    asyncio.run(main())
