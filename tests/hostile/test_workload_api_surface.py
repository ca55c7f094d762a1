"""Hostile SPIFFE Workload API clients on the agent's socket (`agent.workload.api`): a missing
or wrong security header, bytes that are not the Workload API, the JWT calls, more streams
than the agent serves, streams abandoned by a client that dies. Each case checks the exact
status and message, the refusal counted by reason, no key material in a log line or in a
refusal, and that a well-behaved client (the real py-spiffe one) is still served afterwards."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest
from spiffe._proto import workload_pb2

from agent.workload.api import (
    REFUSED_JWT,
    REFUSED_NO_HEADER,
    REFUSED_TOO_MANY_STREAMS,
    REFUSED_UNDECODABLE,
)
from tests.support.agent_process import run_agent_to_exit
from tests.support.pki import Issued, TestCa
from tests.support.processes import child_env, wait_for
from tests.support.workload_api import client_for
from tests.support.workload_api_server import Hosted, pod_server

SERVICE = "/SpiffeWorkloadAPI"
HEADER = (("workload.spiffe.io", "true"),)
REFUSALS = "meshca_agent_workload_api_refusals_total"
STREAM_METHODS = ("FetchX509SVID", "FetchX509Bundles", "FetchJWTBundles")
UNARY_METHODS = ("FetchJWTSVID", "ValidateJWTSVID")


@pytest.fixture(scope="module")
def ca() -> TestCa:
    return TestCa()


@pytest.fixture(scope="module")
def issued(ca: TestCa) -> Issued:
    return ca.issue("app")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="wapi", dir="/tmp") as directory:
        yield Path(directory)


@pytest.fixture
def hosted(sock_dir: Path, ca: TestCa, issued: Issued) -> Iterator[Hosted]:
    with pod_server(sock_dir / "api.sock", ca, issued, max_streams=8) as server:
        yield server


def raw_call(
    socket: Path, method: str, body: bytes, metadata: tuple[tuple[str, str], ...] = HEADER
) -> list[bytes]:
    """Sends raw `body` to `method`; the raw responses (raises grpc.RpcError on a refusal)."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        if method in UNARY_METHODS:
            unary = channel.unary_unary(f"{SERVICE}/{method}")
            return [unary(body, metadata=metadata, timeout=5)]
        stream = channel.unary_stream(f"{SERVICE}/{method}")
        call = stream(body, metadata=metadata, timeout=5)
        first = next(iter(call))
        call.cancel()
        return [first]


def refused(
    hosted: Hosted, send: Callable[[], object], code: grpc.StatusCode, fragment: str, reason: str
) -> str:
    """`send()` fails with `code` and a message holding `fragment`; the refusal is counted
    under `reason`; the real py-spiffe client is served right after."""
    before = hosted.metric(REFUSALS, reason=reason)
    with pytest.raises(grpc.RpcError) as info:
        send()
    error = info.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    details = error.details() or ""
    assert fragment in details, details
    assert hosted.metric(REFUSALS, reason=reason) == before + 1
    assert_still_serving(hosted)
    return details


def assert_still_serving(hosted: Hosted) -> None:
    with client_for(hosted.socket) as client:
        svid = client.fetch_x509_svid()
    assert str(svid.spiffe_id) == "spiffe://cluster.local/ns/default/sa/app"


