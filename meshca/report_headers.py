"""The request metadata a meshca agent adds to every CreateCertificate call so the CA can tell
what the fleet trusts (docs/reference.md#propagation-report). Named once for both sides: the
agent sends them (`agent.propagation`), the CA records them (`ca_server.agent_reports`)."""

AGENT_ID_HEADER = "x-meshca-agent-id"
TRUST_BUNDLE_HEADER = "x-meshca-trust-bundle-sha256"
LEAF_AUTHORITY_HEADER = "x-meshca-leaf-authority"
