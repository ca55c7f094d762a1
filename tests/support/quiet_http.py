"""A threaded HTTP server for test doubles that does not print a client's hang-up.

Why: `socketserver` prints a traceback to stderr for every exception a request raises, and a
client that drops its connection mid-request (a CA process stopped by its test, an injected
fault cutting a watch) raises `ConnectionResetError` or `BrokenPipeError` in the handler
thread. pytest cannot capture a thread that outlives its test, so those tracebacks landed in
the suite's output as if something had failed. Anything else is still printed.
"""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer
from typing import Any


class QuietThreadingHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)
