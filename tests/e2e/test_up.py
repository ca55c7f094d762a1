"""`meshca up` as the README's Quickstart describes it: a local CA plus one agent, in one command.

Runs `python -m meshca up --dir D --secret-ttl 4s` as a child in its own process group, waits
for the banner that says where things are, then takes the certificate the way Envoy would (over
SDS on the printed socket) and the way an application would (the printed files), watches one
rotation, and presses Ctrl-C (SIGINT to the process group, as a terminal does).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from certs import (
    describe_certificate,
    key_matches_certificate,
    load_certs,
    load_private_key,
    verify_chain,
)
from tests.support.processes import child_env, http_status, wait_for
from tests.support.sds_client import SECRET_TYPE_URL, fetch_secrets, leaf_serial, unpack

IDENTITY = "spiffe://cluster.local/ns/default/sa/default"


@dataclass
class Up:
    """The running `meshca up` child and what its banner said."""

    proc: subprocess.Popen[str]
    directory: Path
    lines: list[str] = field(default_factory=list)
    banner: dict[str, str] = field(default_factory=dict)

    @property
    def sds_socket(self) -> Path:
        return Path(self.banner["SDS"].removeprefix("unix:"))

    @property
    def files_dir(self) -> Path:
        return Path(self.banner["files"].split("/{", 1)[0])

    @property
    def ca_addr(self) -> str:
        match = re.search(r"CA at (\S+)", "\n".join(self.lines))
        assert match, self.lines
        return match.group(1)

    def log(self) -> str:
        path = self.directory / "up.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _read_stdout(up: Up, done: threading.Event) -> None:
    assert up.proc.stdout is not None
    for line in up.proc.stdout:
        up.lines.append(line.rstrip("\n"))
        name, sep, value = line.strip().partition(":")
        if sep and name in ("identity", "SDS", "files", "ready", "metrics"):
            up.banner[name] = value.strip()
        if "Ctrl-C to stop" in line:
            done.set()
    done.set()


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def up(request: pytest.FixtureRequest, starts_processes: None) -> Iterator[Up]:
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="up-"))
    directory = workdir / "meshca"
    log = open(workdir / "up.log", "wb")  # noqa: SIM115 - closed below, once the child is gone
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshca",
            "up",
            "--dir",
            str(directory),
            "--secret-ttl",
            "4s",
            "--status-listen",
            "127.0.0.1:0",  # not 15020: CI may run several at once
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=child_env(),
        cwd=workdir,
        start_new_session=True,  # its own process group, so Ctrl-C can be sent to it and its CA
    )
    running = Up(proc, workdir)
    try:
        banner_done = threading.Event()
        reader = threading.Thread(target=_read_stdout, args=(running, banner_done), daemon=True)
        reader.start()
        assert banner_done.wait(30), f"no banner from meshca up; log:\n{running.log()}"
        assert proc.poll() is None, f"meshca up exited; log:\n{running.log()}"
        yield running
    finally:
        # Whatever the test did, nothing of this process group outlives it.
        if _process_group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()
        if not os.environ.get("MESHCA_KEEP_TEST_DIRS"):
            shutil.rmtree(workdir, ignore_errors=True)


class SdsStream:
    """A minimal Envoy-like SDS client on a `StreamSecrets` stream: subscribes to `names` and
    ACKs every response."""

    def __init__(self, channel: grpc.Channel, names: list[str]) -> None:
        self._requests: queue.Queue[discovery_pb2.DiscoveryRequest | None] = queue.Queue()
        self._names = names
        self._requests.put(self._request())
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        self._call = stub.StreamSecrets(self._iterate())
        self._responses = iter(self._call)

    def _request(
        self, response: discovery_pb2.DiscoveryResponse | None = None
    ) -> discovery_pb2.DiscoveryRequest:
        request = discovery_pb2.DiscoveryRequest(
            node=base_pb2.Node(id="test-up", cluster="test"),
            resource_names=self._names,
            type_url=SECRET_TYPE_URL,
        )
        if response is not None:
            request.version_info = response.version_info
            request.response_nonce = response.nonce
        return request

    def _iterate(self) -> Iterator[discovery_pb2.DiscoveryRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def next(self) -> list[secret_pb2.Secret]:
        response = next(self._responses)
        self._requests.put(self._request(response))
        return [unpack(resource) for resource in response.resources]

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


def check_certificate(chain_pem: bytes, key_pem: bytes, roots: list[x509.Certificate]) -> int:
    """The chain is for IDENTITY, verifies against `roots`, matches the key; returns the serial."""
    chain = load_certs(chain_pem)
    leaf = chain[0]
    assert list(describe_certificate(leaf).uri_sans) == [IDENTITY]
    root_serials = {root.serial_number for root in roots}
    intermediates = [cert for cert in chain[1:] if cert.serial_number not in root_serials]
    verify_chain([leaf, *intermediates], roots, now=datetime.now(UTC))
    assert key_matches_certificate(load_private_key(key_pem), leaf)
    return int(leaf.serial_number)


@pytest.mark.timeout(120)
def test_meshca_up_serves_sds_and_files_rotates_and_stops_on_ctrl_c(up: Up) -> None:
    directory = up.directory / "meshca"
    assert up.banner["identity"] == IDENTITY
    assert up.sds_socket == directory / "sds.sock"
    assert up.files_dir == directory / "certs"
    # The banner comes as soon as the agent listens; the first certificate follows.
    wait_for(lambda: http_status(up.banner["ready"]) == 200, 15, "the agent to be ready")
    ca_root = load_certs((directory / "ca" / "root-cert.pem").read_bytes())

    # Over SDS, as Envoy takes it: `default` (certificate + key) and `ROOTCA`.
    secrets = fetch_secrets(up.sds_socket, ["default", "ROOTCA"], node_id="test-up")
    assert set(secrets) == {"default", "ROOTCA"}
    sds_root = load_certs(secrets["ROOTCA"].validation_context.trusted_ca.inline_bytes)
    assert [c.serial_number for c in sds_root] == [c.serial_number for c in ca_root]
    tls = secrets["default"].tls_certificate
    check_certificate(tls.certificate_chain.inline_bytes, tls.private_key.inline_bytes, ca_root)

    # As files, as an application reads them: one consistent generation behind `..data`.
    def file_serial() -> int:
        generation = Path(os.path.realpath(up.files_dir / "..data"))
        key_path = generation / "key.pem"
        assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
        assert load_certs((generation / "root-cert.pem").read_bytes())[0] == ca_root[0]
        return check_certificate(
            (generation / "cert-chain.pem").read_bytes(), key_path.read_bytes(), ca_root
        )

    for name in ("cert-chain.pem", "key.pem", "root-cert.pem"):
        assert (up.files_dir / name).is_symlink()
    first_file_serial = file_serial()

    # A rotation, seen on an SDS stream (pushed, not polled) and then in the files.
    with grpc.insecure_channel(f"unix:{up.sds_socket}") as channel:
        stream = SdsStream(channel, ["default"])
        try:
            first = stream.next()
            assert [s.name for s in first] == ["default"]
            serials = [leaf_serial(first[0])]
            deadline = time.monotonic() + 15  # TTL 4 s: a new certificate every ~2 s
            while serials[-1] == serials[0]:
                assert time.monotonic() < deadline, "no rotation pushed over SDS"
                pushed = stream.next()
                assert [s.name for s in pushed] == ["default"]
                tls = pushed[0].tls_certificate
                check_certificate(
                    tls.certificate_chain.inline_bytes, tls.private_key.inline_bytes, ca_root
                )
                serials.append(leaf_serial(pushed[0]))
        finally:
            stream.close()
    wait_for(lambda: file_serial() != first_file_serial, 10, "the files to rotate")

    # Ctrl-C: SIGINT to the whole process group, as a terminal sends it.
    interrupt_and_check_stopped(up, group=True)


def interrupt_and_check_stopped(up: Up, *, group: bool) -> None:
    """SIGINT; `meshca up` and its CA child must both be gone (reaped) within 5 s."""
    started = time.monotonic()
    if group:
        os.killpg(up.proc.pid, signal.SIGINT)
    else:
        up.proc.send_signal(signal.SIGINT)
    code = up.proc.wait(5)
    while _process_group_alive(up.proc.pid):  # its CA child (reaped by it, or left over)
        assert time.monotonic() - started < 5, "the CA outlived meshca up"
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    assert code == 0, up.log()
    assert elapsed < 5, elapsed
    assert not up.sds_socket.exists()
    assert "Traceback" not in up.log(), up.log()
    ca_log = up.directory / "meshca" / "ca.log"
    assert "Traceback" not in ca_log.read_text(errors="replace")
    assert "meshca up: stopped" in up.log()


@pytest.mark.timeout(60)
def test_sigint_to_meshca_up_alone_also_stops_its_ca(up: Up) -> None:
    """`kill -INT <pid>` (not a terminal's Ctrl-C): the CA child gets nothing from the signal
    itself, so `meshca up` must stop it."""
    wait_for(lambda: http_status(up.banner["ready"]) == 200, 15, "the agent to be ready")
    interrupt_and_check_stopped(up, group=False)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_sigint_while_the_ca_is_still_starting_stops_and_reaps_it() -> None:
    """Regression: a signal before the agent was up used to raise KeyboardInterrupt out of
    `meshca up` and leave the CA child running, orphaned."""
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="up-"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshca",
            "up",
            "--dir",
            str(workdir / "meshca"),
            "--status-listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,
    )
    try:
        # ca.log is created just before the CA child is launched; the CA takes ~1 s to be ready.
        wait_for(lambda: (workdir / "meshca" / "ca.log").exists(), 30, "the CA to be launched")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=5)
        started = time.monotonic()
        while _process_group_alive(proc.pid):
            assert time.monotonic() - started < 5, "the CA child was left running"
            time.sleep(0.05)
        assert proc.returncode == 0, err.decode(errors="replace")
        assert b"Traceback" not in err
    finally:
        if _process_group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
