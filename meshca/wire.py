"""The names a meshca agent and the meshca CA both put on the wire, defined once for both
daemons (neither may import the other: `tests/test_layers.py`). The CA's view of its whole wire,
with the names only it speaks, is `ca_server.wire`.

Request metadata of `CreateCertificate` (docs/reference.md#ca-api):
- `IMPERSONATED_IDENTITY`: node mode, the workload identity a node agent asks for (a
  `google.protobuf.Struct` field of the request's metadata, as Istio's ztunnel sends it).
- `RENEWAL_HEADER`: `x-meshca-renewal: 1` when the caller still holds a valid certificate for
  the identity, so an overloaded CA sheds it before first certificates (`ca_server.admission`).
- The propagation report (docs/reference.md#propagation-report): `AGENT_ID_HEADER`,
  `TRUST_BUNDLE_HEADER`, `LEAF_AUTHORITY_HEADER`, sent on every CSR (`agent.propagation`),
  recorded by the CA (`ca_server.fleet.agent_reports`).

Response trailer: `RETRY_PUSHBACK_TRAILER` (gRPC's retry pushback, milliseconds), sent with a
shed request's `UNAVAILABLE`; the agent waits at least that long (`agent.ca_client`).

TLS: the CA's serving certificate names `CA_SERVING_HOSTS` (the CA's default `--serving-host`s);
an agent dialling any other address checks the name `CA_TLS_NAME` (istiod's, as Istio's agents
expect).

`MAX_REPORT_INTERVAL` bounds the agent's `--report-interval` (it jitters each wait by up to
20 %), and the CA's expiry of a report is derived from it
(`ca_server.fleet.entries`): a live agent refreshes its entry well before it expires,
a gone one stops counting soon after. The report names at most `MAX_REPORTED_JWT_KIDS` kids of
the agent's JWT bundle, each at most `MAX_JWT_KID` characters (a JWK thumbprint is 43)."""

from datetime import timedelta

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
RENEWAL_HEADER = "x-meshca-renewal"
AGENT_ID_HEADER = "x-meshca-agent-id"
TRUST_BUNDLE_HEADER = "x-meshca-trust-bundle-sha256"
LEAF_AUTHORITY_HEADER = "x-meshca-leaf-authority"

RETRY_PUSHBACK_TRAILER = "grpc-retry-pushback-ms"

CA_TLS_NAME = "istiod.istio-system.svc"
CA_SERVING_HOSTS = ("localhost", "127.0.0.1", CA_TLS_NAME)

MAX_REPORT_INTERVAL = timedelta(minutes=10)
MAX_REPORTED_JWT_KIDS = 8
MAX_JWT_KID = 64
