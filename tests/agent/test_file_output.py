"""The output directory (`agent.output_dir`): the kubelet layout, private key mode and
set-atomic rewrites; and `FileOutput`, the cache listener writing through it in both layouts."""

from __future__ import annotations

import os
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.file_output import FileOutput
from agent.output_dir import CertificateFiles, read_current, write_generation
from agent.secrets import RootSecret, TlsSecret
from certs import (
    CLOCK_SKEW_BACKDATE,
    build_csr,
    generate_private_key,
    key_matches_certificate,
    load_cert,
    load_private_key,
    private_key_to_pem,
)
from meshca.clock import FakeClock
from tests.support.fake_ca import IDENTITY
from tests.support.pki import TestCa

NOW = datetime.now(UTC)


class Writer:
    """Writes generations into `out` the way FileOutput does."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def write(self, chain: str, key: str, root: str) -> Path:
        return write_generation(self.out, CertificateFiles(chain, key, root), NOW)


def issue_pairs(pki: TestCa, count: int) -> list[tuple[str, str]]:
    pairs = []
    for _ in range(count):
        key = generate_private_key()
        chain = pki.sign_csr(
            build_csr(key, IDENTITY), timedelta(hours=1), NOW + CLOCK_SKEW_BACKDATE
        )
        pairs.append((chain[0], private_key_to_pem(key).decode()))
    return pairs


def test_layout_modes_and_old_generations(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    out = tmp_path / "out"
    writer = Writer(out)
    pairs = issue_pairs(pki, 4)
    for chain, key in pairs:
        writer.write(chain, key, pki.root_pem)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert os.readlink(out / "cert-chain.pem") == "..data/cert-chain.pem"
    assert os.readlink(out / "key.pem") == "..data/key.pem"
    assert os.readlink(out / "root-cert.pem") == "..data/root-cert.pem"
    assert stat.S_IMODE((out / "key.pem").stat().st_mode) == 0o600
    assert (out / "cert-chain.pem").read_text() == pairs[-1][0]
    assert (out / "root-cert.pem").read_text() == pki.root_pem
    generations = [p for p in out.iterdir() if p.name.startswith("..") and p.name != "..data"]
    assert len(generations) == 2  # the current one and the one before it


def _generations(out: Path) -> set[str]:
    return {p.name for p in out.iterdir() if p.name.startswith("..") and p.name != "..data"}


def test_kept_generations_are_the_current_and_the_one_it_replaced(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    out = tmp_path / "out"
    writer = Writer(out)
    names = [writer.write(chain, key, pki.root_pem).name for chain, key in issue_pairs(pki, 3)]
    assert _generations(out) == {names[1], names[2]}
    assert os.readlink(out / "..data") == names[2]


def test_a_failed_write_leaves_no_partial_generation(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    out = tmp_path / "out"
    writer = Writer(out)
    (chain, key), (next_chain, _) = issue_pairs(pki, 2)
    first = writer.write(chain, key, pki.root_pem).name
    with pytest.raises(UnicodeEncodeError):
        writer.write(next_chain, "not ascii: \u00e9", pki.root_pem)
    assert _generations(out) == {first}
    assert os.readlink(out / "..data") == first
    assert (out / "cert-chain.pem").read_text() == chain


def test_existing_directory_is_accepted_and_listener_waits_for_both(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    tmp_path.chmod(0o755)
    writer = FileOutput.single(tmp_path, FakeClock(NOW))
    chain, key = issue_pairs(pki, 1)[0]
    writer.on_secret(TlsSecret("default", chain, key))
    assert writer.writes == 0
    writer.on_secret(RootSecret("ROOTCA", pki.root_pem))
    writer.on_secret(RootSecret("ROOTCA", pki.root_pem))  # unchanged: no rewrite
    writer.on_secret(TlsSecret("file-cert:a~b", chain, key))  # not ours
    assert writer.writes == 1
    assert (tmp_path / "key.pem").read_text() == key


def test_readers_never_see_a_key_that_does_not_match_the_cert(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    out = tmp_path / "out"
    writer = Writer(out)
    pairs = issue_pairs(pki, 50)
    writer.write(*pairs[0], pki.root_pem)
    stop = threading.Event()
    checked: list[int] = [0]
    mismatches: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                # The kubelet-consumer pattern: resolve ..data once, read the set from there.
                generation = Path(os.path.realpath(out / "..data"))
                cert = load_cert((generation / "cert-chain.pem").read_bytes())
                key = load_private_key((generation / "key.pem").read_bytes())
            except FileNotFoundError:
                continue  # that generation was just retired; resolve again
            if not key_matches_certificate(key, cert):
                mismatches.append(generation.name)
            checked[0] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for chain, key in pairs[1:]:
            writer.write(chain, key, pki.root_pem)
    finally:
        stop.set()
        thread.join(10)
    assert not mismatches
    assert checked[0] > 0
    final = load_cert((out / "cert-chain.pem").read_bytes())
    assert key_matches_certificate(load_private_key((out / "key.pem").read_bytes()), final)


def test_read_current_returns_the_generation_written_last(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    writer = Writer(tmp_path)
    (chain, key), (next_chain, next_key) = issue_pairs(pki, 2)
    writer.write(chain, key, pki.root_pem)
    generation = writer.write(next_chain, next_key, pki.root_pem)
    files, source = read_current(tmp_path)
    assert source == generation.resolve()
    assert files == CertificateFiles(next_chain, next_key, pki.root_pem)


def test_node_layout_writes_one_directory_per_identity_and_removes_it(tmp_path: Path) -> None:
    pki = TestCa(NOW)
    writer = FileOutput.node(tmp_path, FakeClock(NOW))
    (chain, key), (other_chain, other_key) = issue_pairs(pki, 2)
    first = "spiffe://cluster.local/ns/shop/sa/cart"
    second = "spiffe://cluster.local/ns/shop/sa/payments"
    writer.on_secret(RootSecret("ROOTCA", pki.root_pem))
    writer.on_secret(TlsSecret(first, chain, key))
    writer.on_secret(TlsSecret(second, other_chain, other_key))
    writer.on_secret(TlsSecret("default", chain, key))  # not a SPIFFE ID: not in this layout
    assert (tmp_path / "shop" / "cart" / "cert-chain.pem").read_text() == chain
    assert (tmp_path / "shop" / "payments" / "key.pem").read_text() == other_key
    assert not (tmp_path / "cert-chain.pem").exists() and writer.writes == 2
    writer.on_secret_removed(first)
    assert not (tmp_path / "shop" / "cart").exists()
    assert (tmp_path / "shop" / "payments").is_dir()
    writer.on_secret_removed(second)
    assert not (tmp_path / "shop").exists()
