"""What every CA gRPC server carries beside its own services, whatever its role: the standard
health service (`grpc.health.v1`, SERVING once the server serves, NOT_SERVING from the start of
a graceful shutdown), server reflection over the services it serves, and its listening ports,
bound with a failure said as one line naming the flag.

Concurrency: on the CA's event loop (`grpc.aio`).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshca.listen import ListenError


class Health:
    """The health service and reflection of one server: reflection lists `services` (the CA's
    own), health reports the server as a whole (name "") and each of `checked` by name."""

    def __init__(
        self, server: grpc.aio.Server, services: Sequence[str], checked: Sequence[str]
    ) -> None:
        self._checked = ("", *checked)
        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        reflection.enable_server_reflection(
            [*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )

    async def serving(self) -> None:
        for name in self._checked:
            await self._servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def leaving(self) -> None:
        await self._servicer.enter_graceful_shutdown()


def add_listening_port(
    server: grpc.aio.Server, flag: str, address: str, credentials: grpc.ServerCredentials
) -> None:
    """`add_secure_port`, with a failure to bind said as one line naming the flag."""
    try:
        server.add_secure_port(address, credentials)
    except RuntimeError:
        raise ListenError(
            f"{flag} {address}: cannot listen there (the port is in use, or not an address of "
            "this host): stop what holds it or pick another port"
        ) from None
