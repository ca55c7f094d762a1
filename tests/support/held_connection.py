"""A Workload API connection made by a process that then exits, held and used by the test: the
pid-reuse attack on node-mode attestation (`agent.workload.peer_process`), with real processes.

    python -m tests.support.held_connection SOCKET FD

(the child side) connects to SOCKET, so the kernel's peer credentials of that connection name
this process; hands the connection to its parent over the Unix socket FD (`SCM_RIGHTS`);
prints `connected <pid>`; and exits when a line arrives on stdin. The parent side:
`hand_over_connection` starts the child and returns it with its pid and the connection;
`channel_over` makes a gRPC channel whose bytes travel over that connection, and
`fetch_x509_svid` asks it for an SVID the way every client does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from spiffe._proto import workload_pb2

from tests.support.processes import child_env


@dataclass
class HandedOver:
    """The child that connected (still running until `let_exit`), its pid, and its connection."""

    child: subprocess.Popen[str]
    pid: int
    connection: socket.socket

    def let_exit(self) -> None:
        """Lets the child exit and reaps it: its pid is free for any new process."""
        assert self.child.stdin is not None
        self.child.stdin.write("exit\n")
        self.child.stdin.flush()
        assert self.child.wait(10) == 0

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.kill()
        self.child.wait(10)
        self.connection.close()


def hand_over_connection(socket_path: Path) -> HandedOver:
    """A child process connects to `socket_path` and hands the connection to this process."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(socket_path), str(theirs.fileno())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            text=True,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        ours.settimeout(30)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    assert child.stdout is not None
    word, pid = child.stdout.readline().split()
    assert word == "connected" and len(fds) == 1
    return HandedOver(child, int(pid), socket.socket(fileno=fds[0]))


def _copy(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(64 * 1024):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def channel_over(connection: socket.socket) -> Iterator[grpc.Channel]:
    """A gRPC channel to whatever is at the other end of `connection` (grpc cannot be handed a
    connected socket, so it connects to a private abstract socket bridged to this one)."""
    name = f"meshca-held-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    threads: list[threading.Thread] = []

    def bridge() -> None:
        with contextlib.suppress(OSError):
            client, _ = listener.accept()
            back = threading.Thread(target=_copy, args=(connection, client), daemon=True)
            threads.append(back)
            back.start()
            _copy(client, connection)
            back.join(10)
            client.close()

    there = threading.Thread(target=bridge, daemon=True)
    there.start()
    try:
        with grpc.insecure_channel(f"unix-abstract:{name}") as channel:
            yield channel
    finally:
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_RDWR)
        listener.close()
        there.join(10)


def fetch_x509_svid(channel: grpc.Channel) -> dict[str, Any]:
    """The first `FetchX509SVID` answer on `channel`: `{"spiffe_id": ...}` or `{"error": CODE,
    "details": ...}`."""
    call = channel.unary_stream("/SpiffeWorkloadAPI/FetchX509SVID")(
        workload_pb2.X509SVIDRequest().SerializeToString(),
        metadata=(("workload.spiffe.io", "true"),),
        timeout=10,
    )
    try:
        response = workload_pb2.X509SVIDResponse.FromString(next(iter(call)))
    except grpc.RpcError as exc:
        return {"error": exc.code().name, "details": exc.details()}
    finally:
        call.cancel()
    return {"spiffe_id": [svid.spiffe_id for svid in response.svids]}


def main() -> int:
    socket_path, fd = sys.argv[1], int(sys.argv[2])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(socket_path)
        with socket.socket(fileno=fd) as parent:
            socket.send_fds(parent, [b"c"], [connection.fileno()])
        print(f"connected {os.getpid()}", flush=True)
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
