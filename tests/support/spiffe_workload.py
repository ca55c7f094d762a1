"""A workload process for node-mode tests: the real py-spiffe client in its own process, so the
node agent sees it under its own pid (`SO_PEERCRED`).

    python -m tests.support.spiffe_workload SOCKET [--try-as SPIFFE_ID] [--private PATH]
                                                   [--hold N]

Prints `ready <pid>` and waits for a line on stdin (the test writes the process's cgroup file
meanwhile), then prints one JSON line per attempt: `{"how": ..., "spiffe_id": ..., "serial":
..., "key_sha256": ...}` or `{"how": ..., "error": CODE, "details": ...}`. Keys are reported
by digest only. `--try-as` adds the attempts a workload could make to get another identity's
SVID: metadata naming it, a request carrying it in a field, the JWT call naming it;
`--private` adds a connection straight to the gRPC server's private socket. `--hold N` instead
opens N `FetchX509SVID` streams, reports each (`{"how": "hold", ...}`), prints `holding` and
keeps them open until stdin closes. `--jwt AUDIENCE` instead fetches a JWT-SVID with py-spiffe
and validates it through the Workload API: `{"how": "jwt", "spiffe_id": ..., "validated": ...,
"token": ...}`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization
from spiffe import WorkloadApiClient, X509Svid
from spiffe._proto import workload_pb2, workload_pb2_grpc

HEADER = ("workload.spiffe.io", "true")


def _svid_facts(how: str, svid: workload_pb2.X509SVID) -> dict[str, Any]:
    leaf = X509Svid.parse_raw(svid.x509_svid, svid.x509_svid_key).leaf
    return {
        "how": how,
        "spiffe_id": svid.spiffe_id,
        "serial": leaf.serial_number,
        "key_sha256": hashlib.sha256(svid.x509_svid_key).hexdigest(),
    }


def _raw(
    how: str, target: str, metadata: tuple[tuple[str, str], ...], body: bytes
) -> dict[str, Any]:
    try:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_stream("/SpiffeWorkloadAPI/FetchX509SVID")(
                body, metadata=metadata, timeout=5
            )
            response = workload_pb2.X509SVIDResponse.FromString(next(iter(call)))
            call.cancel()
    except grpc.RpcError as exc:
        return {"how": how, "error": exc.code().name, "details": exc.details()}
    (svid,) = response.svids
    return _svid_facts(how, svid)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("--try-as")
    parser.add_argument("--private")
    parser.add_argument("--hold", type=int, default=0)
    parser.add_argument("--jwt")
    args = parser.parse_args()
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    if args.hold:  # nothing else first: every stream it held would count against it
        hold(f"unix:{args.socket}", args.hold)
        return 0
    if args.jwt:
        print(json.dumps(jwt_svid(args.socket, args.jwt)), flush=True)
        return 0
    results = []
    try:
        with WorkloadApiClient(f"unix:{args.socket}") as client:
            svid = client.fetch_x509_svid()
        key = svid.private_key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        results.append(
            {
                "how": "py-spiffe",
                "spiffe_id": str(svid.spiffe_id),
                "serial": svid.leaf.serial_number,
                "key_sha256": hashlib.sha256(key).hexdigest(),
            }
        )
    except Exception as exc:  # the client wraps grpc errors: report its text
        results.append({"how": "py-spiffe", "error": type(exc).__name__, "details": str(exc)})
    target = f"unix:{args.socket}"
    if args.try_as:
        other = args.try_as
        for name in ("spiffe-id", "x-spiffe-id", "spiffe_id", "x-forwarded-client-cert"):
            results.append(_raw(f"metadata {name}", target, (HEADER, (name, other)), b""))
        forged = workload_pb2.JWTSVIDRequest(spiffe_id=other).SerializeToString()
        results.append(_raw("request field", target, (HEADER,), forged))
        try:
            with grpc.insecure_channel(target) as channel:
                workload_pb2_grpc.SpiffeWorkloadAPIStub(channel).FetchJWTSVID(
                    workload_pb2.JWTSVIDRequest(audience=["a"], spiffe_id=other),
                    metadata=(HEADER,),
                    timeout=5,
                )
            results.append({"how": "jwt", "error": "OK"})
        except grpc.RpcError as exc:
            results.append({"how": "jwt", "error": exc.code().name, "details": exc.details()})
    if args.private:
        results.append(_raw("private socket", f"unix:{args.private}", (HEADER,), b""))
    for result in results:
        print(json.dumps(result), flush=True)
    return 0


def jwt_svid(socket: str, audience: str) -> dict[str, Any]:
    """py-spiffe's JWT calls: a JWT-SVID for `audience`, validated through the Workload API."""
    try:
        with WorkloadApiClient(f"unix:{socket}") as client:
            svid = client.fetch_jwt_svid({audience})
            checked = client.validate_jwt_svid(svid.token, audience)
    except Exception as exc:  # the client wraps grpc errors: report its text
        return {"how": "jwt", "error": type(exc).__name__, "details": str(exc)}
    return {
        "how": "jwt",
        "spiffe_id": str(svid.spiffe_id),
        "validated": str(checked.spiffe_id),
        "token": svid.token,
    }


def hold(target: str, count: int) -> None:
    channel = grpc.insecure_channel(target)
    stream = channel.unary_stream("/SpiffeWorkloadAPI/FetchX509SVID")
    calls = []
    for _ in range(count):
        call = stream(b"", metadata=(HEADER,), timeout=120)
        try:
            next(iter(call))
            calls.append(call)
            print(json.dumps({"how": "hold", "error": "OK"}), flush=True)
        except grpc.RpcError as exc:
            print(json.dumps({"how": "hold", "error": exc.code().name, "details": exc.details()}))
    print("holding", flush=True)
    sys.stdin.read()
    for call in calls:
        call.cancel()
    channel.close()


if __name__ == "__main__":
    raise SystemExit(main())
