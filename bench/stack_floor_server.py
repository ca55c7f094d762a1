"""A gRPC server on meshca's stack that does only the least a CA must, for `bench/stack_ceiling.py`.

Run by the bench, not by hand:
`python -m bench.stack_floor_server --port P --handler noop|sign|sign-builder --rpc aio|sync|cq
--cert C --key K --root R --root-key RK --counters FILE --slot N`

It serves `istio.v1.auth.IstioCertificateService/CreateCertificate` with meshca's TLS,
`SO_REUSEPORT` (so several copies share one port as meshca's workers do) and meshca's default
`--cpu-scheduling batch`, on one of three RPC layers (`--rpc`), all on grpcio:
- `aio`: `grpc.aio`'s server, an `async def` handler (what meshca used until issue 20);
- `sync`: the synchronous `grpc.server` with a pool of 4 threads, a plain handler;
- `cq`: meshca's own `ca_server.serving.cq_server` (one thread polling grpcio's completion
  queue, the `async def` handler driven inline: what `meshca ca` uses now);
and one of three handlers:
- `noop`: answers a response of a real certificate chain's size, built once. What one RPC
  costs on this layer with nothing done: the ceiling for any handler.
- `sign`: decodes the request, reads and verifies the CSR (`certs.load_verified_csr`, the key
  loaded once, as the CA reads it), signs the leaf
  from the DER template (`SigningAuthority.leaf_template`, the CA's signer), encodes the PEM
  chain. What a CA that checks nothing else (no authentication, no identity check, no audit,
  no metrics) costs: the ceiling for meshca.
- `sign-builder`: the same with the leaf built by `CertificateBuilder` (the floor before the
  DER template).

Each answered request is counted in the process's own 8-byte slot of a shared file, so the
bench counts successes on the server side, as it does for meshca.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import mmap
import struct
import threading
from collections.abc import Callable
from concurrent import futures
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from ca_server.serving.cpu_scheduling import apply_cpu_scheduling
from ca_server.serving.cq_server import CompletionQueueServer
from certs import (
    PublicKey,
    SpiffeId,
    build_workload_certificate,
    cert_to_pem,
    load_csr,
    load_verified_csr,
    make_authority,
    public_key_of,
)
from meshca_proto import ca_pb2

SERVICE = "istio.v1.auth.IstioCertificateService"
IDENTITY = SpiffeId("cluster.local", "default", "bench")
LEAF_LIFETIME = timedelta(hours=1)
COUNTER = struct.Struct("<Q")


class Counter:
    """This process's count of answered requests, in its slot of the shared counters file."""

    def __init__(self, path: Path, slot: int) -> None:
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._offset = slot * COUNTER.size
        self._count = 0

    def add(self) -> None:
        self._count += 1
        COUNTER.pack_into(self._map, self._offset, self._count)


def read_counters(path: Path) -> int:
    """The sum of every process's count (the bench's side)."""
    data = path.read_bytes()
    return sum(value for (value,) in COUNTER.iter_unpack(data))


def build_handler(args: argparse.Namespace, counter: Counter) -> Callable[[bytes], bytes]:
    """The handler's work on the request's bytes: the serialized response."""
    root = x509.load_pem_x509_certificate(args.root.read_bytes())
    root_key = load_pem_private_key(args.root_key.read_bytes(), None)
    root_pem = cert_to_pem(root)
    template = make_authority(root, root_key, [], [root]).leaf_template  # type: ignore[arg-type]

    def sign_builder(data: bytes) -> bytes:
        request = ca_pb2.IstioCertificateRequest.FromString(data)
        csr = load_csr(request.csr)
        now = datetime.now(UTC)
        leaf = build_workload_certificate(
            public_key_of(csr),
            IDENTITY,
            root,
            root_key,  # type: ignore[arg-type]
            not_before=now,
            not_after=now + LEAF_LIFETIME,
        )
        chain = [cert_to_pem(leaf), root_pem]
        return ca_pb2.IstioCertificateResponse(cert_chain=chain).SerializeToString()

    def sign(data: bytes) -> bytes:
        request = ca_pb2.IstioCertificateRequest.FromString(data)
        csr, key = load_verified_csr(request.csr)
        now = datetime.now(UTC)
        der = template.sign(
            cast(PublicKey, key),  # the template refuses any key but EC or RSA
            IDENTITY,
            not_before=now,
            not_after=now + LEAF_LIFETIME,
            csr=csr,
        )
        chain = [der_to_pem(der), root_pem]
        return ca_pb2.IstioCertificateResponse(cert_chain=chain).SerializeToString()

    # The noop answer is a real chain, so every handler sends the same number of bytes.
    sample = ca_pb2.IstioCertificateRequest(csr=args.sample_csr.read_text()).SerializeToString()
    canned = sign(sample)
    work = {"noop": lambda data: canned, "sign": sign, "sign-builder": sign_builder}[args.handler]

    def handle(data: bytes) -> bytes:
        response = work(data)
        counter.add()
        return response

    return handle


def der_to_pem(der: bytes) -> str:
    body = base64.encodebytes(der).decode().replace("\n", "")
    lines = "\n".join(body[i : i + 64] for i in range(0, len(body), 64))
    return f"-----BEGIN CERTIFICATE-----\n{lines}\n-----END CERTIFICATE-----\n"


async def serve_async(args: argparse.Namespace, handle: Callable[[bytes], bytes]) -> None:
    """`aio` or `cq`: an `async def` handler, as meshca's servicers are."""

    async def method(request: bytes, context: object) -> bytes:
        return handle(request)

    options = [("grpc.so_reuseport", 1)]
    server: grpc.aio.Server
    if args.rpc == "cq":
        server = CompletionQueueServer(options, asyncio.get_running_loop())
    else:
        server = grpc.aio.server(options=options)
    add_method(server, grpc.unary_unary_rpc_method_handler(method))
    server.add_secure_port(f"127.0.0.1:{args.port}", credentials(args))
    await server.start()
    args.ready.write_text("ready\n")
    await server.wait_for_termination()


def serve_sync(args: argparse.Namespace, handle: Callable[[bytes], bytes]) -> None:
    """`sync`: `grpc.server` with a pool of 4 threads."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 1)]
    )
    add_method(
        server, grpc.unary_unary_rpc_method_handler(lambda request, context: handle(request))
    )
    server.add_secure_port(f"127.0.0.1:{args.port}", credentials(args))
    server.start()
    args.ready.write_text("ready\n")
    threading.Event().wait()


def add_method(server: grpc.Server | grpc.aio.Server, method: grpc.RpcMethodHandler) -> None:
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"CreateCertificate": method})]
    )


def credentials(args: argparse.Namespace) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(args.key.read_bytes(), args.cert.read_bytes())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--handler", choices=["noop", "sign", "sign-builder"], required=True)
    parser.add_argument("--rpc", choices=["aio", "sync", "cq"], default="aio")
    parser.add_argument("--cert", type=Path, required=True, help="serving certificate (PEM)")
    parser.add_argument("--key", type=Path, required=True, help="its key (PEM)")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--root-key", type=Path, required=True)
    parser.add_argument("--sample-csr", type=Path, required=True)
    parser.add_argument("--counters", type=Path, required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--ready", type=Path, required=True, help="written once serving")
    args = parser.parse_args()
    apply_cpu_scheduling("batch")  # as `meshca ca` does, before gRPC starts its threads
    handle = build_handler(args, Counter(args.counters, args.slot))
    if args.rpc == "sync":
        serve_sync(args, handle)
    else:
        asyncio.run(serve_async(args, handle))


if __name__ == "__main__":
    main()
