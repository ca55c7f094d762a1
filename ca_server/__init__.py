"""meshca's certificate authority: Istio's `IstioCertificateService` on `grpc.aio`.

Request path (one direction, one module each):
`service` (RPC edge) → `authn` (who is calling) → `authz` (may this CSR be signed for them)
→ `ttl` (for how long) → `signer` (sign with the current `SigningAuthority` from `root_store`).
Errors are raised as `errors.RequestError` subclasses and turned into gRPC statuses only in
`service`.
"""
