"""Every command's flags and environment with bad values, as a careless operator types them:
each ends in exit status 2 (a usage error) or 1 (a runtime one: a port in use) and exactly one
line on stderr naming the flag or address, never a Python traceback, before anything is
written or listens. Real `meshca` processes; a port held by this test stands for "in use"."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import child_env

pytestmark = pytest.mark.process  # every test runs `meshca` with hostile flags

USAGE, RUNTIME = 2, 1
BUSY = "{busy}"  # replaced by a port this test holds (listening)


def _ca(*args: str) -> list[str]:
    return ["ca", "--data-dir", "{dir}/ca", "--workers", "1", "--listen", "127.0.0.1:0",
            "--monitoring-listen", "127.0.0.1:0", *args]  # fmt: skip


def _agent(*args: str) -> list[str]:
    return ["agent", "--ca-root", "{dir}/root.pem", "--token-file", "{dir}/token",
            "--sds-socket", "{dir}/sds.sock", "--status-listen", "127.0.0.1:0", *args]  # fmt: skip


# id -> (argv, environment, exit status, what the one line must name)
CASES: dict[str, tuple[list[str], dict[str, str], int, str]] = {
    # meshca ca
    "ca --listen garbage": (_ca("--listen", "garbage"), {}, USAGE, "--listen 'garbage'"),
    "ca --listen port out of range": (_ca("--listen", "127.0.0.1:99999"), {}, USAGE, "--listen"),
    "ca --listen port in use": (_ca("--listen", f"127.0.0.1:{BUSY}"), {}, RUNTIME, "--listen"),
    "ca --mtls-listen garbage": (_ca("--mtls-listen", "nope"), {}, USAGE, "--mtls-listen"),
    "ca --monitoring-listen garbage": (
        _ca("--monitoring-listen", "garbage"),
        {},
        USAGE,
        "--monitoring-listen",
    ),
    "ca --monitoring-listen port in use": (
        _ca("--monitoring-listen", f"127.0.0.1:{BUSY}"),
        {},
        RUNTIME,
        "--monitoring-listen",
    ),
    "ca --monitoring-listen unknown host": (
        _ca("--monitoring-listen", "no-such-host.invalid:15014"),
        {},
        RUNTIME,
        "--monitoring-listen",
    ),
    "ca --debug-listen port in use": (
        _ca("--debug-listen", f"127.0.0.1:{BUSY}"),
        {},
        RUNTIME,
        "--debug-listen",
    ),
    "ca --debug-listen on the monitoring port": (
        _ca("--monitoring-listen", "127.0.0.1:15914", "--debug-listen", "127.0.0.1:15914"),
        {},
        USAGE,
        "--debug-listen",
    ),
    "ca --rpc-server unknown": (_ca("--rpc-server", "uvloop"), {}, USAGE, "--rpc-server"),
    "ca --workers 2, --listen port in use": (
        [
            "ca",
            "--data-dir",
            "{dir}/ca",
            "--workers",
            "2",
            "--listen",
            f"127.0.0.1:{BUSY}",
            "--monitoring-listen",
            "127.0.0.1:0",
        ],
        {},
        RUNTIME,
        "--listen",
    ),
    "ca --log-level bogus": (_ca("--log-level", "bogus"), {}, USAGE, "--log-level"),
    "ca --root-ttl 0s": (_ca("--root-ttl", "0s"), {}, USAGE, "--root-ttl"),
    "ca --root-ttl forever": (_ca("--root-ttl", "forever"), {}, USAGE, "--root-ttl"),
    "ca --root-key dsa": (_ca("--root-key", "dsa"), {}, USAGE, "--root-key"),
    "ca --trust-domain with a space": (
        _ca("--trust-domain", "my domain"),
        {},
        USAGE,
        "--trust-domain",
    ),
    "ca --serving-host not a name": (
        _ca("--serving-host", "bad host!"),
        {},
        USAGE,
        "--serving-host",
    ),
    "ca --ca-reload-interval 0s": (
        _ca("--ca-reload-interval", "0s"),
        {},
        USAGE,
        "--ca-reload-interval",
    ),
    "ca --workload-cert-ttl 0s": (_ca("--workload-cert-ttl", "0s"), {}, USAGE, "TTL"),
    "ca --max-in-flight-renewals above --max-in-flight": (
        _ca("--max-in-flight", "10", "--max-in-flight-renewals", "20"),
        {},
        USAGE,
        "--max-in-flight-renewals 20",
    ),
    "ca --max-in-flight-reports above the renewals level": (
        _ca(
            "--max-in-flight", "10", "--max-in-flight-renewals", "4", "--max-in-flight-reports", "8"
        ),
        {},
        USAGE,
        "--max-in-flight-reports 8",
    ),
    "ca --max-in-flight-reports above the default renewals level": (
        _ca("--max-in-flight", "10", "--max-in-flight-reports", "6"),
        {},
        USAGE,
        "--max-in-flight-reports 6",
    ),
    "ca --max-in-flight 0": (_ca("--max-in-flight", "0"), {}, USAGE, "--max-in-flight"),
    "ca --activate-at-coverage 2": (
        _ca("--activate-at-coverage", "2"),
        {},
        USAGE,
        "--activate-at-coverage",
    ),
    "ca --data-dir is a file": (_ca("--data-dir", "{dir}/file"), {}, USAGE, "--data-dir"),
    "ca CA_TRUSTED_NODE_ACCOUNTS garbage": (
        _ca("--kubeconfig", "{dir}/kubeconfig"),
        {"CA_TRUSTED_NODE_ACCOUNTS": "a/b/c"},
        USAGE,
        "--trusted-node-accounts",
    ),
    "ca --unknown-flag": (_ca("--no-such-flag"), {}, USAGE, "--no-such-flag"),
    # meshca agent
    "agent --status-listen garbage": (
        _agent("--status-listen", "garbage"),
        {},
        USAGE,
        "--status-listen",
    ),
    "agent --status-listen port out of range": (
        _agent("--status-listen", "127.0.0.1:99999"),
        {},
        USAGE,
        "--status-listen",
    ),
    "agent --status-listen port in use": (
        _agent("--status-listen", f"127.0.0.1:{BUSY}"),
        {},
        RUNTIME,
        "--status-listen",
    ),
    "agent --log-level bogus": (_agent("--log-level", "bogus"), {}, USAGE, "--log-level"),
    "agent --sds-socket-mode 999": (
        _agent("--sds-socket-mode", "999"),
        {},
        USAGE,
        "--sds-socket-mode",
    ),
    "agent --grace-period-ratio x": (
        _agent("--grace-period-ratio", "x"),
        {},
        USAGE,
        "--grace-period-ratio",
    ),
    "agent --report-interval 2h": (
        _agent("--report-interval", "2h"),
        {},
        USAGE,
        "--report-interval",
    ),
    "agent SECRET_TTL forever": (_agent(), {"SECRET_TTL": "forever"}, USAGE, "SECRET_TTL"),
    "agent SECRET_GRACE_PERIOD_RATIO 2": (
        _agent(),
        {"SECRET_GRACE_PERIOD_RATIO": "2"},
        USAGE,
        "SECRET_GRACE_PERIOD_RATIO",
    ),
    "agent ECC_SIGNATURE_ALGORITHM DSA": (
        _agent(),
        {"ECC_SIGNATURE_ALGORITHM": "DSA"},
        USAGE,
        "ECC_SIGNATURE_ALGORITHM",
    ),
    "agent FILE_MOUNTED_CERTS maybe": (
        _agent(),
        {"FILE_MOUNTED_CERTS": "maybe"},
        USAGE,
        "FILE_MOUNTED_CERTS",
    ),
    "agent --sds-socket too long": (
        _agent("--sds-socket", "/tmp/" + "s" * 120),
        {},
        USAGE,
        "--sds-socket",
    ),
    "agent --sds-socket under a file": (
        _agent("--sds-socket", "{dir}/file/sds.sock"),
        {},
        RUNTIME,
        "--sds-socket",
    ),
    "agent --output-dir is a file": (
        _agent("--output-dir", "{dir}/file"),
        {},
        RUNTIME,
        "--output-dir",
    ),
    # meshca up
    "up --status-listen garbage": (
        ["up", "--dir", "{dir}/up", "--status-listen", "x"],
        {},
        USAGE,
        "--status-listen",
    ),
    "up --status-listen port in use": (
        ["up", "--dir", "{dir}/up", "--status-listen", f"127.0.0.1:{BUSY}"],
        {},
        RUNTIME,
        "--status-listen",
    ),
    "up --secret-ttl 0s": (
        ["up", "--dir", "{dir}/up", "--secret-ttl", "0s"],
        {},
        USAGE,
        "--secret-ttl",
    ),
    "up --dir is a file": (["up", "--dir", "{dir}/file"], {}, USAGE, "--dir"),
    # meshca token
    "token --ttl forever": (
        [
            "token",
            "--data-dir",
            "{dir}",
            "--namespace",
            "a",
            "--service-account",
            "b",
            "--ttl",
            "forever",
        ],
        {},
        USAGE,
        "--ttl",
    ),
    "token --ttl 0s": (
        [
            "token",
            "--data-dir",
            "{dir}",
            "--namespace",
            "a",
            "--service-account",
            "b",
            "--ttl",
            "0s",
        ],
        {},
        USAGE,
        "--ttl",
    ),
    "token without --namespace": (
        ["token", "--data-dir", "{dir}", "--service-account", "b"],
        {},
        USAGE,
        "--namespace",
    ),
    # meshca status
    "status --interval 0s": (
        ["status", "--watch", "--interval", "0s", "127.0.0.1:1"],
        {},
        USAGE,
        "--interval",
    ),
    "status --timeout forever": (
        ["status", "--timeout", "forever", "127.0.0.1:1"],
        {},
        USAGE,
        "--timeout",
    ),
    "status --max-response-mib 0": (
        ["status", "--max-response-mib", "0", "127.0.0.1:1"],
        {},
        USAGE,
        "--max-response-mib",
    ),
    "status -o yaml": (["status", "-o", "yaml", "127.0.0.1:1"], {}, USAGE, "--output"),
    "status with nothing listening": (["status", "127.0.0.1:1"], {}, RUNTIME, "cannot reach"),
    # meshca authority
    "authority bad verb": (["authority", "rotate", "--data-dir", "{dir}"], {}, USAGE, "verb"),
    "authority --root-key dsa": (
        ["authority", "prepare", "--data-dir", "{dir}", "--root-key", "dsa"],
        {},
        USAGE,
        "dsa",
    ),
    "authority --root-ttl forever": (
        ["authority", "prepare", "--data-dir", "{dir}", "--root-ttl", "forever"],
        {},
        USAGE,
        "forever",
    ),
    # meshca inspect
    "inspect a directory": (["inspect", "{dir}"], {}, RUNTIME, "{dir}"),
    "inspect no such file": (["inspect", "{dir}/nothing.pem"], {}, RUNTIME, "nothing.pem"),
}


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


@pytest.mark.parametrize(("argv", "env", "status", "names"), CASES.values(), ids=list(CASES))
def test_a_bad_flag_is_one_line_naming_it(
    tmp_path: Path, busy_port: int, argv: list[str], env: dict[str, str], status: int, names: str
) -> None:
    (tmp_path / "file").write_text("not a directory\n")

    def fill(text: str) -> str:
        return text.replace("{dir}", str(tmp_path)).replace(BUSY, str(busy_port))

    result = subprocess.run(
        [sys.executable, "-m", "meshca", *map(fill, argv)],
        env=child_env({k: fill(v) for k, v in env.items()}),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert fill(names) in lines[0], lines[0]
    assert result.returncode == status, result.stderr
    assert not (tmp_path / "ca").exists() and not (tmp_path / "up").exists()  # nothing written
