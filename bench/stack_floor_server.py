"""A gRPC server on meshca's stack that does only the least a CA must, for `bench/stack_ceiling.py`.

Run by the bench, not by hand:
`python -m bench.stack_floor_server --port P --handler noop|sign --cert C --key K --root R
--root-key RK --counters FILE --slot N`

It serves `istio.v1.auth.IstioCertificateService/CreateCertificate` with what meshca uses
(`grpc.aio`, the same TLS, `SO_REUSEPORT` so several copies share one port as meshca's workers
do, meshca's default `--cpu-scheduling batch`) and one of two handlers:
- `noop`: answers a response of a real certificate chain's size, built once. What one RPC
  costs on this stack with nothing done: the ceiling for any handler.
- `sign`: decodes the request, parses and verifies the CSR, builds and signs the leaf, encodes
  the PEM chain (`certs`, as meshca does). What a CA that checks nothing else (no
  authentication, no identity check, no audit, no metrics) costs on this stack: the ceiling
  for meshca.

Each answered request is counted in the process's own 8-byte slot of a shared file, so the
bench counts successes on the server side, as it does for meshca.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import struct
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from ca_server.serving.cpu_scheduling import apply_cpu_scheduling
from certs import (
    SpiffeId,
    build_workload_certificate,
    cert_to_pem,
    load_csr,
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


async def serve(args: argparse.Namespace) -> None:
    root = x509.load_pem_x509_certificate(args.root.read_bytes())
    root_key = load_pem_private_key(args.root_key.read_bytes(), None)
    root_pem = cert_to_pem(root)
    counter = Counter(args.counters, args.slot)

    def sign(request: ca_pb2.IstioCertificateRequest) -> ca_pb2.IstioCertificateResponse:
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
        return ca_pb2.IstioCertificateResponse(cert_chain=[cert_to_pem(leaf), root_pem])

    # The noop answer is a real chain, so both handlers send the same number of bytes.
    sample_csr = ca_pb2.IstioCertificateRequest(csr=args.sample_csr.read_text())
    canned = sign(sample_csr).SerializeToString()

    async def noop(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        counter.add()
        return canned

    async def signing(
        request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        response = sign(request)
        counter.add()
        return response

    if args.handler == "noop":
        method = grpc.unary_unary_rpc_method_handler(noop)
    else:
        method = grpc.unary_unary_rpc_method_handler(
            signing,
            request_deserializer=ca_pb2.IstioCertificateRequest.FromString,
            response_serializer=ca_pb2.IstioCertificateResponse.SerializeToString,
        )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"CreateCertificate": method})]
    )
    credentials = grpc.ssl_server_credentials([(args.key.read_bytes(), args.cert.read_bytes())])
    server.add_secure_port(f"127.0.0.1:{args.port}", credentials)
    await server.start()
    args.ready.write_text("ready\n")
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--handler", choices=["noop", "sign"], required=True)
    parser.add_argument("--cert", type=Path, required=True, help="serving certificate (PEM)")
    parser.add_argument("--key", type=Path, required=True, help="its key (PEM)")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--root-key", type=Path, required=True)
    parser.add_argument("--sample-csr", type=Path, required=True)
    parser.add_argument("--counters", type=Path, required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--ready", type=Path, required=True, help="written once serving")
    apply_cpu_scheduling("batch")  # as `meshca ca` does, before gRPC starts its threads
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
