"""`meshca status` pointed at something that is not a meshca daemon: a garbage HTTP server on
loopback (real sockets, tests/hostile/garbage_http.py) in each of its modes. Every mode ends in
exit status 1 and exactly one line on stderr, "ADDRESS did not answer like a meshca agent or
CA: ...", never a traceback; a slow drip is cut at `--timeout`; a 512 MiB body is refused at
the size cap with the command's peak RSS (VmHWM, read from /proc by the command's own process)
under 100 MiB; a redirect is reported and never followed; `--watch` keeps going."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hostile import garbage_http as g
from tests.support.processes import child_env, stop_child

pytestmark = pytest.mark.process  # every test runs `meshca status`

UNLIKE = "did not answer like a meshca agent or CA"
MiB = 1024 * 1024

# Runs `meshca status ARGS` as the installed command does (`meshca.cli.main`), then writes its
# own peak RSS from /proc/self/status to the file named by $VMHWM_FILE.
_MEASURED = textwrap.dedent(
    """
    import os, sys
    from meshca.cli import main
    try:
        status = main(sys.argv[1:])
    finally:
        with open("/proc/self/status") as proc, open(os.environ["VMHWM_FILE"], "w") as out:
            out.write(next(line for line in proc if line.startswith("VmHWM:")))
    sys.exit(status)
    """
)

CA_DOCUMENT = {"kind": "ca", "started": "2026-01-01T00:00:00+00:00", "now": "x"}
NOT_FOUND = g.not_found()

MODES: dict[str, tuple[g.Mode, str]] = {
    "bad JSON": (g.answer("200 OK", "application/json", b'{"kind": "agent", '), "is not JSON"),
    "JSON too deep to parse": (
        g.answer("200 OK", "application/json", b"[" * 200_000),
        "is not JSON",
    ),
    "JSON of the wrong shape": (g.json_answer([1, 2, 3]), "not a meshca document"),
    "an agent document with mangled entries": (
        g.json_answer({"kind": "agent", "secrets": [{"resource_name": 7}]}),
        "lacks or mangles",
    ),
    "a CA document missing its fields": (
        g.per_path(
            {
                "/debug/ca": g.json_answer(CA_DOCUMENT),
                "/metrics": g.answer("200 OK", "text/plain", b"meshca_ca_requests_in_flight 1\n"),
            },
            NOT_FOUND,
        ),
        "lacks or mangles",
    ),
    "metrics that are not Prometheus text": (
        g.per_path(
            {
                "/debug/ca": g.json_answer(CA_DOCUMENT),
                "/metrics": g.answer("200 OK", "text/plain", b"\xff\xfe{{{ not metrics\n"),
            },
            NOT_FOUND,
        ),
        "/metrics is not Prometheus text",
    ),
    "BadStatusLine": (g.raw(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), "not HTTP"),
    "connection reset": (g.reset(), "reset the connection"),
    "empty reply": (g.silent_close(), "closed the connection without answering"),
    "an HTML page": (
        g.answer("200 OK", "text/html", b"<html><body>Welcome to nginx!</body></html>"),
        "is text/html, not application/json",
    ),
    "JSON with the wrong content type": (
        g.json_answer({"kind": "agent", "secrets": []}, content_type="text/plain"),
        "is text/plain, not application/json",
    ),
    "a header bomb": (
        g.raw(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 1000 + b"\r\n"),
        "more than 100 headers",
    ),
    "a header line of 1 MiB": (
        g.raw(b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * MiB + b"\r\n\r\n"),
        "header line longer than 64 KiB",
    ),
    "a body cut short": (
        g.raw(g._head("200 OK", "application/json", 1000) + b'{"kind": "agent"'),
        "in the middle of its answer",
    ),
    "a Content-Length of 512 MiB": (
        g.raw(g._head("200 OK", "application/json", 512 * MiB)),
        "announced a body of 536870912 bytes",
    ),
    "a monitoring port (no /debug documents)": (NOT_FOUND, "HTTP 404"),
}


def _status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshca", "status", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line(result: subprocess.CompletedProcess[str], address: str, fragment: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.returncode == 1, result.stderr
    assert lines[0].startswith(f"meshca status: http://{address} {UNLIKE}: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


@pytest.mark.parametrize(("mode", "fragment"), MODES.values(), ids=list(MODES))
def test_garbage_is_one_line_never_a_traceback(mode: g.Mode, fragment: str) -> None:
    with g.garbage_server(mode) as server:
        result = _status(server.address)
    _one_line(result, server.address, fragment)


def test_a_redirect_is_reported_and_not_followed() -> None:
    with g.garbage_server(g.json_answer({"kind": "agent", "secrets": []})) as elsewhere:
        redirect = g.answer(
            "302 Found", "text/plain", b"", f"Location: http://{elsewhere.address}/"
        )
        with g.garbage_server(redirect) as server:
            result = _status(server.address)
        line = _one_line(result, server.address, f"a redirect to http://{elsewhere.address}/")
        assert "does not follow" in line
        assert elsewhere.connections == 0  # the other address was never asked


@pytest.mark.parametrize(
    "mode",
    [
        g.drip(g._head("200 OK", "application/json", 10_000)),
        g.drip_head(),
    ],
    ids=["body", "head"],
)
def test_a_slow_drip_is_cut_at_the_timeout(mode: g.Mode) -> None:
    """A byte every 0.2 s passes every per-read timeout; the deadline (`--timeout`, 5 s by
    default) still ends it. Without one, the command never returns and `subprocess.run` gives
    up after 30 s."""
    with g.garbage_server(mode) as server:
        result = _status(server.address, timeout=30)
    _one_line(result, server.address, "no complete answer within 5s")


def test_the_timeout_flag_sets_the_deadline() -> None:
    with g.garbage_server(g.drip_head()) as server:
        result = _status("--timeout", "1s", server.address, timeout=30)
    _one_line(result, server.address, "no complete answer within 1s")


def test_a_512_mib_body_is_refused_at_the_cap_in_bounded_memory(tmp_path: Path) -> None:
    """The body has no Content-Length: the command must stream it and stop at the cap. Its peak
    RSS is VmHWM from its own /proc/self/status, written just before it exits."""
    peak_file = tmp_path / "vmhwm"
    with g.garbage_server(g.endless_body(512 * MiB)) as server:
        result = subprocess.run(
            [sys.executable, "-c", _MEASURED, "status", server.address],
            env=child_env({"VMHWM_FILE": str(peak_file)}),
            capture_output=True,
            text=True,
            timeout=120,
        )
    field, value, unit = peak_file.read_text().split()
    assert (field, unit) == ("VmHWM:", "kB")
    assert int(value) * 1024 < 100 * MiB, f"peak RSS {int(value) // 1024} MiB"
    print(f"meshca status peak RSS against a 512 MiB body: {int(value) // 1024} MiB")
    _one_line(result, server.address, "sent a longer body, more than the 16 MiB")


def test_watch_keeps_going_after_a_bad_round_and_says_so() -> None:
    with g.garbage_server(g.answer("200 OK", "application/json", b"{oops")) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshca", "status", "--watch", "--interval", "100ms",
             server.address],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            seen = b""
            while seen.count(b"(retrying)") < 3:
                ready, _, _ = select.select([proc.stdout], [], [], 20)
                assert ready, f"no new round within 20 s; output so far: {seen!r}"
                chunk = os.read(proc.stdout.fileno(), 65536)
                assert chunk, f"the command stopped: {seen!r}"
                seen += chunk
        finally:
            status = stop_child(proc, signal.SIGINT)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert status == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert f"{UNLIKE}: /debug/secrets is not JSON".encode() in seen
    assert server.connections >= 3
