"""The SDS server: hands the agent's secrets to Envoy over a Unix socket.

Envoy speaks `envoy.service.secret.v3.SecretDiscoveryService`. meshca serves all three RPCs:

- `StreamSecrets`, state of the world (the one Envoy uses): the client names the resources it
  wants; we answer with those we have, and push again whenever one of them changes.
- `DeltaSecrets`, incremental: the same stream machinery with explicit (un)subscriptions.
- `FetchSecrets`, unary: the current value of the requested names.

Protocol (docs/reference.md#sds-protocol, xDS): the first request must carry `node.id`. A request
whose `response_nonce` equals the last nonce sent is an ACK, or a NACK when `error_detail` is set
(logged, counted, nothing resent: Envoy keeps its last good version and so do we). A request
carrying an older nonce is stale and ignored. Secrets are, like routes and endpoints, a resource
type whose state-of-the-world responses need only carry the resources that changed (xDS "grouping"),
so a push contains just the changed names; a stream watching several names gets each as soon as it
exists.

Which secret a name means is the resolver's business (`SecretResolver`): plain names (`default`,
`ROOTCA`) come from the agent's `SecretCache`, `file-cert:<cert>~<key>` and `file-root:<ca>` from
files on disk (`agent.file_mounted`).

The socket is claimed, capped and given back by `agent.unix_socket`: a socket another process
(another agent) serves on is never taken over, and at stop only the socket this server bound is
removed.

Concurrency: everything runs on one asyncio loop (grpc.aio); no thread per stream. Each stream is a
handler coroutine plus one task reading requests and one task per watched name, all feeding one
queue that the handler drains, so the stream's state has a single writer and needs no locks.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

from agent.errors import UnknownResourceError
from agent.metrics import LabeledCounter
from agent.sds_decoding import add_sds_servicer
from agent.secrets import (
    FILE_CERT_PREFIX,
    FILE_ROOT_PREFIX,
    RootSecret,
    Secret,
    SecretCache,
    SecretUpdates,
    TlsSecret,
)
from agent.unix_socket import DEFAULT_MAX_CONNECTIONS, UnixSocketPath, grpc_connection_cap
from meshca.grpc_services import Undecodable

log = logging.getLogger(__name__)

SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
DEFAULT_FETCH_TIMEOUT = 5.0


# --- metrics ---------------------------------------------------------------------------------


class SdsMetrics(Protocol):
    """The part of the agent's metrics the SDS server writes (label `resource_name`)."""

    @property
    def sds_pushes(self) -> LabeledCounter: ...

    @property
    def sds_nacks(self) -> LabeledCounter: ...


# --- resolving names -------------------------------------------------------------------------


class SecretResolver:
    """Maps a requested resource name to the stream of its versions.

    Plain names come from `cache`; `file-cert:`/`file-root:` names from `files` (normally an
    `agent.file_mounted.FileSecretProvider`). Without `files`, those names are refused.
    """

    def __init__(self, cache: SecretUpdates, files: SecretUpdates | None = None) -> None:
        self._cache = cache
        self._files = files

    def updates(self, name: str) -> AsyncIterator[Secret]:
        """The versions of `name`; `UnknownResourceError` if no source can serve it."""
        if not name:
            raise UnknownResourceError("empty resource name")
        source = self._cache
        if name.startswith((FILE_CERT_PREFIX, FILE_ROOT_PREFIX)):
            if self._files is None:
                raise UnknownResourceError(
                    f"resource {name!r}: file-mounted secrets are not enabled in this agent"
                )
            source = self._files
        try:
            return source.updates(name)
        except ValueError as exc:  # e.g. a malformed file-cert:/file-root: name
            raise UnknownResourceError(str(exc)) from exc


# --- encoding --------------------------------------------------------------------------------


def secret_to_any(secret: Secret) -> any_pb2.Any:
    """The Envoy `Secret` resource for one of our secrets, packed as `Any`."""
    if isinstance(secret, TlsSecret):
        message = secret_pb2.Secret(
            name=secret.name,
            tls_certificate=common_pb2.TlsCertificate(
                certificate_chain=base_pb2.DataSource(inline_bytes=secret.cert_chain_pem.encode()),
                private_key=base_pb2.DataSource(inline_bytes=secret.private_key_pem.encode()),
            ),
        )
    elif isinstance(secret, RootSecret):
        message = secret_pb2.Secret(
            name=secret.name,
            validation_context=common_pb2.CertificateValidationContext(
                trusted_ca=base_pb2.DataSource(inline_bytes=secret.trusted_ca_pem.encode())
            ),
        )
    else:  # pragma: no cover - Secret is a closed union
        raise TypeError(f"not a secret: {type(secret).__name__}")
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def combined_version(secrets: Iterable[Secret]) -> str:
    """A response's `version_info`: the secret's own version when there is one, else a digest
    over every (name, version) so that any change yields a new value."""
    items = sorted((s.name, s.version) for s in secrets)
    if len(items) == 1:
        return items[0][1]
    text = ";".join(f"{name}={version}" for name, version in items)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- one stream ------------------------------------------------------------------------------

