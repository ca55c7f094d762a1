"""A minimal synchronous SDS client for tests: `FetchSecrets`, and a `StreamSecrets` that NACKs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.rpc import status_pb2

from certs import load_cert

SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


def unpack(resource: object) -> secret_pb2.Secret:
    secret = secret_pb2.Secret()
    assert resource.Unpack(secret)  # type: ignore[attr-defined]
    return secret


def fetch_secrets(
    socket: Path, names: list[str], *, node_id: str = "test"
) -> dict[str, secret_pb2.Secret]:
    """One unary `FetchSecrets` for `names`, as a proxy would; {name: secret}."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        response = stub.FetchSecrets(
            discovery_pb2.DiscoveryRequest(
                node=base_pb2.Node(id=node_id), resource_names=names, type_url=SECRET_TYPE_URL
            ),
            timeout=10,
        )
    assert response.type_url == SECRET_TYPE_URL
    secrets = [unpack(resource) for resource in response.resources]
    return {secret.name: secret for secret in secrets}


def leaf_serial(secret: secret_pb2.Secret) -> int:
    """Serial of the leaf in a `tls_certificate` secret."""
    return int(load_cert(secret.tls_certificate.certificate_chain.inline_bytes).serial_number)


def stream_and_nack(socket: Path, name: str, *, node_id: str = "test") -> None:
    """Opens `StreamSecrets` for `name`, takes the first response and rejects it (a NACK, as
    Envoy sends for a secret it cannot use), then closes the stream."""
    nonces: queue.Queue[str] = queue.Queue()
    done = threading.Event()

    def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
        node = base_pb2.Node(id=node_id)
        yield discovery_pb2.DiscoveryRequest(
            node=node, resource_names=[name], type_url=SECRET_TYPE_URL
        )
        nonce = nonces.get(timeout=10)
        yield discovery_pb2.DiscoveryRequest(
            node=node,
            resource_names=[name],
            type_url=SECRET_TYPE_URL,
            response_nonce=nonce,
            error_detail=status_pb2.Status(code=3, message="test: secret rejected"),
        )
        done.wait(10)

    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        responses = stub.StreamSecrets(requests(), timeout=10)
        first = next(iter(responses))
        nonces.put(first.nonce)
        time.sleep(0.3)  # let the agent read the NACK before the stream goes away
        done.set()
        responses.cancel()
