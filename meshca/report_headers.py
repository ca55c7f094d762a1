"""The request metadata a meshca agent adds to every CreateCertificate call so the CA can tell
what the fleet trusts (docs/reference.md#propagation-report). Named once for both sides: the
agent sends them (`agent.propagation`), the CA records them (`ca_server.authority.agent_reports`).

`MAX_REPORT_INTERVAL` bounds the agent's `--report-interval` (it jitters each wait by up to
20 %), and the CA's expiry of a report is derived from it (`ca_server.authority.agent_reports`): a
live agent refreshes its entry well before it expires, a gone one stops counting soon after."""

from datetime import timedelta

AGENT_ID_HEADER = "x-meshca-agent-id"
TRUST_BUNDLE_HEADER = "x-meshca-trust-bundle-sha256"
LEAF_AUTHORITY_HEADER = "x-meshca-leaf-authority"

MAX_REPORT_INTERVAL = timedelta(minutes=10)
