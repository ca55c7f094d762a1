"""The surfaces an operator (or a local attacker) touches, issue #18: the authority CLI refuses
what would break trust, the CA refuses a data directory others could write, and no kill point of
`activate` leaves the derived files disagreeing with `authorities.json`.

Every refusal is checked the same way (`_refusal`): the exit status, exactly one line on stderr
saying what to fix, no Python traceback, and nothing written in the data directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from ca_server.authority.slots import AuthorityState, Phase, Slot
from ca_server.authority.state_store import (
    STATE_FILE,
    LocalAuthorityStateStore,
    SlotFactory,
    decode_state,
    encode_state,
)
from certs import (
    KeySpec,
    SpiffeId,
    build_csr,
    cert_to_pem,
    certs_to_pem,
    generate_private_key,
    key_matches_certificate,
    load_cert,
    load_private_key,
    private_key_to_pem,
)
from meshca.clock import SystemClock
from meshca.files import atomic_write
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_process import CaProcess
from tests.support.processes import child_env, free_port, http_status, http_text, wait_for

ACTIVE_LIFETIME = timedelta(days=30)  # the CA grants leaves of at most a sixth: 5 days
SLEEP = SpiffeId("cluster.local", "default", "sleep")
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another uid")
NOBODY = 65534


def _snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `directory`: mode and content (what "nothing written" compares); the
    empty `.lock` a command opens to take the lock is not state."""
    return {
        str(path.relative_to(directory)): (path.stat().st_mode, path.read_bytes())
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != ".lock"
    }


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def _refusal(data_dir: Path, *args: str, status: int = 3) -> str:
    """Runs `meshca authority ARGS --data-dir D`; checks the refusal and returns its line."""
    before = _snapshot(data_dir)
    result = meshca_authority(data_dir_target(data_dir), *args)
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert _snapshot(data_dir) == before, "a refused command wrote to the data directory"
    return _one_line(result.stderr)


def _store(data_dir: Path) -> LocalAuthorityStateStore:
    factory = SlotFactory(KeySpec(), "cluster.local", ACTIVE_LIFETIME)
    return LocalAuthorityStateStore(data_dir, factory, SystemClock())


def _with_prepared(data_dir: Path, *, issued: datetime, lifetime: timedelta) -> str:
    """A data directory with an active authority (30 days) and a prepared one issued at
    `issued` for `lifetime`; returns the prepared one's ID."""
    store = _store(data_dir)
    store.read()
    maker = SlotFactory(KeySpec(), "cluster.local", lifetime)
    state = store.transact(
        lambda s: s.prepare(lambda: maker.new(issued, Phase.PREPARED), issued, "test")
    )
    assert state.prepared is not None
    return state.prepared.id


# -- the authority CLI -----------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("ttl", ["1s", "0s", "4d"])
def test_prepare_refuses_a_lifetime_shorter_than_the_longest_leaf(tmp_path: Path, ttl: str):
    """Before: `prepare --root-ttl 1s` made an authority that had expired by the time it was
    activated, and `--root-ttl 0s` silently meant the active one's lifetime."""
    _store(tmp_path).read()
    line = _refusal(tmp_path, "prepare", "--root-ttl", ttl)
    assert line.startswith("meshca authority prepare: refused: a lifetime of ")
    assert "shorter than the longest workload certificate the CA grants (5d)" in line
    assert "--root-ttl" in line


@pytest.mark.process
def test_prepare_accepts_a_short_lifetime_when_the_ca_grants_shorter_leaves(tmp_path: Path):
    """The floor is the CA's figure: stating a lower --max-workload-cert-ttl lets it through."""
    _store(tmp_path).read()
    result = meshca_authority(
        data_dir_target(tmp_path), "prepare", "--root-ttl", "4d", "--max-workload-cert-ttl", "1d"
    )
    assert result.returncode == 0, result.stderr
    assert "prepared" in result.stdout


@pytest.mark.process
def test_a_zero_maximum_workload_ttl_is_a_usage_error_not_the_default(tmp_path: Path):
    _store(tmp_path).read()
    line = _refusal(
        tmp_path, "prepare", "--root-ttl", "1s", "--max-workload-cert-ttl", "0s", status=2
    )
    assert line == (
        "meshca authority prepare: --max-workload-cert-ttl '0s' must be longer than 0s (the CA's)"
    )


