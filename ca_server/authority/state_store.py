"""Where the authority slots live, shared by every CA process that uses the same state.

`AuthorityStateStore` is the seam: `read` the current `AuthorityState`, `transact` a change
(read-modify-write that no other writer can interleave with), and a cheap `fingerprint` the
driver polls to notice other writers (another worker, another replica, `meshca authority`).

- `LocalAuthorityStateStore`: `authorities.json` (mode 0600: it holds the keys) in `--data-dir`,
  changed only under the data directory's `flock` and written atomically. That one file is the
  truth: the files derived from it (`write_derived_files`: `ca-cert.pem`/`ca-key.pem`, the
  *active* authority for tools that read Istio's layout, and `root-cert.pem`, the bundle) are
  rewritten from it in every transaction — on start and on each reload, too — so a process
  killed between two renames leaves nothing that disagrees for longer than that. Before each
  load the directory and the state files are checked (`ca_server.authority.data_dir_guard`); the
  first transaction of a process sweeps the temporary files a killed writer left. A data directory
  from before slots existed (the Istio pair only) is adopted as the active slot, so an upgrade
  keeps the mesh's root.
- The Kubernetes Secret store lives in `ca_server.kube.secret_root` and shares the
  encoding below (`encode_state`/`decode_state`).

Encoding: JSON with PEM certificates and PKCS#8 PEM keys, plus per slot its phase, taint and
times; a version number so a later format can be recognised.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from ca_server.authority.data_dir_guard import check_state_files, sweep_stale_temporaries
from ca_server.authority.root_bundle import (
    ROOT_CERT_FILE,
    data_dir_lock,
    writing_to_data_dir,
)
from ca_server.authority.slots import AuthorityState, HistoryEvent, Phase, Slot
from ca_server.errors import CaSetupError
from certs import (
    CLOCK_SKEW_BACKDATE,
    CertsError,
    KeySpec,
    cert_to_pem,
    certs_to_pem,
    load_cert,
    load_private_key,
    new_self_signed_authority,
    private_key_to_pem,
)
from meshca.clock import Clock
from meshca.files import atomic_write
from meshca.taint_notice import TAINT_NOTICE_NAME, encode_taint_notice

log = logging.getLogger(__name__)

STATE_FILE = "authorities.json"
LEGACY_CERT, LEGACY_KEY = "ca-cert.pem", "ca-key.pem"
FORMAT_VERSION = 1

StateChange = Callable[[AuthorityState], AuthorityState | None]


class AuthorityStateStore(Protocol):
    @property
    def description(self) -> str: ...

    def read(self) -> AuthorityState:
        """The current state (creating the first authority if there is none yet)."""
        ...

    def transact(self, change: StateChange) -> AuthorityState:
        """Applies `change` to the current state atomically with respect to every other
        writer; `change` returns the new state or `None` for "nothing to do". Returns the state
        after the transaction. Exceptions from `change` leave the stored state untouched."""
        ...

    def fingerprint(self) -> str:
        """Changes whenever the stored state changes; cheap (polled every few seconds)."""
        ...


@dataclass(frozen=True)
class SlotFactory:
    """Makes new self-signed authorities: a fresh key every time."""

    key_spec: KeySpec
    trust_domain: str
    lifetime: timedelta

    def new(self, now: datetime, phase: Phase) -> Slot:
        authority = new_self_signed_authority(
            self.key_spec, self.trust_domain, now=now, lifetime=self.lifetime
        )
        return Slot(cert=authority.cert, key=authority.key, phase=phase, issued_at=now)

    def first_state(self, now: datetime) -> AuthorityState:
        slot = self.new(now, Phase.ACTIVE)
        return AuthorityState((slot,), (HistoryEvent(now, "activated", slot.id, "first start"),))


def adopted_state(cert_pem: bytes, key_pem: bytes, now: datetime, where: str) -> AuthorityState:
    """A root that existed before slots did (Istio's layout), taken over as the active slot."""
    try:
        cert = load_cert(cert_pem, what=f"{where} {LEGACY_CERT}")
        key = load_private_key(key_pem)
    except CertsError as exc:
        raise CaSetupError(f"cannot adopt the existing root in {where}: {exc}") from exc
    slot = Slot(cert=cert, key=key, phase=Phase.ACTIVE, issued_at=_issued_at(cert))
    return AuthorityState((slot,), (HistoryEvent(now, "adopted", slot.id, f"existing {where}"),))


def _issued_at(cert: Any) -> datetime:
    """meshca backdates NotBefore for clock skew; undo that for a root of this shape."""
    not_before: datetime = cert.not_valid_before_utc
    return not_before + CLOCK_SKEW_BACKDATE


# -- encoding ------------------------------------------------------------------------------


def encode_state(state: AuthorityState) -> str:
    return json.dumps(
        {
            "version": FORMAT_VERSION,
            "slots": [
                {
                    "id": slot.id,
                    "phase": slot.phase.value,
                    "tainted": slot.tainted,
                    "issued_at": slot.issued_at.isoformat(),
                    "retired_at": slot.retired_at.isoformat() if slot.retired_at else None,
                    "cert": cert_to_pem(slot.cert),
                    "key": private_key_to_pem(slot.key).decode(),
                }
                for slot in state.slots
            ],
            "history": [
                {"at": e.at.isoformat(), "event": e.event, "id": e.authority, "reason": e.reason}
                for e in state.history
            ],
        },
        indent=1,
        sort_keys=True,
    )


def decode_state(text: str | bytes, where: str) -> AuthorityState:
    """Parses and checks the stored state; `CaSetupError` names what is wrong and where."""
    try:
        raw = json.loads(text)
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown format version {raw.get('version')!r}")
        slots = tuple(
            Slot(
                cert=load_cert(item["cert"].encode(), what=f"slot {item['id']}"),
                key=load_private_key(item["key"].encode()),
                phase=Phase(item["phase"]),
                issued_at=datetime.fromisoformat(item["issued_at"]),
                tainted=bool(item["tainted"]),
                retired_at=datetime.fromisoformat(item["retired_at"])
                if item.get("retired_at")
                else None,
            )
            for item in raw["slots"]
        )
        history = tuple(
            HistoryEvent(datetime.fromisoformat(e["at"]), e["event"], e["id"], e.get("reason", ""))
            for e in raw.get("history", [])
        )
    except (ValueError, KeyError, TypeError, CertsError) as exc:
        raise CaSetupError(
            f"the authority state in {where} is unreadable ({exc}); restore it from a backup"
        ) from exc
    state = AuthorityState(slots, history)
    actives = [s for s in slots if s.phase is Phase.ACTIVE]
    if len(actives) != 1:
        raise CaSetupError(
            f"the authority state in {where} has {len(actives)} active authorities (need 1); "
            "restore it from a backup"
        )
    return state


def state_digest(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()


# -- local data directory ------------------------------------------------------------------


class LocalAuthorityStateStore:
    def __init__(self, data_dir: Path, factory: SlotFactory, clock: Clock):
        self.data_dir = data_dir
        self._factory = factory
        self._clock = clock
        self._path = data_dir / STATE_FILE
        self._swept = False  # the stale temporaries, once per process (under the lock)

    @property
    def description(self) -> str:
        return f"authority slots in {self._path}"

    def fingerprint(self) -> str:
        try:
            return state_digest(self._path.read_bytes())
        except FileNotFoundError:
            return "<absent>"

    def read(self) -> AuthorityState:
        check_state_files(self.data_dir)
        try:
            return decode_state(self._path.read_bytes(), str(self._path))
        except FileNotFoundError:
            return self.transact(lambda state: None)

    def transact(self, change: StateChange) -> AuthorityState:
        with data_dir_lock(self.data_dir):
            check_state_files(self.data_dir)
            if not self._swept:
                sweep_stale_temporaries(self.data_dir)
                self._swept = True
            current, created = self._load_locked()
            updated = change(current)
            final = current if updated is None else updated
            with writing_to_data_dir("the authority state (root keys)", self._path):
                if updated is not None or created:
                    atomic_write(self._path, encode_state(final), mode=0o600)
                write_derived_files(self.data_dir, final)
            return final

    def _load_locked(self) -> tuple[AuthorityState, bool]:
        """The stored state, or (first start / upgrade) a new or adopted one to be written."""
        try:
            return decode_state(self._path.read_bytes(), str(self._path)), False
        except FileNotFoundError:
            pass
        cert_path, key_path = self.data_dir / LEGACY_CERT, self.data_dir / LEGACY_KEY
        if cert_path.exists() and not key_path.exists():
            raise CaSetupError(
                f"{cert_path} exists without {key_path}: restore the key or remove both to "
                "generate a new root (workloads will then need the new root-cert.pem)"
            )
        if cert_path.exists():
            log.info("adopting the existing root in %s as the active authority", self.data_dir)
            return (
                adopted_state(
                    cert_path.read_bytes(),
                    key_path.read_bytes(),
                    self._clock.now(),
                    str(self.data_dir),
                ),
                True,
            )
        log.info("generating the first authority in %s", self.data_dir)
        return self._factory.first_state(self._clock.now()), True


def write_derived_files(data_dir: Path, state: AuthorityState) -> None:
    """Every file derived from the authority state, rewritten where it differs (so a poll that
    finds them right writes nothing): `ca-key.pem` + `ca-cert.pem`, the active authority in
    Istio's self-signed layout, and `root-cert.pem`, the trust bundle workloads verify with,
    after the taint notice beside it (`meshca.taint_notice`: a reader never sees a bundle newer
    than the taints that came with it, and `meshca authority taint` reaches agents at once).
    The one place that writes them, so a file added beside them is added here."""
    active = state.active
    _write_if_changed(data_dir / LEGACY_KEY, private_key_to_pem(active.key), mode=0o600)
    _write_if_changed(data_dir / LEGACY_CERT, cert_to_pem(active.cert).encode())
    notice = encode_taint_notice(state.tainted_since()) + "\n"
    _write_if_changed(data_dir / TAINT_NOTICE_NAME, notice.encode())
    _write_if_changed(data_dir / ROOT_CERT_FILE, certs_to_pem(state.bundle).encode())


def _write_if_changed(path: Path, data: bytes, mode: int = 0o644) -> None:
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    atomic_write(path, data, mode=mode)
