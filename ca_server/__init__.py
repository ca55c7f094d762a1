"""meshca's certificate authority: Istio's `IstioCertificateService` over gRPC.

Request path (one direction, one module each):
`service` (RPC edge) → `authn` (who is calling) → `authz` (may this CSR be signed for them)
→ `ttl` (for how long) → `signer` (sign with the current `SigningAuthority` from `root_store`).
Errors are raised as `errors.RequestError` subclasses and turned into gRPC statuses only in
`service`.

Where the signing authority comes from: a self-signed CA keeps its authorities as slots
(`authority_slots`: prepared / active / old, tainted; pure), persisted where every CA process
shares them (`authority_state`: `--data-dir`; `kube.secret_root`: Secret `istio-ca-secret`) and
rotated by one driver every process runs (`rotation`), which hands the active one to the signer.
A plugged-in CA comes from `root_store` (`--cacerts-dir`), its changes checked by
`plugged_rotation`. `leaf_ledger` counts the live leaves each authority signed. Which of the two
is chosen, once at start-up, in `authority_setup`.

What the fleet holds: meshca agents report their trust bundle and leaf authorities on every CSR
(headers, recorded by `service`) and between renewals on meshca's own RPC (`report_service`,
`meshca.v1.AgentReportService`, whose answer names the tainted authorities — as does the taint
notice `meshca.taint_notice` that `root_store` and `kube.root_publisher` publish beside the
bundle, so agents learn a taint as fast as a new root); `agent_reports`
keeps the table and the coverage rule, which `meshca authority show` and the activation gate
(`authority_slots`, `--activate-at-coverage`) read.
"""
