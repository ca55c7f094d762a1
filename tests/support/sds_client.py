"""A minimal synchronous SDS client for tests: `FetchSecrets` over the agent's Unix socket."""

from __future__ import annotations

from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

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