_stream_ids = itertools.count(1)


_MAX_MESSAGE_CHARS = 1024


def _bounded(message: str) -> str:
    """Refusals can quote a client's resource name; past the client's metadata limit the
    status would arrive as RESOURCE_EXHAUSTED instead of the refusal, so it is cut."""
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return f"{message[:_MAX_MESSAGE_CHARS]}...({len(message) - _MAX_MESSAGE_CHARS} more characters)"


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        message = _bounded(message)
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Request:
    message: Any  # DiscoveryRequest or DeltaDiscoveryRequest


@dataclass
class _Update:
    secret: Secret


@dataclass
class _Eof:
    pass


@dataclass
class _SourceFailed:
    name: str
    error: Exception


_Event = _Request | _Update | _Eof | _SourceFailed


@dataclass
class _StreamState:
    """What one stream has asked for and been sent; touched only by the stream's handler."""

    stream_id: int
    node_id: str = ""
    watched: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    latest: dict[str, Secret] = field(default_factory=dict)
    sent: dict[str, str] = field(default_factory=dict)  # name -> version sent
    last_nonce: str = ""
    last_sent_names: list[str] = field(default_factory=list)
    nonces: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def new_nonce(self) -> str:
        self.last_nonce = f"{self.stream_id}-{next(self.nonces)}"
        return self.last_nonce


