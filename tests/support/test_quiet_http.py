"""tests/support/quiet_http.py: a client's hang-up prints nothing; any other error still does."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest

from tests.support.quiet_http import QuietThreadingHTTPServer


class _Raising(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/hang-up":
            raise ConnectionResetError(104, "Connection reset by peer")
        raise ValueError("a bug in the double")

    def log_message(self, format: str, *args: object) -> None:
        return


def _get(port: int, path: str) -> None:
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)


@pytest.mark.parametrize(("path", "printed"), [("/hang-up", False), ("/bug", True)])
def test_only_a_hang_up_is_silent(
    path: str, printed: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    server = QuietThreadingHTTPServer(("127.0.0.1", 0), _Raising)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _get(server.server_address[1], path)
    finally:
        server.shutdown()
        server.server_close()  # joins the request's thread: what it printed is in by now
    err = capsys.readouterr().err
    assert ("Traceback" in err) is printed, err
    if printed:
        assert "ValueError: a bug in the double" in err
