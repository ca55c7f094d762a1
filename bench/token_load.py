"""CreateCertificate at a fixed concurrency, one bearer token per request, for the benchmarks.

Why several channels: `meshca ca --workers N` shares its port with `SO_REUSEPORT`, and the
kernel spreads *connections*, so one channel would reach one worker. Each channel here has its
own subchannel pool (its own TCP connection), the channels stay open across rounds, and request
`i` always goes over channel `i % channels`: sending the same list twice sends each token to
the same worker both times, so the second round meets that worker's verified-token cache, as
an agent renewing does.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from certs import SpiffeId, build_csr, generate_private_key
from meshca_proto import ca_pb2, ca_pb2_grpc


@dataclass(frozen=True)
class Call:
    token: str
    csr: str


@dataclass(frozen=True)
class LoadResult:
    sent: int
    seconds: float
    failures: Counter[str]

    @property
    def rate(self) -> float:
        ok = self.sent - sum(self.failures.values())
        return ok / self.seconds if self.seconds > 0 else 0.0


class CsrBook:
    """One CSR per identity (a key pair and a signature cost ~1 ms; identities repeat)."""

    def __init__(self, trust_domain: str = "cluster.local") -> None:
        self._trust_domain = trust_domain
        self._csrs: dict[tuple[str, str], str] = {}

    def csr(self, namespace: str, account: str) -> str:
        key = (namespace, account)
        if key not in self._csrs:
            identity = SpiffeId(self._trust_domain, namespace, account)
            self._csrs[key] = build_csr(generate_private_key(), identity)
        return self._csrs[key]


class CertificateLoad:
    """`channels` connections to the CA kept open across rounds: `send(calls)` once per round.

    The connections must outlive a round: a reconnect may land on another worker, whose
    token cache has never seen the token (a "cached" round that is not)."""

    def __init__(
        self, addr: str, root_pem: bytes, concurrency: int = 32, channels: int = 8
    ) -> None:
        self._addr = addr
        self._root_pem = root_pem
        self._concurrency = concurrency
        self._count = channels
        self._runner = asyncio.Runner()
        self._channels: list[grpc.aio.Channel] = []

    def __enter__(self) -> CertificateLoad:
        self._runner.run(self._open())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._runner.run(self._close())
        finally:
            self._runner.close()

    async def _open(self) -> None:
        credentials = grpc.ssl_channel_credentials(self._root_pem)
        options = [
            ("grpc.ssl_target_name_override", "localhost"),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._channels = [
            grpc.aio.secure_channel(self._addr, credentials, options=options)
            for _ in range(self._count)
        ]
        ready = asyncio.gather(*(channel.channel_ready() for channel in self._channels))
        await asyncio.wait_for(ready, 30)

    async def _close(self) -> None:
        for channel in self._channels:
            await channel.close()

    def send(self, calls: Sequence[Call]) -> LoadResult:
        """Every call once, request `i` over channel `i % channels`."""
        return self._runner.run(self._send(calls))

    async def _send(self, calls: Sequence[Call]) -> LoadResult:
        stubs = [ca_pb2_grpc.IstioCertificateServiceStub(channel) for channel in self._channels]
        failures: Counter[str] = Counter()
        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(calls):
                index = next_index
                next_index += 1
                call = calls[index]
                try:
                    await stubs[index % len(stubs)].CreateCertificate(
                        ca_pb2.IstioCertificateRequest(csr=call.csr),
                        metadata=(("authorization", f"Bearer {call.token}"),),
                        timeout=120,
                    )
                except grpc.aio.AioRpcError as error:
                    failures[f"{error.code().name}: {(error.details() or '')[:120]}"] += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(self._concurrency)))
        return LoadResult(len(calls), time.perf_counter() - started, failures)
