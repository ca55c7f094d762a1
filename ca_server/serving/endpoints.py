"""What every CA gRPC server carries beside its own services, whatever its role: the standard
health service (`grpc.health.v1`, SERVING once the server serves, NOT_SERVING from the start of
a graceful shutdown), server reflection over the services it serves, and its listening ports,
bound with a failure said as one line naming the flag.

Health and reflection are grpcio's servicers, registered with lenient decoding
(`meshca.grpc_services.lenient_handlers`) rather than through the generated
`add_HealthServicer_to_server` / `enable_server_reflection`, whose decoding raises inside grpc:
bytes that are not a request are anyone's to send (neither service authenticates), and they got
`UNKNOWN` on `grpc.aio`'s server, `INTERNAL` on the completion-queue one, and an ERROR with a
traceback per request. Now both servers answer `INVALID_ARGUMENT` and the CA logs one INFO line
per peer per minute (`meshca.peer_log_limit`), with no traceback.

Concurrency: set up and switched on the CA's event loop; `Check` runs where the RPC server runs
unary handlers (`ca_server.serving.cq_server`), `Watch` and reflection on the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from meshca.grpc_services import ServicerMethod, Undecodable, add_service, lenient_handlers
from meshca.listen import ListenError
from meshca.peer_log_limit import PeerLogLimit

log = logging.getLogger(__name__)


class Health:
    """The health service and reflection of one server: reflection lists `services` (the CA's
    own), health reports the server as a whole (name "") and each of `checked` by name.
    `monotonic` times the once-a-minute line about undecodable requests."""

    def __init__(
        self,
        server: grpc.aio.Server,
        services: Sequence[str],
        checked: Sequence[str],
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._checked = ("", *checked)
        self._servicer = health.aio.HealthServicer()
        self._undecodable_log = PeerLogLimit(log, monotonic=monotonic)
        add_service(
            server,
            health.SERVICE_NAME,
            lenient_handlers(health.SERVICE_NAME, _health_methods(self._servicer), self._refused),
        )
        listed = [*services, health.SERVICE_NAME, reflection.SERVICE_NAME]
        add_service(
            server,
            reflection.SERVICE_NAME,
            lenient_handlers(
                reflection.SERVICE_NAME,
                _reflection_methods(reflection.aio.ReflectionServicer(listed)),
                self._refused,
            ),
        )

    def _refused(self, method: str, peer: str, request: Undecodable) -> None:
        self._undecodable_log.log(
            peer,
            "%s from %s: refused an undecodable request (%d bytes, not a %s) with INVALID_ARGUMENT",
            method,
            peer,
            request.size,
            request.expected,
        )

    async def serving(self) -> None:
        for name in self._checked:
            await self._servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def leaving(self) -> None:
        await self._servicer.enter_graceful_shutdown()


def _health_methods(servicer: health.aio.HealthServicer) -> dict[str, ServicerMethod]:
    request, response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    return {
        "Check": ServicerMethod(servicer.Check, request, response),
        "Watch": ServicerMethod(servicer.Watch, request, response, response_streaming=True),
    }


def _reflection_methods(servicer: reflection.aio.ReflectionServicer) -> dict[str, ServicerMethod]:
    return {
        "ServerReflectionInfo": ServicerMethod(
            servicer.ServerReflectionInfo,
            reflection_pb2.ServerReflectionRequest,
            reflection_pb2.ServerReflectionResponse,
            request_streaming=True,
            response_streaming=True,
        )
    }


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