class _Stream:
    """Base of the SotW and delta streams: request intake, watches, coalesced pushes."""

    kind = "stream"

    def __init__(self, server: SdsServer, context: grpc.aio.ServicerContext) -> None:
        self._server = server
        self._context = context
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self.state = _StreamState(stream_id=next(_stream_ids))

    async def run(self, requests: AsyncIterator[Any]) -> None:
        reader = asyncio.create_task(self._read(requests))
        self._server._streams.add(self)
        try:
            while True:
                event = await self._queue.get()
                events = [event]
                while not self._queue.empty():  # coalesce a burst into one push
                    events.append(self._queue.get_nowait())
                for event in events:
                    if isinstance(event, _Eof):
                        return
                    if isinstance(event, _Request):
                        if isinstance(event.message, Undecodable):
                            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, event.message.problem)
                        self._on_request(event.message)
                    elif isinstance(event, _SourceFailed):
                        raise _Abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"the agent cannot serve {event.name!r} "
                            f"({type(event.error).__name__}: {event.error}); retry later",
                        )
                    else:
                        self._on_update(event.secret)
                await self._flush()
        except _Abort as exc:
            log.warning("SDS %s %d aborted: %s", self.kind, self.state.stream_id, exc.message)
            await self._context.abort(exc.code, exc.message)
        finally:
            self._server._streams.discard(self)
            reader.cancel()
            for task in self.state.watched.values():
                task.cancel()
            await asyncio.gather(reader, *self.state.watched.values(), return_exceptions=True)

    def end(self) -> None:
        """Asks the handler to finish the RPC cleanly (server shutdown)."""
        self._queue.put_nowait(_Eof())

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                self._queue.put_nowait(_Request(request))
        except (grpc.aio.AioRpcError, grpc.RpcError, asyncio.InvalidStateError):
            pass  # the client went away; the handler learns it from the EOF below
        finally:
            self._queue.put_nowait(_Eof())

    def _check_node(self, node: base_pb2.Node, has_node: bool) -> None:
        if self.state.node_id:
            return
        if not has_node or not node.id:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first SDS request must carry a non-empty node.id "
                "(set `node: {id: ..., cluster: ...}` in the Envoy bootstrap)",
            )
        self.state.node_id = node.id

    def _watch(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self.state.watched:
                continue
            try:
                updates = self._server.resolver.updates(name)
            except UnknownResourceError as exc:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
            self.state.watched[name] = asyncio.create_task(self._follow(name, updates))

    def _unwatch(self, names: Iterable[str]) -> None:
        for name in names:
            task = self.state.watched.pop(name, None)
            if task is not None:
                task.cancel()
            self.state.latest.pop(name, None)
            self.state.sent.pop(name, None)

    async def _follow(self, name: str, updates: AsyncIterator[Secret]) -> None:
        """Feeds `name`'s versions to the handler. A source that fails ends the stream with
        UNAVAILABLE (Envoy reconnects and subscribes afresh) instead of leaving it silent."""
        try:
            async for secret in updates:
                self._queue.put_nowait(_Update(secret))
        except Exception as exc:
            log.exception("SDS %s %d: source of %r failed", self.kind, self.state.stream_id, name)
            self._queue.put_nowait(_SourceFailed(name, exc))

    def _on_update(self, secret: Secret) -> None:
        if secret.name in self.state.watched:  # an update racing an unsubscribe is dropped
            self.state.latest[secret.name] = secret

    def _pending(self) -> list[Secret]:
        return [
            secret
            for name, secret in sorted(self.state.latest.items())
            if self.state.sent.get(name) != secret.version
        ]

    def _on_nack(self, names: list[str], message: str) -> None:
        log.warning(
            "Envoy (node %s) rejected SDS resources %s (nonce %s): %s; keeping the last "
            "accepted version",
            self.state.node_id,
            ",".join(names) or "-",
            self.state.last_nonce,
            message,
        )
        metrics = self._server.metrics
        for name in names:
            if metrics is not None:
                metrics.sds_nacks.labels(resource_name=name).inc()
        self._server.nacks += 1

    def _on_ack(self, names: Iterable[str]) -> None:
        """Envoy applied what we sent: nothing to do but say so (the next push is a change)."""
        log.debug("SDS %s %d: ACK for %s", self.kind, self.state.stream_id, ", ".join(names))

    def _count_push(self, names: list[str]) -> None:
        metrics = self._server.metrics
        for name in names:
            if metrics is not None:
                metrics.sds_pushes.labels(resource_name=name).inc()
                # At 0 from the first push, so Prometheus's increase() counts the first NACK.
                metrics.sds_nacks.labels(resource_name=name)
        self._server.pushes += len(names)

    def _on_request(self, request: Any) -> None:
        raise NotImplementedError

    async def _flush(self) -> None:
        raise NotImplementedError


class _SotwStream(_Stream):
    kind = "stream"

    def _on_request(self, request: discovery_pb2.DiscoveryRequest) -> None:
        self._check_node(request.node, request.HasField("node"))
        nonce = request.response_nonce
        if nonce and nonce != self.state.last_nonce:
            log.debug("SDS stream %d: stale nonce %s ignored", self.state.stream_id, nonce)
            return
        if nonce:
            if request.HasField("error_detail"):
                self._on_nack(self.state.last_sent_names, request.error_detail.message)
            else:
                self._on_ack(self.state.last_sent_names)
        else:
            # A (re)subscription: answer every requested name, even one sent before.
            for name in request.resource_names:
                self.state.sent.pop(name, None)
        wanted = list(dict.fromkeys(request.resource_names))
        self._unwatch([name for name in self.state.watched if name not in wanted])
        self._watch(wanted)

    async def _flush(self) -> None:
        pending = self._pending()
        if not pending:
            return
        response = discovery_pb2.DiscoveryResponse(
            version_info=combined_version(self.state.latest.values()),
            resources=[secret_to_any(secret) for secret in pending],
            type_url=SECRET_TYPE_URL,
            nonce=self.state.new_nonce(),
        )
        await self._context.write(response)
        names = [secret.name for secret in pending]
        for secret in pending:
            self.state.sent[secret.name] = secret.version
        self.state.last_sent_names = names
        self._count_push(names)
        log.debug(
            "SDS stream %d (node %s): pushed %s version %s",
            self.state.stream_id,
            self.state.node_id,
            ",".join(names),
            response.version_info,
        )


class _DeltaStream(_Stream):
    kind = "delta stream"

    def __init__(self, server: SdsServer, context: grpc.aio.ServicerContext) -> None:
        super().__init__(server, context)
        self._in_flight: dict[str, list[str]] = {}  # nonce -> names it carried

    def _on_request(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        self._check_node(request.node, request.HasField("node"))
        nonce = request.response_nonce
        if nonce:
            names = self._in_flight.pop(nonce, None)
            if names is None:
                log.debug("SDS delta stream %d: unknown nonce %s", self.state.stream_id, nonce)
            elif request.HasField("error_detail"):
                self._on_nack(names, request.error_detail.message)
            else:
                self._on_ack(names)
        for name, version in request.initial_resource_versions.items():
            self.state.sent.setdefault(name, version)  # the client already holds these
        self._unwatch(request.resource_names_unsubscribe)
        self._watch(dict.fromkeys(request.resource_names_subscribe))

    async def _flush(self) -> None:
        pending = self._pending()
        if not pending:
            return
        nonce = self.state.new_nonce()
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=combined_version(self.state.latest.values()),
            resources=[
                discovery_pb2.Resource(
                    name=secret.name, version=secret.version, resource=secret_to_any(secret)
                )
                for secret in pending
            ],
            type_url=SECRET_TYPE_URL,
            nonce=nonce,
        )
        await self._context.write(response)
        names = [secret.name for secret in pending]
        for secret in pending:
            self.state.sent[secret.name] = secret.version
        self.state.last_sent_names = names
        self._in_flight[nonce] = names
        self._count_push(names)


# --- the server ------------------------------------------------------------------------------


class _Servicer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    def __init__(self, server: SdsServer) -> None:
        self._server = server

    async def StreamSecrets(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        await _SotwStream(self._server, context).run(request_iterator)

    async def DeltaSecrets(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        await _DeltaStream(self._server, context).run(request_iterator)

    async def FetchSecrets(
        self,
        request: discovery_pb2.DiscoveryRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> discovery_pb2.DiscoveryResponse:
        if isinstance(request, Undecodable):
            log.warning("SDS fetch refused: %s", request.problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            raise AssertionError("unreachable: context.abort raises")
        if not request.HasField("node") or not request.node.id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "FetchSecrets needs a non-empty node.id in the request",
            )
        names = list(dict.fromkeys(request.resource_names))
        if not names:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "FetchSecrets needs at least one resource name"
            )
        timeout = self._server.fetch_timeout
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(0.0, remaining - 0.05))
        lookups = [asyncio.ensure_future(self._server.current(name)) for name in names]
        try:
            secrets = await asyncio.wait_for(asyncio.gather(*lookups), timeout)
        except UnknownResourceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _bounded(str(exc)))
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"secrets {','.join(names)} are not all available yet (the agent has not "
                "obtained them); retry shortly",
            )
        finally:
            for lookup in lookups:  # a failed lookup must not leave its siblings waiting
                lookup.cancel()
        return discovery_pb2.DiscoveryResponse(
            version_info=combined_version(secrets),
            resources=[secret_to_any(secret) for secret in secrets],
            type_url=SECRET_TYPE_URL,
        )