@pytest.mark.process
@pytest.mark.parametrize(
    ("issued", "lifetime", "why"),
    [
        (timedelta(days=-2), timedelta(days=1), "expired at "),
        (timedelta(days=1), ACTIVE_LIFETIME, "is not valid until "),
        (timedelta(days=-29), ACTIVE_LIFETIME, "sooner than the longest workload certificate"),
    ],
    ids=["expired", "not-yet-valid", "expires-before-the-longest-leaf"],
)
def test_activate_refuses_an_authority_that_cannot_serve(
    tmp_path: Path, issued: timedelta, lifetime: timedelta, why: str
):
    """Before: all three were activated (exit 0), and with `--no-root-rotation` every handshake
    then failed. Now: exit 3, one line saying why, the state untouched."""
    prepared = _with_prepared(tmp_path, issued=datetime.now(UTC) + issued, lifetime=lifetime)
    for args in (("activate",), ("activate", prepared)):
        line = _refusal(tmp_path, *args)
        assert line.startswith(f"meshca authority activate: refused: authority {prepared} ")
        assert why in line and "prepare" in line
    assert _store(tmp_path).read().prepared is not None


def _slot_with_id(ski: str, phase: Phase) -> Slot:
    """An authority whose ID (Subject Key ID) is `ski`, to make prefixes collide."""
    key = generate_private_key(KeySpec())
    now = datetime.now(UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test {ski[:12]}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + ACTIVE_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier(bytes.fromhex(ski)), critical=False)
        .sign(key, hashes.SHA256())
    )
    retired = now if phase is Phase.OLD else None
    return Slot(cert, key, phase, now - timedelta(hours=1), retired_at=retired)


@pytest.mark.process
@pytest.mark.parametrize(
    ("ident", "expected"),
    [
        ("deadbeef", "'deadbeef' is ambiguous: 2 authorities start with it ("),
        ("dead", "'dead' is too short: give at least 8 hex digits of an ID (2 authorities"),
        ("a1", "'a1' is too short: give at least 8 hex digits of an ID (1 authorities"),
        ("0123456789ab", "'0123456789ab' is not a known authority; the authorities are: "),
        ("not-an-id", "'not-an-id' is not an authority ID (IDs are hex digits)"),
    ],
    ids=["ambiguous", "short-and-ambiguous", "short-but-unique", "unknown", "not-hex"],
)
def test_an_authority_id_that_names_no_single_authority_says_why(
    tmp_path: Path, ident: str, expected: str
):
    """Before: a prefix shorter than 8 digits said "not a known authority" even when it was the
    start of one (or of several)."""
    state = AuthorityState(
        (
            _slot_with_id("a1" + "00" * 19, Phase.ACTIVE),
            _slot_with_id("deadbeef" + "00" * 15 + "01", Phase.OLD),
            _slot_with_id("deadbeef" + "00" * 15 + "02", Phase.OLD),
        )
    )
    atomic_write(tmp_path / STATE_FILE, encode_state(state), mode=0o600)
    line = _refusal(tmp_path, "taint", ident)
    assert f"meshca authority taint: refused: {expected}" in line, line
    if "ambiguous" in expected:
        assert "deadbeef" + "00" * 15 + "01" in line and "give more digits" in line
    show = meshca_authority(data_dir_target(tmp_path), "show", ident)
    assert show.returncode == 3 and _one_line(show.stderr).endswith(line.split("refused: ")[1])


