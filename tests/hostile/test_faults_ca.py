"""The CA failing by accident: its data directory full or read-only, and SIGKILL in the middle
of issuance under load. Real `meshca ca` processes; the small filesystem is a real tmpfs
(mounting one needs root, as in CI's container; elsewhere these tests skip and say why)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from certs import SpiffeId, build_csr, generate_private_key, load_cert
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import wait_for

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str = "256k") -> Iterator[Path]:
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(directory: Path) -> Path:
    """Fills the filesystem holding `directory` until a write is refused (ENOSPC)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * 4096)
    return filler


def _start_fails(ca: CaProcess) -> str:
    ca.launch()
    assert ca.proc is not None
    code = ca.proc.wait(30)
    assert code == 2, f"exit {code}:\n{ca.log()}"
    return ca.log()


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def _issue_one(ca: CaProcess) -> str:
    token = ca.mint_token("default", "sleep")
    csr = build_csr(generate_private_key(), SpiffeId("cluster.local", "default", "sleep"))
    with ca_stub(ca.addr, ca.root_cert_path.read_bytes()) as stub:
        return create_certificate(stub, csr, token=token)[0]


def test_a_full_data_dir_stops_startup_cleanly_and_leaves_nothing_half_written(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "data") as data:
        filler = _fill(data)
        ca = CaProcess(data)
        try:
            log = _start_fails(ca)
            assert "cannot start: cannot write the authority state (root keys)" in log
            assert "No space left on device" in log
            assert "Traceback" not in log
            left = sorted(p.name for p in data.iterdir())
            assert left == [".lock", "filler"], left  # no root, no .tmp leftovers
            filler.unlink()  # space freed: the next start creates the root and serves
            ca.start()
            assert "BEGIN CERTIFICATE" in _issue_one(ca)
        finally:
            ca.stop()


def test_a_read_only_data_dir_stops_startup_and_keeps_the_root(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "data") as data:
        ca = CaProcess(data)
        try:
            ca.start()
            first_leaf = load_cert(_issue_one(ca))
            ca.stop()
            before = _snapshot(data)
            subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
            log = _start_fails(CaProcess(data))
            assert "Read-only file system" in log and "Traceback" not in log
            assert _snapshot(data) == before, "a refused start must not change the data dir"
            subprocess.run(["mount", "-o", "remount,rw", str(data)], check=True)
            ca.start()
            leaf = load_cert(_issue_one(ca))
            assert leaf.issuer == first_leaf.issuer, "the same root signs after the fault"
        finally:
            ca.stop()


def test_sigkill_under_load_leaves_no_unrecorded_certificate(tmp_path: Path) -> None:
    """Every certificate a client received must have its 'issued' audit line in the CA's log:
    the record is written before the response is sent, so a CA killed at any instant cannot
    have handed out a certificate it did not record."""
    ca = CaProcess(tmp_path / "data")
    ca.start()
    token = ca.mint_token("default", "sleep")
    identity = SpiffeId("cluster.local", "default", "sleep")
    root = ca.root_cert_path.read_bytes()
    received: list[int] = []
    failures: list[grpc.StatusCode] = []
    stop = threading.Event()

    def client() -> None:
        with ca_stub(ca.addr, root) as stub:
            while not stop.is_set():
                csr = build_csr(generate_private_key(), identity)
                try:
                    chain = create_certificate(stub, csr, token=token)
                except grpc.RpcError as error:
                    failures.append(error.code())
                    return
                received.append(load_cert(chain[0]).serial_number)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(received) >= 100, 30, "100 certificates under load")
        ca.kill()
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
    assert failures, "the clients must have seen the CA die"
    audited = {
        int(line["serial"], 16)
        for line in (json.loads(raw) for raw in ca.log().splitlines() if raw.startswith("{"))
        if line.get("msg") == "issued"
    }
    unrecorded = set(received) - audited
    assert not unrecorded, f"{len(unrecorded)} of {len(received)} certificates not audited"
    # ... and the CA comes back with the same state.
    time.sleep(0.2)
    ca.start()
    assert "BEGIN CERTIFICATE" in _issue_one(ca)
    ca.stop()