class SdsServer:
    """Serves SDS on the Unix socket `socket_path` from a `SecretResolver` (or a bare cache).

    `await start()` binds as `agent.unix_socket.UnixSocketPath` allows (the parent created
    0700 if missing, a dead socket replaced, a live one or a non-socket refused with
    `SocketPathRefused`), then sets the socket's mode to `socket_mode`; at most
    `max_connections` connections are held at once, one past that is closed when accepted.
    `await stop(grace)` ends the streams and removes the socket if it is still the one bound.
    """

    def __init__(
        self,
        resolver: SecretResolver | SecretCache | SecretUpdates,
        socket_path: str | os.PathLike[str],
        *,
        metrics: SdsMetrics | None = None,
        socket_mode: int = 0o600,
        fetch_timeout: float = DEFAULT_FETCH_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.resolver: SecretUpdates = (
            resolver if isinstance(resolver, SecretResolver) else SecretResolver(resolver)
        )
        self.socket_path = Path(socket_path)
        self._socket = UnixSocketPath(self.socket_path, "SDS socket")
        self.metrics = metrics
        self.socket_mode = socket_mode
        self.fetch_timeout = fetch_timeout
        self.max_connections = max_connections
        self.pushes = 0
        self.nacks = 0
        self._streams: set[_Stream] = set()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    async def current(self, name: str) -> Secret:
        """The current secret for `name`, waiting until it exists."""
        updates = self.resolver.updates(name)
        try:
            return await anext(updates)
        finally:
            aclose = getattr(updates, "aclose", None)
            if aclose is not None:
                await aclose()

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("SDS server already started")
        bind_path = self._socket.prepare()
        server = grpc.aio.server(options=grpc_connection_cap(self.max_connections))
        add_sds_servicer(_Servicer(self), server)
        if server.add_insecure_port(f"unix:{bind_path}") == 0:
            raise OSError(f"could not listen on {bind_path}")
        await server.start()
        self._server = server
        self._socket.claim(self.socket_mode)
        log.info("SDS server listening on %s (mode %o)", self.address, self.socket_mode)

    async def stop(self, grace: float | None = 1.0) -> None:
        server, self._server = self._server, None
        try:
            if server is not None:
                # End our streams ourselves so they close with OK rather than being cancelled;
                # Envoy simply reconnects (to whichever agent next owns the socket).
                for stream in list(self._streams):
                    stream.end()
                await asyncio.sleep(0)
                await server.stop(grace)
        finally:  # even when the stop is cut short: the socket is ours to remove, and only it
            self._socket.release()
