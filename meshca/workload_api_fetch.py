"""One `FetchX509SVID` on a SPIFFE Workload API socket, as an application makes it, for
`meshca status unix:PATH` pointed at an agent's `--workload-api-socket`.

Only certificates are kept: the SVID's private key arrives on the wire (the Workload API
carries it) and is dropped here, never printed or logged. The answer's first message is read
and the stream cancelled.
"""

from __future__ import annotations

import grpc
from cryptography import x509

from certs import CertsError, load_der_certs
from meshca_proto import workload_pb2

METHOD = "/SpiffeWorkloadAPI/FetchX509SVID"
SECURITY_HEADER = ("workload.spiffe.io", "true")

# name -> (type "cert_chain" | "ca", the leaf or the first-expiring root, certificates); the
# SVID under its SPIFFE ID, its trust domain's bundle under `<trust domain ID> bundle`.
ServedCertificates = dict[str, tuple[str, x509.Certificate, int]]


class WorkloadApiFetchError(Exception):
    """The socket did not answer like a Workload API; the message says what to check."""


def fetch_svids(socket: str, timeout: float) -> ServedCertificates:
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            call = channel.unary_stream(
                METHOD,
                request_serializer=workload_pb2.X509SVIDRequest.SerializeToString,
                response_deserializer=workload_pb2.X509SVIDResponse.FromString,
            )(workload_pb2.X509SVIDRequest(), metadata=(SECURITY_HEADER,), timeout=timeout)
            response = next(iter(call))
            call.cancel()
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        raise WorkloadApiFetchError(
            f"FetchX509SVID on unix:{socket} failed: {code} {details}; is it an agent's "
            "--workload-api-socket (or its SDS socket)?"
        ) from None
    served: ServedCertificates = {}
    for svid in response.svids:
        try:
            chain = load_der_certs(svid.x509_svid, what=f"SVID {svid.spiffe_id}")
            bundle = load_der_certs(svid.bundle, what=f"bundle of {svid.spiffe_id}")
        except CertsError as exc:
            raise WorkloadApiFetchError(f"the Workload API answer does not parse: {exc}") from None
        served[svid.spiffe_id] = ("cert_chain", chain[0], len(chain))
        trust_domain = svid.spiffe_id.split("/", 3)[2] if svid.spiffe_id.count("/") >= 2 else ""
        first = min(bundle, key=lambda cert: cert.not_valid_after_utc)
        served[f"spiffe://{trust_domain} bundle"] = ("ca", first, len(bundle))
    return served