@pytest.mark.process
def test_show_id_shows_that_authority_only(tmp_path: Path):
    """Before: `show ID` printed every authority, whatever the ID."""
    prepared = _with_prepared(tmp_path, issued=datetime.now(UTC), lifetime=ACTIVE_LIFETIME)
    result = meshca_authority(data_dir_target(tmp_path), "show", prepared[:10], "-o", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["authorities"]
    assert [(row["id"], row["state"]) for row in rows] == [(prepared, "prepared")]
    table = meshca_authority(data_dir_target(tmp_path), "show", prepared).stdout
    assert prepared in table and "active" not in table


# -- `meshca ca` on a data directory others could write ---------------------------------------


def _ca_args(data_dir: Path | str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshca",
        "ca",
        "--data-dir",
        str(data_dir),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--monitoring-listen",
        f"127.0.0.1:{free_port()}",
        "--workers",
        "1",
        *extra,
    ]


def _ca_refuses(data_dir: Path, *extra: str, prefix: str = "meshca ca: cannot start: ") -> str:
    """`meshca ca` must stop at once with status 2 and one line; nothing written."""
    before = _snapshot(data_dir) if data_dir.is_dir() else None
    try:
        result = subprocess.run(
            _ca_args(data_dir, *extra), env=child_env(), capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the CA started instead of refusing: {exc.stderr!r}") from None
    assert result.returncode == 2, (result.returncode, result.stderr)
    if before is not None:
        assert _snapshot(data_dir) == before, "the refusing CA wrote to its data directory"
    line = _one_line(result.stderr)
    assert line.startswith(prefix), line
    return line


def _initialised(data_dir: Path) -> None:
    """What a first start leaves: the authority state and its derived files, mode 0700."""
    data_dir.mkdir(mode=0o700)
    state = _store(data_dir).transact(lambda state: None)
    if not (data_dir / "root-cert.pem").exists():  # the rotator publishes it, too
        atomic_write(data_dir / "root-cert.pem", certs_to_pem(state.bundle))


@pytest.mark.process
def test_a_world_writable_data_dir_is_refused_naming_the_fix(tmp_path: Path):
    """Before: accepted silently (and an unprivileged user could swap the CA's keys)."""
    data_dir = tmp_path / "data"
    _initialised(data_dir)
    data_dir.chmod(0o777)
    line = _ca_refuses(data_dir)
    assert f"--data-dir {data_dir} is writable by its group and others (mode 0777)" in line
    assert f"chmod go-w {data_dir}" in line


@pytest.mark.process
@pytest.mark.parametrize("name", [STATE_FILE, "ca-key.pem", "root-cert.pem"])
def test_a_group_writable_file_in_the_data_dir_is_refused(tmp_path: Path, name: str):
    data_dir = tmp_path / "data"
    _initialised(data_dir)
    (data_dir / name).chmod(0o660)
    line = _ca_refuses(data_dir)
    assert f"{data_dir / name} is writable by its group (mode 0660)" in line
    assert f"chmod go-w {data_dir / name}" in line


@pytest.mark.process
@AS_ROOT
@pytest.mark.parametrize("name", [".", STATE_FILE, "dev-issuer/signing-key.pem"])
def test_a_data_dir_or_file_owned_by_another_user_is_refused(tmp_path: Path, name: str):
    data_dir = tmp_path / "data"
    _initialised(data_dir)
    if name.startswith("dev-issuer"):
        (data_dir / "dev-issuer").mkdir(mode=0o700)
        atomic_write(
            data_dir / name, private_key_to_pem(generate_private_key(KeySpec())), mode=0o600
        )
    path = data_dir if name == "." else data_dir / name
    os.chown(path, NOBODY, NOBODY)
    line = _ca_refuses(data_dir)
    assert f"{path} is owned by uid {NOBODY}, not by the user the CA runs as (uid 0)" in line
    assert f"chown 0 {path}" in line


@pytest.mark.process
def test_a_data_dir_that_is_a_regular_file_is_one_line(tmp_path: Path):
    """Before: a `FileExistsError` traceback."""
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("not a directory\n")
    line = _ca_refuses(not_a_dir, prefix="meshca ca: --data-dir")  # a usage error: the flag's
    assert f"--data-dir {not_a_dir}: is not a directory" in line
    assert not_a_dir.read_text() == "not a directory\n"


@pytest.mark.process
def test_a_cacerts_dir_that_does_not_exist_is_an_error_not_a_fresh_root(tmp_path: Path):
    """Before: one INFO line, then a brand-new self-signed root nobody trusts."""
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    missing = tmp_path / "cacerts-typo"
    line = _ca_refuses(data_dir, "--cacerts-dir", str(missing))
    assert f"--cacerts-dir {missing} does not exist" in line
    assert list(data_dir.iterdir()) == [], "no root may be generated"


@pytest.mark.process
def test_a_cacerts_dir_missing_a_file_is_an_error(tmp_path: Path):
    data_dir, cacerts = tmp_path / "data", tmp_path / "cacerts"
    data_dir.mkdir(mode=0o700)
    cacerts.mkdir()
    (cacerts / "ca-cert.pem").write_text("x")
    line = _ca_refuses(data_dir, "--cacerts-dir", str(cacerts))
    assert "incomplete plugged-in CA" in line and "ca-key.pem" in line


def _issuer_id(chain: list[str]) -> str:
    aki = load_cert(chain[0].encode()).extensions.get_extension_for_class(
        x509.AuthorityKeyIdentifier
    )
    assert aki.value.key_identifier is not None
    return aki.value.key_identifier.hex()


def _issue(ca: CaProcess, root_pem: bytes, token: str) -> list[str]:
    key = generate_private_key(KeySpec())
    csr = build_csr(key, SLEEP)
    with ca_stub(ca.addr, root_pem) as stub:
        return create_certificate(stub, csr, token=token)


@pytest.mark.process
@AS_ROOT
def test_a_crafted_state_renamed_into_a_writable_data_dir_does_not_switch_the_key(
    tmp_path: Path,
):
    """Before: the data directory made world-writable while the CA ran, an unprivileged user
    renamed their own `authorities.json` into it and the CA signed with their key within one
    poll. Now the reload is refused, loudly, once, and the CA keeps signing with its own."""
    data_dir = tmp_path / "data"
    ca = CaProcess(data_dir, "--ca-reload-interval", "0.5s")
    ca.start()
    try:
        root_pem = ca.root_cert_path.read_bytes()
        token = ca.mint_token("default", "sleep")
        ours = _store(data_dir).read().active.id
        assert _issuer_id(_issue(ca, root_pem, token)) == ours
        key_before = (data_dir / "ca-key.pem").read_bytes()

        crafted = SlotFactory(KeySpec(), "cluster.local", ACTIVE_LIFETIME).first_state(
            datetime.now(UTC)
        )
        theirs = crafted.active.id
        staged = tmp_path / "staged.json"
        staged.write_text(encode_state(crafted))
        os.chown(staged, NOBODY, NOBODY)
        data_dir.chmod(0o777)
        os.rename(staged, data_dir / STATE_FILE)

        # Ten polls, or until the refusal is logged and two polls more.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "refusing to load it" not in ca.log():
            time.sleep(0.2)
        time.sleep(1)
        chain = _issue(ca, root_pem, token)
        assert _issuer_id(chain) == ours != theirs, "the CA signs with the crafted key"
        assert (data_dir / "ca-key.pem").read_bytes() == key_before
        assert ca.root_cert_path.read_bytes() == root_pem
        assert http_status(f"{ca.monitoring_url}/ready") == 200
        refusals = [line for line in ca.log().splitlines() if "refusing to load it" in line]
        assert len(refusals) == 1, refusals  # once per distinct refusal, not every poll
        assert "ERROR" in refusals[0] and f"chmod go-w {data_dir}" in refusals[0]
        assert "Traceback" not in ca.log()
    finally:
        data_dir.chmod(0o700)
        ca.stop()


# -- crash consistency -----------------------------------------------------------------------

# Runs `meshca ARGS` with a SIGKILL just before the Nth rename of a file into place (an
# `atomic_write`'s last step), so the process dies with that write's temporary file on disk.
_KILL_AT_RENAME = """
import os, signal, sys
target, calls, real = int(sys.argv[1]), [0], os.replace
def replace(src, dst):
    calls[0] += 1
    if calls[0] == target:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
from meshca.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _kill_at_rename(n: int, *argv: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _KILL_AT_RENAME, str(n), *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr)


def _assert_consistent(data_dir: Path) -> AuthorityState:
    """The derived files agree with `authorities.json`, and no temporary file is left."""
    state = decode_state((data_dir / STATE_FILE).read_bytes(), "test")
    assert sorted(p.name for p in data_dir.rglob(".*.tmp")) == []
    cert = load_cert((data_dir / "ca-cert.pem").read_bytes())
    key = load_private_key((data_dir / "ca-key.pem").read_bytes())
    assert cert == state.active.cert
    assert key_matches_certificate(key, cert)
    assert (data_dir / "root-cert.pem").read_text() == certs_to_pem(state.bundle)
    return state


@pytest.mark.process
@pytest.mark.parametrize(
    "rename",
    [1, 2, 3, 4],
    ids=["before-authorities.json", "before-ca-key.pem", "before-ca-cert.pem", "before-root"],
)
def test_a_sigkill_at_each_rename_of_activate_comes_back_consistent(tmp_path: Path, rename: int):
    """`activate` writes authorities.json (the truth), then ca-key.pem, ca-cert.pem and
    root-cert.pem. Killed before any of those renames, the CA restarts with the derived files
    re-derived from the truth and the killed write's temporary file (it may hold every private
    key) swept at once. Before: the temporary files stayed forever; then `root-cert.pem`'s, left
    by a kill before the fourth rename, still did (spared while young, never looked at again)."""
    data_dir = tmp_path / "data"
    prepared = _with_prepared(data_dir, issued=datetime.now(UTC), lifetime=ACTIVE_LIFETIME)
    _kill_at_rename(rename, "authority", "activate", "--data-dir", str(data_dir))
    assert len(list(data_dir.glob(".*.tmp"))) == 1  # the killed write's temporary file
    ca = CaProcess(data_dir)
    ca.start()
    try:
        state = _assert_consistent(data_dir)
        # Killed before its first rename, activate changed nothing; after it, it is done.
        assert (state.active.id == prepared) is (rename > 1)
        token = ca.mint_token("default", "sleep")
        chain = _issue(ca, ca.root_cert_path.read_bytes(), token)
        assert _issuer_id(chain) == state.active.id
    finally:
        ca.stop()


@pytest.mark.process
def test_a_ca_key_that_disagrees_with_the_state_is_re_derived_at_start(tmp_path: Path):
    """The derived pair is rewritten from authorities.json whenever it differs, the key too.
    Before: only the certificate was compared, so a wrong `ca-key.pem` beside the right
    `ca-cert.pem` stayed wrong."""
    data_dir = tmp_path / "data"
    _initialised(data_dir)
    stray = private_key_to_pem(generate_private_key(KeySpec()))
    atomic_write(data_dir / "ca-key.pem", stray, mode=0o600)
    (data_dir / "root-cert.pem").write_text(cert_to_pem(_slot_with_id("ab" * 20, Phase.OLD).cert))
    ca = CaProcess(data_dir)
    ca.start()
    try:
        _assert_consistent(data_dir)
        assert (data_dir / "ca-key.pem").read_bytes() != stray
    finally:
        ca.stop()


# -- readiness follows the signing chain -------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_ca_whose_root_expired_is_not_ready_and_says_so_once(tmp_path: Path, workers: str):
    """Before: with `--no-root-rotation`, after the root expired every handshake failed while
    `/ready` still answered 200. Now: 503 with the reason, and one ERROR line per CA process
    (with workers, the supervisor's `/ready` reads the reason from their ready files)."""
    ca = CaProcess(
        tmp_path / "data",
        *("--root-ttl", "5s", "--no-root-rotation", "--ca-reload-interval", "0.5s"),
        *("--workers", workers),
    )
    ca.start()
    try:
        wait_for(lambda: http_status(f"{ca.monitoring_url}/ready") == 503, 20, "/ready 503")
        body = _ready_body(ca)
        assert body.startswith("not ready: the signing chain has expired: ")
        assert "docs/rotate-the-ca.md" in body
        time.sleep(1.5)  # a few more checks: still one line
        lines = [line for line in ca.log().splitlines() if "not ready: " in line]
        assert len(lines) == int(workers), lines
        assert all("ERROR" in line for line in lines)
    finally:
        ca.stop()


def _ready_body(ca: CaProcess) -> str:
    try:
        return http_text(f"{ca.monitoring_url}/ready")
    except Exception as exc:  # urllib raises for 503; its body is the reason
        read = getattr(exc, "read", None)
        assert read is not None, exc
        body: bytes = read()
        return body.decode()


def test_readiness_reports_a_chain_not_valid_yet(caplog: pytest.LogCaptureFixture):
    """A clock behind the one that made the root (unit: the check `/ready` and the watch call)."""
    from ca_server.serving.readiness import SigningReadiness
    from certs import new_self_signed_authority
    from meshca.clock import FakeClock

    made = datetime(2030, 1, 2, tzinfo=UTC)
    authority = new_self_signed_authority(
        KeySpec(), "cluster.local", now=made, lifetime=timedelta(days=1)
    )
    clock = FakeClock(made - timedelta(days=1))
    readiness = SigningReadiness(lambda: authority, clock)
    with caplog.at_level("INFO", logger="ca_server.serving.readiness"):
        first, again = readiness.problem(), readiness.problem()
        clock.advance(timedelta(days=1))
        assert readiness.problem() is None
    assert first == again and first is not None
    assert first.startswith("the signing chain is not valid yet: ") and "check the clock" in first
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "not ready" in errors[0].getMessage()
