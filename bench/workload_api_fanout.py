"""What one rotation costs the Workload API with many clients: push fan-out, against SDS.

Run: `.venv/bin/python -m bench.workload_api_fanout [--streams 200] [--rotations 5]`

One `SecretCache`, served at once by the agent's real `WorkloadApiServer` and `SdsServer` on
Unix sockets, both on one event loop thread (as in the agent). `--streams` clients stream from
each (grpc.aio on this process's own loop: `FetchX509SVID` with the security header,
`StreamSecrets` for `default`); then each rotation publishes a new leaf into the cache and the
time until every stream holds it is measured. Three variants in one run, alternating, medians:

- `workload-api`: the server as the agent runs it (DER chain + PKCS#8 key computed once per
  leaf version and shared by every stream);
- `workload-api, no memo`: the same with the per-version encoding memo off (every stream
  parses and re-encodes the leaf and key itself): what the memo saves;
- `sds`: Envoy's path for the same cache and clients, the baseline: is serving SPIFFE clients
  dearer than serving Envoys?

Prints ms per rotation (all streams updated) and µs per stream push, each with its ratio to SDS.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from agent.metrics import AgentMetrics
from agent.sds import SECRET_TYPE_URL, SdsServer
from agent.secrets import DEFAULT_RESOURCE, SecretCache
from agent.workload.api import WorkloadApiServer, _Encodings
from certs import load_der_certs
from meshca.clock import SystemClock
from meshca_proto import workload_pb2
from tests.support.loop import LoopThread
from tests.support.pki import TestCa

HEADER = (("workload.spiffe.io", "true"),)


class Tracker:
    """The leaf serial each stream last received; `until(serial)` waits for all of them."""

    def __init__(self, count: int) -> None:
        self.serials = [0] * count
        self.changed = asyncio.Event()

    def got(self, index: int, serial: int) -> None:
        self.serials[index] = serial
        self.changed.set()

    async def until(self, serial: int) -> None:
        while any(s != serial for s in self.serials):
            self.changed.clear()
            await self.changed.wait()


async def follow_workload_api(socket: Path, index: int, tracker: Tracker) -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        call = channel.unary_stream(
            "/SpiffeWorkloadAPI/FetchX509SVID",
            request_serializer=workload_pb2.X509SVIDRequest.SerializeToString,
            response_deserializer=workload_pb2.X509SVIDResponse.FromString,
        )(workload_pb2.X509SVIDRequest(), metadata=HEADER)
        async for response in call:
            leaf = load_der_certs(response.svids[0].x509_svid)[0]
            tracker.got(index, leaf.serial_number)


async def follow_sds(socket: Path, index: int, tracker: Tracker) -> None:
    from envoy.extensions.transport_sockets.tls.v3 import secret_pb2

    from certs import load_cert

    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        call = channel.stream_stream(
            "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets",
            request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
            response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
        )()
        await call.write(
            discovery_pb2.DiscoveryRequest(
                node=base_pb2.Node(id=f"bench-{index}"),
                resource_names=[DEFAULT_RESOURCE],
                type_url=SECRET_TYPE_URL,
            )
        )
        async for response in call:
            secret = secret_pb2.Secret()
            response.resources[0].Unpack(secret)
            chain = secret.tls_certificate.certificate_chain.inline_bytes
            tracker.got(index, load_cert(chain).serial_number)
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    node=base_pb2.Node(id=f"bench-{index}"),
                    resource_names=[DEFAULT_RESOURCE],
                    type_url=SECRET_TYPE_URL,
                    response_nonce=response.nonce,
                    version_info=response.version_info,
                )
            )


async def measure(
    server_loop: LoopThread,
    cache: SecretCache,
    follow: Callable[[Path, int, Tracker], Coroutine[Any, Any, None]],
    socket: Path,
    streams: int,
    rotations: int,
    ca: TestCa,
) -> list[float]:
    tracker = Tracker(streams)
    current = cache.get(DEFAULT_RESOURCE)
    assert current is not None
    tasks = [asyncio.create_task(follow(socket, i, tracker)) for i in range(streams)]
    try:
        first = ca.issue("bench")
        server_loop.run(cache.publish(first.tls_secret()))
        await asyncio.wait_for(tracker.until(first.serial), 120)
        times = []
        for _ in range(rotations):
            leaf = ca.issue("bench")
            started = time.perf_counter()
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(cache.publish(leaf.tls_secret()), server_loop.loop)
            )
            await asyncio.wait_for(tracker.until(leaf.serial), 120)
            times.append(time.perf_counter() - started)
        return times
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run(directory: Path, streams: int, rotations: int, rounds: int) -> None:
    ca = TestCa()
    cache = SecretCache()
    with LoopThread() as loop:
        loop.run(cache.publish(ca.root_secret()))
        loop.run(cache.publish(ca.issue("bench").tls_secret()))
        wapi = WorkloadApiServer(cache, directory / "wapi.sock", trust_domain="cluster.local",
                                 metrics=AgentMetrics(SystemClock()),
                                 max_streams=streams + 10)  # fmt: skip
        sds = SdsServer(cache, directory / "sds.sock")
        loop.run(wapi.start())
        loop.run(sds.start())
        try:
            results: dict[str, list[float]] = {"workload-api": [], "workload-api, no memo": [],
                                               "sds": []}  # fmt: skip
            for _ in range(rounds):  # alternate, so drift hits every variant alike
                wapi.encodings = _Encodings()
                results["workload-api"] += await measure(
                    loop, cache, follow_workload_api, wapi.socket_path, streams, rotations, ca
                )
                wapi.encodings = _Encodings(limit=0)
                results["workload-api, no memo"] += await measure(
                    loop, cache, follow_workload_api, wapi.socket_path, streams, rotations, ca
                )
                results["sds"] += await measure(
                    loop, cache, follow_sds, sds.socket_path, streams, rotations, ca
                )
        finally:
            loop.run(wapi.stop(0.5))
            loop.run(sds.stop(0.5))
    baseline = statistics.median(results["sds"])
    print(f"{streams} streams, {rotations * rounds} rotations per variant (medians)")
    print(f"{'variant':<24}{'ms/rotation':>12}{'µs/stream':>11}{'÷ sds':>8}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<24}{median * 1e3:>12.1f}{median / streams * 1e6:>11.0f}"
              f"{median / baseline:>8.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--rotations", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wfan", dir="/tmp") as directory:
        asyncio.run(run(Path(directory), args.streams, args.rotations, args.rounds))


if __name__ == "__main__":
    main()
