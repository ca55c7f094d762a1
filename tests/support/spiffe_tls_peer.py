"""Two ends of an mTLS connection on py-spiffe's `X509Source` (the client dials with
`spiffe-tls`; the server builds a pyOpenSSL context per connection, see `server_context`), each
taking its identity from the agent Workload API socket it is given, each checking the other's
SPIFFE ID (`authorize_id`). For `tests/e2e/test_workload_api_tls.py`.

    python -m tests.support.spiffe_tls_peer serve SOCKET HOST:PORT PEER_ID
    python -m tests.support.spiffe_tls_peer dial SOCKET HOST:PORT PEER_ID SECONDS

`serve` prints `listening`, then answers each connection with one JSON line naming the
client certificate it saw. `dial` connects every 0.2 s for SECONDS, printing one JSON line per
connection (the server's serial as seen in the handshake, the server's answer, or the error).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

from OpenSSL import SSL, crypto
from spiffe import SpiffeId, WorkloadApiClient, X509Source
from spiffetls import dial
from spiffetls.tlsconfig.authorize import authorize_id


def _source(socket_path: str) -> X509Source:
    return X509Source(WorkloadApiClient(f"unix:{socket_path}"))


def server_context(source: X509Source, peer_id: str) -> SSL.Context:
    """A server context holding the source's CURRENT SVID and bundle, requiring a client
    certificate with `peer_id`. spiffe-tls's own `listen()` builds one context and mutates it on
    each rotation, which pyOpenSSL 26 (the range spiffe-tls 0.4.0 requires) forbids once the
    context has served a connection ("Context has already been used..."), so its listener
    keeps the first SVID; a context per connection is what rotation needs."""
    context = SSL.Context(SSL.TLS_SERVER_METHOD)
    svid = source.svid
    context.use_certificate(crypto.X509.from_cryptography(svid.leaf))
    context.use_privatekey(crypto.PKey.from_cryptography_key(svid.private_key))  # type: ignore[arg-type]
    for intermediate in svid.cert_chain[1:]:
        context.add_extra_chain_cert(crypto.X509.from_cryptography(intermediate))
    store = context.get_cert_store()
    assert store is not None
    for bundle in source.bundles:
        for authority in bundle.x509_authorities:
            store.add_cert(crypto.X509.from_cryptography(authority))
    authorize = authorize_id(SpiffeId(peer_id))

    def verify(_: SSL.Connection, cert: crypto.X509, errno: int, depth: int, ok: int) -> bool:
        return bool(ok) and (depth != 0 or authorize(cert))

    context.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, verify)
    return context


def serve(socket_path: str, address: str, peer_id: str) -> None:
    source = _source(socket_path)
    host, port = address.split(":")
    listener = socket.create_server((host, int(port)))
    print("listening", flush=True)
    while True:
        raw, _ = listener.accept()
        connection = SSL.Connection(server_context(source, peer_id), raw)
        connection.set_accept_state()
        try:
            connection.do_handshake()
            peer = connection.get_peer_certificate()
            answer = {
                "client_serial": peer.get_serial_number() if peer is not None else None,
                "server_serial": source.svid.leaf.serial_number,
            }
            connection.recv(64)
            connection.sendall(json.dumps(answer).encode() + b"\n")
            connection.shutdown()
        except SSL.Error as exc:
            print(json.dumps({"refused": str(exc)}), flush=True)
        finally:
            connection.close()


def dial_for(socket_path: str, address: str, peer_id: str, seconds: float) -> None:
    source = _source(socket_path)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result: dict[str, Any] = {"client_serial": source.svid.leaf.serial_number}
        try:
            connection = dial(address, source, authorize_fn=authorize_id(SpiffeId(peer_id)))
            try:
                peer = connection.get_peer_certificate()
                result["seen_server_serial"] = peer.get_serial_number() if peer else None
                connection.sendall(b"hello\n")
                result["answer"] = json.loads(connection.recv(4096).decode())
            finally:
                connection.close()
        except Exception as exc:  # report any failure: the test counts them
            result["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(result), flush=True)
        time.sleep(0.2)
    source.close()


def main(argv: list[str]) -> int:
    command, socket_path, address, peer_id, *rest = argv
    if command == "serve":
        serve(socket_path, address, peer_id)
    else:
        dial_for(socket_path, address, peer_id, float(rest[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
