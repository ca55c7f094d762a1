"""Run the fake API server as its own process (for tests that need process isolation).

    python -m tests.support.kube_api --port 0 --port-file /tmp/port [--tokens-file tokens.json]

The port file is written atomically once the server is accepting connections, so a parent can
poll for it. SIGTERM/SIGINT stop the server cleanly (exit status 0). Tokens and objects can also
be added at runtime via ``POST /_test/tokens`` and ``POST /_test/objects``; request counts are at
``GET /_test/counts``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from .server import KubeApiServer


def _load_tokens(server: KubeApiServer, path: Path) -> None:
    """Each entry is ``{"token", "username", ...}`` or ``{"token", "namespace",
    "serviceAccount", "podName"?, "podUid"?, "audiences"?}``."""
    entries: list[dict[str, Any]] = json.loads(path.read_text())
    for entry in entries:
        if "serviceAccount" in entry:
            server.add_service_account_token(
                entry["token"],
                entry["namespace"],
                entry["serviceAccount"],
                audiences=entry.get("audiences"),
                pod_name=entry.get("podName"),
                pod_uid=entry.get("podUid"),
            )
        else:
            server.add_token(
                entry["token"],
                entry["username"],
                uid=entry.get("uid", ""),
                groups=entry.get("groups", ()),
                extra=entry.get("extra"),
                audiences=entry.get("audiences"),
            )


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.kube_api", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks an ephemeral port")
    parser.add_argument("--port-file", type=Path, help="write the bound port here when ready")
    parser.add_argument("--kubeconfig", type=Path, help="also write a kubeconfig here when ready")
    parser.add_argument("--auth-token", help="require this bearer token on API requests")
    parser.add_argument("--tokens-file", type=Path, help="JSON list of TokenReview tokens")
    parser.add_argument("--seed-file", type=Path, help="JSON list of objects to create (by kind)")
    parser.add_argument("--watch-timeout", type=float, default=60.0)
    parser.add_argument("--history-limit", type=int, default=1000)
    args = parser.parse_args(argv)

    server = KubeApiServer(
        args.host,
        args.port,
        auth_token=args.auth_token,
        watch_timeout=args.watch_timeout,
        history_limit=args.history_limit,
    )
    if args.tokens_file:
        _load_tokens(server, args.tokens_file)
    if args.seed_file:
        for obj in json.loads(args.seed_file.read_text()):
            server.create(str(obj["kind"]), obj)

    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    try:
        if args.kubeconfig:
            server.write_kubeconfig(args.kubeconfig)
        if args.port_file:
            _write_atomically(args.port_file, f"{server.port}\n")
        print(f"fake kube-apiserver listening on {server.url}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
