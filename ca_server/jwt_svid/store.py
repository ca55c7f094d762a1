"""Where the JWT-SVID keys live, shared by every CA process that uses the same data directory.

One file, `jwt-authority.json` (mode 0600: it holds the private keys), in `--data-dir`, changed
only under the data directory's `flock` (the one the X.509 slots use) and written atomically, so
every `--workers` process and every replica on the same volume signs with ONE key and publishes
ONE JWKS. The first process to start creates the first key under the lock; the others read it.
`fingerprint` is the file's stat, polled cheaply by the driver to notice another writer
(another worker, another replica, `meshca authority … --jwt`).

Encoding: JSON with PKCS#8 PEM keys and per key its phase, taint and times, plus a version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from ca_server.authority import Phase, data_dir_lock
from ca_server.errors import CaSetupError
from ca_server.jwt_svid.keys import JwtEvent, JwtKey, JwtKeyState
from certs import CertsError, load_private_key, private_key_to_pem
from certs.jwk import JWT_ALGORITHMS, new_jwt_key
from meshca.clock import Clock
from meshca.files import atomic_write

JWT_STATE_FILE = "jwt-authority.json"
FORMAT_VERSION = 1

JwtStateChange = Callable[[JwtKeyState], JwtKeyState | None]


class JwtKeyStore(Protocol):
    """Where the keys are shared: `--data-dir` (`LocalJwtKeyStore`) or, in Kubernetes mode, a
    Secret (`kube_store.KubeJwtKeyStore`). Blocking: called from worker threads."""

    @property
    def description(self) -> str: ...

    def read(self) -> JwtKeyState:
        """The current keys (creating the first one if there is none yet)."""
        ...

    def transact(self, change: JwtStateChange) -> JwtKeyState:
        """Applies `change` atomically with respect to every other writer (`None`: nothing to
        do); returns the state after it."""
        ...

    def fingerprint(self) -> str:
        """Changes whenever the stored keys change."""
        ...


@dataclass(frozen=True)
class JwtKeyFactory:
    """Makes new JWT-SVID keys: a fresh key of the configured algorithm every time."""

    algorithm: str
    lifetime: timedelta

    def __post_init__(self) -> None:
        if self.algorithm not in JWT_ALGORITHMS:
            raise ValueError(
                f"--jwt-key-algorithm {self.algorithm!r}: use one of {', '.join(JWT_ALGORITHMS)}"
            )

    def new(self, now: datetime, phase: Phase) -> JwtKey:
        return JwtKey(new_jwt_key(self.algorithm), phase, now, now + self.lifetime)

    def first_state(self, now: datetime) -> JwtKeyState:
        key = self.new(now, Phase.ACTIVE)
        return JwtKeyState((key,), (JwtEvent(now, "activated", key.kid, "first start"),))


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def encode_jwt_state(state: JwtKeyState) -> str:
    return json.dumps(
        {
            "version": FORMAT_VERSION,
            "keys": [
                {
                    "kid": key.kid,
                    "phase": key.phase.value,
                    "tainted": key.tainted,
                    "created_at": key.created_at.isoformat(),
                    "not_after": key.not_after.isoformat(),
                    "retired_at": key.retired_at.isoformat() if key.retired_at else None,
                    "activated_at": key.activated_at.isoformat() if key.activated_at else None,
                    "key": private_key_to_pem(key.key).decode(),
                }
                for key in state.keys
            ],
            "history": [
                {"at": e.at.isoformat(), "event": e.event, "kid": e.kid, "reason": e.reason}
                for e in state.history
            ],
        },
        indent=1,
    )


def decode_jwt_state(text: str | bytes, where: str) -> JwtKeyState:
    """Raises `CaSetupError` naming `where` for anything unreadable."""
    try:
        data: Any = json.loads(text)
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('version')!r}, expected {FORMAT_VERSION}")
        keys = []
        for entry in data["keys"]:
            key = JwtKey(
                load_private_key(entry["key"]),
                Phase(entry["phase"]),
                datetime.fromisoformat(entry["created_at"]),
                datetime.fromisoformat(entry["not_after"]),
                tainted=bool(entry["tainted"]),
                retired_at=_time(entry.get("retired_at")),
                activated_at=_time(entry.get("activated_at")),
            )
            if key.kid != entry["kid"]:
                raise ValueError(f"key {entry['kid']} does not match its thumbprint {key.kid}")
            keys.append(key)
        history = tuple(
            JwtEvent(datetime.fromisoformat(e["at"]), e["event"], e["kid"], e.get("reason", ""))
            for e in data.get("history", ())
        )
        state = JwtKeyState(tuple(keys), history)
        state.active  # noqa: B018 - exactly one active key, or the file is not usable
    except (ValueError, KeyError, TypeError, AttributeError, CertsError) as exc:
        raise CaSetupError(
            f"cannot read the JWT-SVID keys in {where}: {exc}; restore the file from a backup, "
            "or move it away to start with a new key (tokens already issued will then fail)"
        ) from None
    except Exception as exc:  # AuthorityCommandError: no active key
        raise CaSetupError(f"cannot use the JWT-SVID keys in {where}: {exc}") from None
    return state


class LocalJwtKeyStore:
    """`jwt-authority.json` in the data directory, under its lock."""

    def __init__(self, data_dir: Path, factory: JwtKeyFactory, clock: Clock) -> None:
        self.path = data_dir / JWT_STATE_FILE
        self._data_dir = data_dir
        self._factory = factory
        self._clock = clock

    @property
    def description(self) -> str:
        return str(self.path)

    def _load(self) -> JwtKeyState | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CaSetupError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        return decode_jwt_state(text, str(self.path))

    def _write(self, state: JwtKeyState) -> None:
        try:
            atomic_write(self.path, encode_jwt_state(state), mode=0o600)
        except OSError as exc:
            raise CaSetupError(
                f"cannot write {self.path}: {exc.strerror or exc}; the data directory must be "
                "writable"
            ) from None

    def read(self) -> JwtKeyState:
        """The current keys; the first process creates the first key (under the lock)."""
        state = self._load()
        if state is not None:
            return state
        return self.transact(lambda current: None)

    def transact(self, change: JwtStateChange) -> JwtKeyState:
        with data_dir_lock(self._data_dir):
            state = self._load()
            if state is None:
                state = self._factory.first_state(self._clock.now())
                self._write(state)
            new = change(state)
            if new is None:
                return state
            self._write(new)
            return new

    def fingerprint(self) -> str:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return ""
        return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"
