"""The slots in `--data-dir`: created once, adopted from a pre-slot directory, changed only in
transactions, private, and readable by Istio-layout tools (`ca-cert.pem` = the active one)."""

from __future__ import annotations

import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ca_server.authority.slots import AuthorityCommandError, AuthorityState, Phase
from ca_server.authority.state_store import (
    STATE_FILE,
    LocalAuthorityStateStore,
    SlotFactory,
    decode_state,
    encode_state,
)
from ca_server.errors import CaSetupError
from certs import KeySpec, cert_to_pem, load_cert, new_self_signed_authority, private_key_to_pem
from meshca.clock import FakeClock

NOW = datetime(2030, 1, 1, tzinfo=UTC)
FACTORY = SlotFactory(KeySpec(), "cluster.local", timedelta(hours=1))


def _store(data_dir: Path) -> LocalAuthorityStateStore:
    return LocalAuthorityStateStore(data_dir, FACTORY, FakeClock(NOW))


def test_first_read_creates_one_active_authority_and_istio_files(tmp_path: Path):
    state = _store(tmp_path).read()
    assert [s.phase for s in state.slots] == [Phase.ACTIVE]
    assert stat.S_IMODE((tmp_path / STATE_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600
    assert load_cert((tmp_path / "ca-cert.pem").read_bytes()) == state.active.cert
    again = _store(tmp_path).read()
    assert again.active.id == state.active.id, "a second process reads the same authority"


def test_a_pre_slot_data_dir_is_adopted_not_replaced(tmp_path: Path):
    legacy = new_self_signed_authority(
        KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(days=30)
    )
    (tmp_path / "ca-cert.pem").write_text(cert_to_pem(legacy.cert))
    (tmp_path / "ca-key.pem").write_bytes(private_key_to_pem(legacy.key))
    state = _store(tmp_path).read()
    assert state.active.cert == legacy.cert
    assert state.history[-1].event == "adopted"


def test_certificate_without_key_refuses(tmp_path: Path):
    legacy = new_self_signed_authority(KeySpec(), "cluster.local", now=NOW, lifetime=timedelta(1))
    (tmp_path / "ca-cert.pem").write_text(cert_to_pem(legacy.cert))
    with pytest.raises(CaSetupError, match="restore the key"):
        _store(tmp_path).read()


def test_transactions_persist_and_a_refused_change_leaves_the_state_alone(tmp_path: Path):
    store = _store(tmp_path)
    first = store.read()
    before = store.fingerprint()
    with pytest.raises(AuthorityCommandError):
        store.transact(lambda state: state.activate(None, NOW, "operator"))
    assert store.fingerprint() == before

    prepared = store.transact(
        lambda s: s.prepare(lambda: FACTORY.new(NOW, Phase.PREPARED), NOW, "operator")
    )
    assert store.fingerprint() != before
    activated = store.transact(lambda s: s.activate(None, NOW, "operator"))
    assert activated.active.id == (prepared.prepared.id if prepared.prepared else None)
    assert load_cert((tmp_path / "ca-cert.pem").read_bytes()) == activated.active.cert
    reread = _store(tmp_path).read()
    assert [(s.id, s.phase, s.retired_at) for s in reread.slots] == [
        (s.id, s.phase, s.retired_at) for s in activated.slots
    ]
    assert reread.old[0].id == first.active.id


def test_concurrent_writers_each_see_the_others_change(tmp_path: Path):
    """Eight threads (standing in for workers) each prepare-if-none: exactly one prepares."""
    _store(tmp_path).read()
    barrier = threading.Barrier(8)
    prepared_by_me: list[bool] = []

    def prepare_if_none(state: AuthorityState) -> AuthorityState | None:
        if state.prepared is not None:
            prepared_by_me.append(False)
            return None
        prepared_by_me.append(True)
        return state.prepare(lambda: FACTORY.new(NOW, Phase.PREPARED), NOW, "test")

    def run() -> None:
        barrier.wait()
        _store(tmp_path).transact(prepare_if_none)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(prepared_by_me) == [False] * 7 + [True]
    assert len(_store(tmp_path).read().slots) == 2


def test_unreadable_state_is_refused_with_what_to_do(tmp_path: Path):
    state = _store(tmp_path).read()
    assert decode_state(encode_state(state), "x").active.id == state.active.id
    (tmp_path / STATE_FILE).write_text('{"version": 1, "slots": [')
    with pytest.raises(CaSetupError, match="restore it from a backup"):
        _store(tmp_path).read()
