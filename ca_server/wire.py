"""Every name the CA reads or writes on its wire, in one place. Those a meshca agent speaks too
(`ImpersonatedIdentity`, the `x-meshca-*` headers, `grpc-retry-pushback-ms`, the CA's TLS
names) are defined once in `meshca.wire`, the runtime both daemons import (the agent may not
import `ca_server`), and named here again for the CA; the ones only the CA sees are defined here.

- `CERTIFICATE_SERVICE`: Istio's `istio.v1.auth.IstioCertificateService` (`ca_server.service`).
- `JWT_SVID_SERVICE`: meshca's own `meshca.v1.JwtSvidService` (`ca_server.jwt_svid.service`).
- `REPORT_SERVICE`: meshca's own `meshca.v1.AgentReportService` (`ca_server.report_service`).

Istio's agents also send `CertSigner` request metadata (empty unless `ISTIO_META_CERT_SIGNER` is
set) to pick a signer; meshca has one signing authority and reads no such key, so it has no name
here.
"""

from meshca.wire import (
    AGENT_ID_HEADER,
    CA_SERVING_HOSTS,
    CA_TLS_NAME,
    IMPERSONATED_IDENTITY,
    LEAF_AUTHORITY_HEADER,
    RENEWAL_HEADER,
    RETRY_PUSHBACK_TRAILER,
    TRUST_BUNDLE_HEADER,
)

__all__ = [
    "AGENT_ID_HEADER",
    "CA_SERVING_HOSTS",
    "CA_TLS_NAME",
    "CERTIFICATE_SERVICE",
    "IMPERSONATED_IDENTITY",
    "JWT_SVID_SERVICE",
    "LEAF_AUTHORITY_HEADER",
    "RENEWAL_HEADER",
    "REPORT_SERVICE",
    "RETRY_PUSHBACK_TRAILER",
    "TRUST_BUNDLE_HEADER",
]

# As the protos name them (`tests/test_layers.py` checks): spelt out so that `ca_server.config`
# can use this module without loading protobuf.
CERTIFICATE_SERVICE = "istio.v1.auth.IstioCertificateService"
REPORT_SERVICE = "meshca.v1.AgentReportService"
JWT_SVID_SERVICE = "meshca.v1.JwtSvidService"
