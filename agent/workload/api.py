"""The SPIFFE Workload API server: the agent's identities for SPIFFE-aware applications.

go-spiffe, py-spiffe, java-spiffe, spiffe-helper and the proxies built on them ask for their
identity over `SpiffeWorkloadAPI` (gRPC on a Unix socket, `SPIFFE_ENDPOINT_SOCKET`), as SPIRE's
agent serves it. meshca serves it beside SDS from the *same* `SecretCache` the scheduler fills
and SDS and the files read: no second source of truth, no extra CSR. A rotation, or a bundle
change from `agent.trust_bundle`, reaches Envoy, the files and the Workload API from one publish.

What is served (messages: `meshca_proto/workload.proto`, the SPIFFE specification's):

- `FetchX509SVID` (server stream): one response at once (as soon as the caller's certificate
  exists), then one whenever its leaf or the trust bundle changes. The SVID carries the chain
  as concatenated DER (leaf first), the key as unencrypted PKCS#8 DER, and the trust domain's
  bundle (the served `ROOTCA`) as concatenated DER.
- `FetchX509Bundles` (server stream): the bundle keyed by trust domain ID
  (`spiffe://<td>`), at once and on every change; a bundle change needs no new leaf.
- `FetchJWTSVID`, `FetchJWTBundles`, `ValidateJWTSVID`: the JWT profile
  (`agent.workload.jwt_profile`), when the agent has a CA to sign tokens (`jwt`); an agent
  serving file-mounted certificates answers FAILED_PRECONDITION, saying what to configure.

Every call must carry the metadata `workload.spiffe.io: true` (the specification's guard against
a browser or SSRF relaying a request to the socket); without it: INVALID_ARGUMENT "security
header missing from request", the specification's wording.

Who is asking is a `CallerResolver`'s business, decided once at construction (`agent.main`):
a pod agent's socket is private to its pod, so every caller gets the pod's identity
(`PodCaller`, the `default` resource); a node agent attests each caller
(`agent.workload.attestor.NodeCaller`, from the peer credentials `agent.workload.relay` took
when the connection was accepted). A caller that cannot be placed gets PERMISSION_DENIED and nothing
else; a stream only ever reads the one resource its caller was resolved to.

Refusals are counted by reason (`REFUSAL_REASONS`) in `meshca_agent_workload_api_refusals_total`;
open streams and responses sent are in `/metrics` and in `meshca status` (`summary()`).

Concurrency: one asyncio loop (grpc.aio), like `agent.sds`: each stream is one coroutine
waiting on the cache; no thread per stream. The DER encodings of a secret are computed once per
version (`_Encodings`), not once per stream. Keys never reach a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from cryptography.hazmat.primitives import serialization

from agent.errors import CallerNotAttested
from agent.jwt_svids import JwtSvidSource
from agent.metrics import LabeledCounter
from agent.secrets import (
    DEFAULT_RESOURCE,
    ROOT_RESOURCE,
    RootSecret,
    Secret,
    SecretUpdates,
    TlsSecret,
)
from agent.unix_socket import DEFAULT_MAX_CONNECTIONS, UnixSocketPath, grpc_connection_cap
from agent.workload.jwt_profile import (
    JwtRefusal,
    bundles_response,
    fetch_jwt_svid,
    validate_jwt_svid,
)
from certs import SpiffeId, certs_to_der, describe_certificate, load_certs, load_private_key
from meshca.grpc_services import Undecodable, add_service, lenient_decoder
from meshca_proto import workload_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "SpiffeWorkloadAPI"  # the specification's, unpackaged: it is in the gRPC path
SECURITY_HEADER = "workload.spiffe.io"
DEFAULT_MAX_STREAMS = 1024
ENCODING_MEMO = 4096  # names (identities + ROOTCA), beyond a large node's

FETCH_X509_SVID = "FetchX509SVID"
FETCH_X509_BUNDLES = "FetchX509Bundles"
FETCH_JWT_BUNDLES = "FetchJWTBundles"
STREAM_RPCS = (FETCH_X509_SVID, FETCH_X509_BUNDLES, FETCH_JWT_BUNDLES)

REFUSED_NO_HEADER = "missing_security_header"
REFUSED_NOT_ATTESTED = "caller_not_attested"
REFUSED_UNDECODABLE = "undecodable_request"
REFUSED_TOO_MANY_STREAMS = "too_many_streams"
REFUSED_JWT = "jwt_not_served"
REFUSED_JWT_REQUEST = "jwt_request_refused"
REFUSAL_REASONS = (
    REFUSED_NO_HEADER,
    REFUSED_NOT_ATTESTED,
    REFUSED_UNDECODABLE,
    REFUSED_TOO_MANY_STREAMS,
    REFUSED_JWT,
    REFUSED_JWT_REQUEST,
)
JWT_NOT_SERVED = (
    "this meshca agent serves file-mounted X.509-SVIDs (FILE_MOUNTED_CERTS): it has no CA to "
    "sign JWT-SVIDs, so there is no JWT-SVID, JWT bundle or JWT validation here; for JWT-SVIDs "
    "run the agent against the meshca CA instead (CA_ADDR and a token, without "
    "FILE_MOUNTED_CERTS: docs/workload-api.md#jwt-svids-need-the-ca)"
)


# --- what the server needs -------------------------------------------------------------------


class GaugeChild(Protocol):
    def inc(self, amount: float = 1) -> None: ...

    def dec(self, amount: float = 1) -> None: ...


class LabeledGauge(Protocol):
    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> GaugeChild: ...


class WorkloadApiMetrics(Protocol):
    """The part of `agent.metrics.AgentMetrics` the Workload API writes."""

    @property
    def workload_api_streams(self) -> LabeledGauge: ...

    @property
    def workload_api_responses(self) -> LabeledCounter: ...

    @property
    def workload_api_refusals(self) -> LabeledCounter: ...


class CallerResolver(Protocol):
    """Which cache resource holds the identity of the caller behind `peer` (grpc's
    `context.peer()`); raises `CallerNotAttested` for a caller it cannot place."""

    def resource_for(self, peer: str) -> str: ...

    def describe(self) -> str: ...


class PodCaller:
    """A pod agent: its socket is reachable only from its pod, every caller is the pod."""

    def resource_for(self, peer: str) -> str:
        return DEFAULT_RESOURCE

    def describe(self) -> str:
        return "the pod's identity to every caller (pod agent)"


# --- encoding --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Svid:
    spiffe_id: str
    chain_der: bytes
    key_der: bytes

    def __repr__(self) -> str:  # the key stays out of any log or traceback
        return f"_Svid({self.spiffe_id!r}, {len(self.chain_der)} bytes of chain)"


class _Encodings:
    """The Workload API's DER forms of cached secrets, computed once per version and shared
    by every stream. Only the latest version of each name is kept (a rotated-out key is
    dropped as soon as its successor is encoded), for at most `limit` names (least recently
    used first out): a node agent's identities, not its history."""

    def __init__(self, limit: int = ENCODING_MEMO) -> None:
        self._limit = limit
        self._memo: OrderedDict[str, tuple[str, _Svid | bytes]] = OrderedDict()

    def svid(self, secret: TlsSecret) -> _Svid:
        found = self._get(secret)
        if isinstance(found, _Svid):
            return found
        chain = load_certs(secret.cert_chain_pem)
        spiffe_id = describe_certificate(chain[0]).identity or ""
        key = load_private_key(secret.private_key_pem)
        encoded = _Svid(
            spiffe_id,
            certs_to_der(chain),
            key.private_bytes(
                serialization.Encoding.DER,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        self._put(secret, encoded)
        return encoded

    def bundle(self, secret: RootSecret) -> bytes:
        found = self._get(secret)
        if isinstance(found, bytes):
            return found
        encoded = certs_to_der(load_certs(secret.trusted_ca_pem))
        self._put(secret, encoded)
        return encoded

    def _get(self, secret: Secret) -> _Svid | bytes | None:
        found = self._memo.get(secret.name)
        if found is None or found[0] != secret.version:
            return None
        self._memo.move_to_end(secret.name)
        return found[1]

    def _put(self, secret: Secret, encoded: _Svid | bytes) -> None:
        self._memo[secret.name] = (secret.version, encoded)
        self._memo.move_to_end(secret.name)
        while len(self._memo) > self._limit:
            self._memo.popitem(last=False)


async def latest_pairs(
    first: AsyncIterator[Secret], second: AsyncIterator[Secret]
) -> AsyncIterator[tuple[Secret, Secret]]:
    """(latest of `first`, latest of `second`) once both have a value, then after every change
    of either; changes that arrive together are yielded once."""
    sources = (first, second)
    current: list[Secret | None] = [None, None]
    pending: dict[asyncio.Future[Secret], int] = {
        asyncio.ensure_future(anext(source)): index for index, source in enumerate(sources)
    }
    try:
        while True:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                current[index] = future.result()
                pending[asyncio.ensure_future(anext(sources[index]))] = index
            a, b = current
            if a is not None and b is not None:
                yield a, b
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for source in sources:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()


# --- refusals --------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, reason: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.message = message


def _not_workload_api(data: bytes, expected: str) -> Undecodable:
    return Undecodable(
        expected,
        len(data),
        f"a Workload API request ({len(data)} bytes) does not decode as "
        f"{expected.rpartition('.')[2]}; the client is not speaking the SPIFFE Workload API",
    )


# --- the servicer ----------------------------------------------------------------------------


class _Servicer:
    def __init__(self, server: WorkloadApiServer) -> None:
        self._server = server

    def _check(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        metadata = context.invocation_metadata() or ()
        if not any(key == SECURITY_HEADER and value == "true" for key, value in metadata):
            # The specification's exact wording (SPIRE's too), so clients recognise it.
            raise _Refused(
                REFUSED_NO_HEADER,
                grpc.StatusCode.INVALID_ARGUMENT,
                "security header missing from request",
            )
        if isinstance(request, Undecodable):
            raise _Refused(REFUSED_UNDECODABLE, grpc.StatusCode.INVALID_ARGUMENT, request.problem)

    def _resource(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return self._server.callers.resource_for(context.peer() or "")
        except CallerNotAttested as exc:
            raise _Refused(
                REFUSED_NOT_ATTESTED, grpc.StatusCode.PERMISSION_DENIED, str(exc)
            ) from None

    async def _refuse(self, context: grpc.aio.ServicerContext, refusal: _Refused) -> None:
        self._server.count_refusal(refusal.reason)
        log.warning("Workload API call refused (%s): %s", refusal.reason, refusal.message)
        await context.abort(refusal.code, refusal.message)

    async def FetchX509SVID(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            self._check(request, context)
            name = self._resource(context)
            with self._server.stream(FETCH_X509_SVID, name):
                await self._stream_svids(name, context)
        except _Refused as refusal:
            await self._refuse(context, refusal)

    async def _stream_svids(self, name: str, context: grpc.aio.ServicerContext) -> None:
        cache, encodings = self._server.cache, self._server.encodings
        pairs = latest_pairs(cache.updates(name), cache.updates(ROOT_RESOURCE))
        async for leaf, bundle in pairs:
            if not isinstance(leaf, TlsSecret) or not isinstance(bundle, RootSecret):
                continue  # the names always hold these kinds; anything else is not served
            svid = encodings.svid(leaf)
            response = workload_pb2.X509SVIDResponse(
                svids=[
                    workload_pb2.X509SVID(
                        spiffe_id=svid.spiffe_id,
                        x509_svid=svid.chain_der,
                        x509_svid_key=svid.key_der,
                        bundle=encodings.bundle(bundle),
                    )
                ]
            )
            await context.write(response)
            self._server.count_response(FETCH_X509_SVID)
            log.debug("Workload API: pushed %s (leaf %s)", svid.spiffe_id, leaf.version)

    async def FetchX509Bundles(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            self._check(request, context)
            # The bundle is public, but only to callers we can place (and it counts for them).
            name = self._resource(context)
            with self._server.stream(FETCH_X509_BUNDLES, name):
                updates = self._server.cache.updates(ROOT_RESOURCE)
                try:
                    async for bundle in updates:
                        if not isinstance(bundle, RootSecret):
                            continue
                        response = workload_pb2.X509BundlesResponse(
                            bundles={
                                self._server.trust_domain_id: self._server.encodings.bundle(bundle)
                            }
                        )
                        await context.write(response)
                        self._server.count_response(FETCH_X509_BUNDLES)
                finally:
                    aclose = getattr(updates, "aclose", None)
                    if aclose is not None:
                        await aclose()
        except _Refused as refusal:
            await self._refuse(context, refusal)

    def _jwt_source(self, request: Any, context: grpc.aio.ServicerContext) -> JwtSvidSource:
        self._check(request, context)
        if self._server.jwt is None:
            # Not UNIMPLEMENTED: the profile is implemented; this agent's configuration lacks
            # what it needs, which the caller cannot change by retrying.
            raise _Refused(REFUSED_JWT, grpc.StatusCode.FAILED_PRECONDITION, JWT_NOT_SERVED)
        return self._server.jwt

    async def FetchJWTSVID(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            source = self._jwt_source(request, context)
            name = self._resource(context)
            own = self._server.own_identity
            return await fetch_jwt_svid(source, request, name, own)
        except _Refused as refusal:
            await self._refuse(context, refusal)
        except JwtRefusal as exc:
            await self._refuse(context, _Refused(REFUSED_JWT_REQUEST, exc.code, exc.message))

    async def ValidateJWTSVID(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            source = self._jwt_source(request, context)
            self._resource(context)  # only callers it can place, as for the bundles
            return await validate_jwt_svid(source, request)
        except _Refused as refusal:
            await self._refuse(context, refusal)
        except JwtRefusal as exc:
            await self._refuse(context, _Refused(REFUSED_JWT_REQUEST, exc.code, exc.message))

    async def FetchJWTBundles(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            source = self._jwt_source(request, context)
            name = self._resource(context)
            with self._server.stream(FETCH_JWT_BUNDLES, name):
                async for bundle in source.bundles():
                    await context.write(bundles_response(bundle))
                    self._server.count_response(FETCH_JWT_BUNDLES)
        except _Refused as refusal:
            await self._refuse(context, refusal)


def _handlers(servicer: _Servicer) -> dict[str, grpc.RpcMethodHandler]:
    pb = workload_pb2

    def stream(method: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(
            method, lenient_decoder(request, _not_workload_api), response.SerializeToString
        )

    def unary(method: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            method, lenient_decoder(request, _not_workload_api), response.SerializeToString
        )

    return {
        FETCH_X509_SVID: stream(servicer.FetchX509SVID, pb.X509SVIDRequest, pb.X509SVIDResponse),
        FETCH_X509_BUNDLES: stream(
            servicer.FetchX509Bundles, pb.X509BundlesRequest, pb.X509BundlesResponse
        ),
        "FetchJWTSVID": unary(servicer.FetchJWTSVID, pb.JWTSVIDRequest, pb.JWTSVIDResponse),
        "FetchJWTBundles": stream(
            servicer.FetchJWTBundles, pb.JWTBundlesRequest, pb.JWTBundlesResponse
        ),
        "ValidateJWTSVID": unary(
            servicer.ValidateJWTSVID, pb.ValidateJWTSVIDRequest, pb.ValidateJWTSVIDResponse
        ),
    }


# --- the server ------------------------------------------------------------------------------


class Listener(Protocol):
    """Where the gRPC server listens and how callers reach it: the public socket itself (pod
    agent), or a private socket behind `agent.workload.relay` (node agent)."""

    @property
    def grpc_address(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class WorkloadApiServer:
    """Serves `SpiffeWorkloadAPI` for `callers` from `cache` on `socket_path`.

    `await start()` binds as the SDS socket does (`agent.unix_socket`: the parent created 0700
    if missing, a dead socket replaced, a live one refused, the mode set to `socket_mode`) and
    holds at most `max_connections` connections; `await stop(grace)` ends the streams and
    removes the socket it bound. With `relay` (node mode) the public socket is the relay's (so
    are its rules and its connection cap) and the gRPC server listens on the relay's private
    socket.
    """

    def __init__(
        self,
        cache: SecretUpdates,
        socket_path: str | os.PathLike[str],
        *,
        trust_domain: str,
        callers: CallerResolver | None = None,
        metrics: WorkloadApiMetrics,
        socket_mode: int = 0o600,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_streams_per_caller: int | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        relay: Listener | None = None,
        jwt: JwtSvidSource | None = None,
        own_identity: SpiffeId | None = None,
    ) -> None:
        self.cache = cache
        self.jwt = jwt  # JWT-SVIDs from the CA; None: the JWT profile is not served
        self.own_identity = own_identity  # pod mode: the agent's identity (JWT `spiffe_id`)

        self.socket_path = Path(socket_path)
        self._socket = UnixSocketPath(self.socket_path, "Workload API socket")
        self.trust_domain_id = f"spiffe://{trust_domain}"
        self.callers: CallerResolver = callers or PodCaller()
        self.metrics = metrics
        self.socket_mode = socket_mode
        self.max_streams = max_streams
        # Node mode: one pod cannot take every stream slot from the node's other pods.
        self.max_streams_per_caller = max_streams_per_caller
        self.max_connections = max_connections  # pod mode; the relay has its own cap
        self._streams_of: dict[str, int] = {}
        self.encodings = _Encodings()
        self.relay = relay
        self.open_streams = dict.fromkeys(STREAM_RPCS, 0)
        self.responses = dict.fromkeys(STREAM_RPCS, 0)
        self.refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self._server: grpc.aio.Server | None = None
        for rpc in STREAM_RPCS:  # every series at 0 from the start, for increase()
            metrics.workload_api_streams.labels(rpc=rpc)
            metrics.workload_api_responses.labels(rpc=rpc)
        for reason in REFUSAL_REASONS:
            metrics.workload_api_refusals.labels(reason=reason)

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def stream_count(self) -> int:
        return sum(self.open_streams.values())

    @contextlib.contextmanager
    def stream(self, rpc: str, caller: str) -> Any:
        """Counts one open stream of `rpc` for `caller` (its resource name) while the block
        runs; refuses past `max_streams` in all, or past `max_streams_per_caller` for one."""
        if self.stream_count >= self.max_streams:
            raise _Refused(
                REFUSED_TOO_MANY_STREAMS,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the agent already serves {self.max_streams} Workload API streams; close "
                "unused clients (one X509Source per process is enough) and retry",
            )
        held = self._streams_of.get(caller, 0)
        if self.max_streams_per_caller is not None and held >= self.max_streams_per_caller:
            raise _Refused(
                REFUSED_TOO_MANY_STREAMS,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{caller} already holds {held} Workload API streams, the most one workload "
                "may; close unused clients (one X509Source per process is enough) and retry",
            )
        self._streams_of[caller] = held + 1
        self.open_streams[rpc] += 1
        gauge = self.metrics.workload_api_streams.labels(rpc=rpc)
        gauge.inc()
        try:
            yield
        finally:
            self.open_streams[rpc] -= 1
            remaining = self._streams_of[caller] - 1
            if remaining:
                self._streams_of[caller] = remaining
            else:
                del self._streams_of[caller]
            gauge.dec()

    def count_response(self, rpc: str) -> None:
        self.responses[rpc] += 1
        self.metrics.workload_api_responses.labels(rpc=rpc).inc()

    def count_refusal(self, reason: str) -> None:
        self.refusals[reason] += 1
        self.metrics.workload_api_refusals.labels(reason=reason).inc()

    def summary(self) -> dict[str, Any]:
        """What `meshca status` shows of the Workload API (a snapshot of plain values)."""
        return {
            "socket": str(self.socket_path),
            "serves": self.callers.describe(),
            "streams_open": dict(self.open_streams),
            "responses": dict(self.responses),
            "refusals": {reason: n for reason, n in self.refusals.items() if n},
        }

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("Workload API server already started")
        options: list[tuple[str, int]] = []
        if self.relay is None:
            address = f"unix:{self._socket.prepare()}"
            options = grpc_connection_cap(self.max_connections)
        else:  # the relay holds the public socket and caps its connections itself
            address = self.relay.grpc_address
        server = grpc.aio.server(options=options)
        add_service(server, SERVICE_NAME, _handlers(_Servicer(self)))
        if server.add_insecure_port(address) == 0:
            raise OSError(f"could not listen on {address}")
        await server.start()
        self._server = server
        if self.relay is None:
            self._socket.claim(self.socket_mode)
        else:
            await self.relay.start()
        log.info(
            "SPIFFE Workload API on %s (mode %o): %s",
            self.address,
            self.socket_mode,
            self.callers.describe(),
        )

    async def stop(self, grace: float | None = 1.0) -> None:
        """Ends the streams and removes the socket if it is still the one `start` bound (a
        socket another process serves on, or took over since, is never removed)."""
        server, self._server = self._server, None
        if server is None:
            return
        if self.jwt is not None:
            await self.jwt.close()  # its bundle poll, if a JWT call started it
        try:
            if self.relay is not None:
                await self.relay.stop()
            await server.stop(grace)
        finally:
            self._socket.release()
