"""One `FetchSecrets` call on an agent's SDS socket, as a proxy makes it, for `meshca status`.

Only the certificates are kept: private keys arrive on the wire (SDS carries them) but are
dropped here and never printed or logged.
"""

from __future__ import annotations

import grpc
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from certs import CertsError, load_certs

SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
NODE_ID = "meshca-status"

# resource name -> (type "cert_chain" | "ca", the leaf or the first-expiring root, certificates)
ServedCertificates = dict[str, tuple[str, x509.Certificate, int]]


class SdsFetchError(Exception):
    """The socket did not answer like an SDS server; the message says what to check. `code`:
    the gRPC status name, when the socket answered with one (UNIMPLEMENTED: no SDS there)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def fetch_certificates(socket: str, names: tuple[str, ...], timeout: float) -> ServedCertificates:
    request = discovery_pb2.DiscoveryRequest(
        node=base_pb2.Node(id=NODE_ID), resource_names=list(names), type_url=SECRET_TYPE_URL
    )
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
            response = stub.FetchSecrets(request, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        raise SdsFetchError(
            f"FetchSecrets {', '.join(names)} on unix:{socket} failed: {code} {details}; is it "
            "the agent's SDS socket, and are these resource names it serves (--resource)?",
            code,
        ) from None
    served: ServedCertificates = {}
    for resource in response.resources:
        secret = secret_pb2.Secret()
        resource.Unpack(secret)
        try:
            if secret.HasField("tls_certificate"):
                chain = load_certs(secret.tls_certificate.certificate_chain.inline_bytes)
                served[secret.name] = ("cert_chain", chain[0], len(chain))
            elif secret.HasField("validation_context"):
                bundle = load_certs(secret.validation_context.trusted_ca.inline_bytes)
                first = min(bundle, key=lambda cert: cert.not_valid_after_utc)
                served[secret.name] = ("ca", first, len(bundle))
        except CertsError as exc:
            raise SdsFetchError(f"{secret.name} over SDS does not parse: {exc}") from None
    return served