def test_every_call_without_the_security_header_is_refused_as_the_spec_says(
    hosted: Hosted, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for method in (*STREAM_METHODS, *UNARY_METHODS):
        for metadata in ((), (("workload.spiffe.io", "false"),), (("workload-spiffe-io", "true"),)):
            details = refused(
                hosted,
                partial(raw_call, hosted.socket, method, b"", metadata),
                grpc.StatusCode.INVALID_ARGUMENT,
                "security header missing from request",
                REFUSED_NO_HEADER,
            )
            assert details == "security header missing from request"
    assert "PRIVATE KEY" not in caplog.text


def test_bytes_that_are_not_the_workload_api_are_invalid_argument(hosted: Hosted) -> None:
    for method in (*STREAM_METHODS, *UNARY_METHODS):
        refused(
            hosted,
            partial(raw_call, hosted.socket, method, b"\xff\xff\xff\xff\x0f"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "does not decode",
            REFUSED_UNDECODABLE,
        )


def test_fields_the_request_does_not_have_change_nothing(hosted: Hosted, issued: Issued) -> None:
    """A request padded with fields of the caller's choosing (say, another SPIFFE ID in field
    1) decodes (proto3 keeps unknown fields) and is ignored: the answer is the pod's SVID."""
    forged = workload_pb2.JWTSVIDRequest(
        audience=["x"], spiffe_id="spiffe://cluster.local/ns/kube-system/sa/admin"
    ).SerializeToString()
    (body,) = raw_call(hosted.socket, "FetchX509SVID", forged)
    response = workload_pb2.X509SVIDResponse.FromString(body)
    (svid,) = response.svids
    assert svid.spiffe_id == "spiffe://cluster.local/ns/default/sa/app"


def test_jwt_calls_without_a_ca_are_a_failed_precondition_that_says_what_to_configure(
    hosted: Hosted,
) -> None:
    """A server with no CA to sign tokens (file-mounted certificates; here none is given)
    refuses the JWT profile — not UNIMPLEMENTED: the configuration lacks the CA, and the
    message says how to give it one; with a CA it is served
    (tests/e2e/test_workload_api_jwt.py)."""
    requests: dict[str, bytes] = {
        "FetchJWTSVID": workload_pb2.JWTSVIDRequest(audience=["a"]).SerializeToString(),
        "FetchJWTBundles": workload_pb2.JWTBundlesRequest().SerializeToString(),
        "ValidateJWTSVID": workload_pb2.ValidateJWTSVIDRequest(
            audience="a", svid="x.y.z"
        ).SerializeToString(),
    }
    for method, request in requests.items():
        details = refused(
            hosted,
            partial(raw_call, hosted.socket, method, request),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no CA to sign JWT-SVIDs",
            REFUSED_JWT,
        )
        assert "FILE_MOUNTED_CERTS" in details and "CA_ADDR" in details
    # py-spiffe sees the same status through its own API.
    with client_for(hosted.socket) as client, pytest.raises(Exception, match="FAILED_PRECOND"):
        client.fetch_jwt_svid({"audience"})


def test_streams_past_the_limit_are_refused_and_the_slots_come_back(hosted: Hosted) -> None:
    channel = grpc.insecure_channel(f"unix:{hosted.socket}")
    try:
        stream = channel.unary_stream(f"{SERVICE}/FetchX509SVID")
        calls = [stream(b"", metadata=HEADER, timeout=30) for _ in range(8)]
        for call in calls:
            next(iter(call))  # each open and answered
        assert hosted.stream_count() == 8
        refused_details = ""
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stream(b"", metadata=HEADER, timeout=5)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refused_details = info.value.details() or ""
        assert "already serves 8 Workload API streams" in refused_details
        assert hosted.metric(REFUSALS, reason=REFUSED_TOO_MANY_STREAMS) == 1
        for call in calls:
            call.cancel()
        wait_for(lambda: hosted.stream_count() == 0, 5, "the cancelled streams to close")
    finally:
        channel.close()
    assert hosted.metric("meshca_agent_workload_api_streams", rpc="FetchX509SVID") == 0
    assert_still_serving(hosted)


ABANDONING_CLIENT = textwrap.dedent(
    """
    import sys, grpc
    channels = []
    for _ in range(int(sys.argv[2])):
        channel = grpc.insecure_channel("unix:" + sys.argv[1])
        call = channel.unary_stream("/SpiffeWorkloadAPI/FetchX509SVID")(
            b"", metadata=(("workload.spiffe.io", "true"),))
        next(iter(call))
        channels.append((channel, call))
    print("open", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.process
def test_streams_of_a_client_killed_mid_stream_are_closed(hosted: Hosted) -> None:
    """A client that opens streams and dies (SIGKILL: no cancel, no goodbye) leaves nothing
    behind: every stream closes, its slots come back, the next client is served."""
    child = subprocess.Popen(
        [sys.executable, "-c", ABANDONING_CLIENT, str(hosted.socket), "6"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "open"
        assert hosted.stream_count() == 6
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    wait_for(lambda: hosted.stream_count() == 0, 10, "the dead client's streams to close")
    assert_still_serving(hosted)


def test_a_refusal_never_carries_a_key(hosted: Hosted, issued: Issued) -> None:
    """Every refused call's status and trailers hold no part of the served key or chain."""
    key_pem = issued.key_pem.encode()
    for metadata in ((), HEADER):
        for method in (*STREAM_METHODS, *UNARY_METHODS):
            body = b"" if metadata == () else b"\xff\xff"
            with pytest.raises(grpc.RpcError) as info:
                raw_call(hosted.socket, method, body, metadata)
            error = info.value
            carried = (error.details() or "").encode() + repr(error.trailing_metadata()).encode()
            assert b"PRIVATE KEY" not in carried and key_pem[40:80] not in carried


def run_agent(sock_dir: Path, workload_api_socket: Path) -> subprocess.CompletedProcess[str]:
    return run_agent_to_exit(
        sock_dir, sock_dir / "sds.sock", workload_api_socket=workload_api_socket
    )


@pytest.mark.process
def test_a_socket_another_process_serves_on_is_never_taken_over(sock_dir: Path) -> None:
    """SPIFFE_ENDPOINT_SOCKET may name a SPIRE agent's live socket: the agent refuses it in one
    line (no traceback), leaves it serving, and cleans up what it had started."""
    import socket

    taken = sock_dir / "spire.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(taken))
    other.listen(4)
    try:
        result = run_agent(sock_dir, taken)
        assert result.returncode == 1
        assert "another process is serving on" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(taken))  # still the other process's
        probe.close()
        assert not (sock_dir / "sds.sock").exists(), "the agent left its SDS socket behind"
    finally:
        other.close()
    regular = sock_dir / "a-file"
    regular.write_text("not a socket")
    result = run_agent(sock_dir, regular)
    assert result.returncode == 1 and "exists and is not a socket" in result.stderr
    assert regular.read_text() == "not a socket"
