"""meshca's certificate authority: Istio's `IstioCertificateService` on `grpc.aio`.

Request path (one direction, one module each):
`service` (RPC edge) → `authn` (who is calling) → `authz` (may this CSR be signed for them)
→ `ttl` (for how long) → the authority's signer (`authority.signer`: sign with the current
`SigningAuthority`, and count the leaf under the authority it belongs to). Errors are raised as
`errors.RequestError` subclasses and turned into gRPC statuses only in `service`; a CA that
cannot start or keep its material raises `errors.CaSetupError`.

Where the signing authority comes from: the `authority` package, one facade
(`ca_server.authority`) with one driver chosen at start-up (`authority_driver_for`). Either
self-signed slots (`authority.slots`: prepared / active / old, tainted; pure), persisted where
every CA process shares them (`authority.state_store`: `--data-dir`; `kube.secret_root`:
Secret `istio-ca-secret`) and rotated by the driver every process runs
(`authority.self_signed`); or a plugged-in CA in `--cacerts-dir` (`authority.plugged`), each
change checked before use so no workload is stranded. Both hand the authority to the one
signer, publish `root-cert.pem`, and keep the leaf ledger (`authority.leaf_ledger`: live leaves
per authority). `server` holds the driver and never asks which kind it is.

What the fleet holds: meshca agents report their trust bundle and leaf authorities on every CSR
(headers, recorded by `service`) and between renewals on meshca's own RPC (`report_service`,
`meshca.v1.AgentReportService`, whose answer names the tainted authorities — as does the taint
notice `meshca.taint_notice` that the drivers (`authority.root_bundle`) and
`kube.root_publisher` publish beside the bundle, so agents learn a taint as fast as a new
root); `authority.agent_reports` keeps the table and the coverage rule, which `meshca authority
show`, the activation gate and the plugged-in guard read.
"""
