"""Kubernetes mode: the CA's parts that talk to the API server.

One module per job (the list+watch building block, `meshca.informer`, sits in the runtime layer
because the node agent watches pods with it too):
- `clients`: the local and remote clusters' `ApiClient`s, by cluster id (each built by
  `meshca.kube_client`, the one builder the agent uses too).
- `ratelimit`: the token bucket in front of TokenReview calls.
- `tokenreview`: the TokenReview authenticator (its cache is `ca_server.token_cache`).
- `issuer_keys` / `bound_tokens`: offline token validation (`--token-validation offline`) — the
  service-account issuer's keys, and pod-bound tokens checked against the pod informer.
- `secret_root`: the authority slots in Secret `istio-ca-secret` (an `AuthorityStateStore`).
- `named_secret`: read and write one Secret by name (the authority slots', the JWT keys').
- `leader`: the Lease that decides which replica writes ConfigMaps.
- `root_publisher`: ConfigMap `istio-ca-root-cert` in every namespace.
- `trust_bundles`: with `--pod-certificate-signer`, one ClusterTrustBundle per root, labelled
  with its phase (and Istio's `istio.io:istiod-ca:root-cert` with `--istio-cluster-trust-bundle`).
- `istiod_tls`: istiod's serving certificate in Secret `istiod-tls` (istiod with its CA off).
- `reconcile_loop`: the wake-or-resync loop those leader-driven writers run, and the guard
  around each of their writes.
- `watched_cache`: the start, stop and progress every cluster-wide cache below shares (one
  `meshca.paged_informer.PagedInformer` each: paginated raw-JSON lists, compact values).
- `pod_cache` / `node_authorizer`: impersonation by trusted node agents (ztunnel); the pod
  cache also serves offline token validation.
- `service_account_cache`: every ServiceAccount's uid, so offline validation refuses the tokens
  of a deleted account as TokenReview does.
- `replica_reports`: one ConfigMap per CA replica with its leaf ledger and the agent reports it
  received, in shards; the replicas and `meshca authority show` sum them.
- `caches`: which of those caches a replica needs, built together, and their gauges;
  `supervisor_caches`: with `--workers N`, the supervisor holds them once for the replica and
  `cache_service` answers its workers' lookups on a Unix socket, which `cache_client` asks.
- `report_pods`: whether the pod an agent report is keyed on still exists (from the pod cache).
- `pod_certificates`: the Pod Certificate signer (`--pod-certificate-signer`): answers the
  PodCertificateRequests for its name, checked against the pod cache, under the Lease.
- `mode`: composes all of the above for `ca_server.server`.

Concurrency model. The CA's request handlers run on the gRPC server's completion-queue thread
and, once they wait, on its asyncio event loop (`ca_server.serving.cq_server`); the official
`kubernetes` client is synchronous. So:
- Request-path calls (TokenReview; issuer-key refreshes) run in the default thread pool via
  `asyncio.to_thread` (TokenReview after an `await` on the async token bucket); the loop never
  waits on a socket.
- Long-lived work (watches, the Lease loop, the ConfigMap reconciler, the istiod-tls writer)
  runs in dedicated daemon threads. They share state with the loop only through small
  lock-protected caches whose critical sections are dictionary operations, and through
  `threading.Event` wake-ups, so a lookup from the loop never waits on I/O. In a
  `--workers N` worker the caches are the supervisor's: a request-path lookup
  (`PodLookup.fetch`) then runs in the thread pool too.
- Threads never touch the loop; the loop hands them data (a new root) by thread-safe setters.

Every API call made here is listed in `tests/support/kube_api_calls.py`; deploy RBAC mirrors it:
TokenReview create; in the CA's namespace, Secret `istio-ca-secret` by name only (get, update;
list/watch with the field selector `metadata.name=istio-ca-secret`, so RBAC's `resourceNames`
covers them), in istiod's namespace Secret `istiod-tls` by name only (get, update), and
Secrets create, Leases, ConfigMaps delete; ConfigMaps in all namespaces; Pods,
Namespaces and ServiceAccounts list/watch; get on /.well-known/openid-configuration and
/openid/v1/jwks; with `--pod-certificate-signer`, PodCertificateRequests list/watch and their
status update (and `sign` on the signer name, which the API server checks on that update), and
ClusterTrustBundles list/watch (field selector `spec.signerName`, or Istio's by name), create,
update and delete, with `attest` on `certificates.k8s.io/signers` for the signer (and for
`istio.io/istiod-ca` with the Istio bundle). Touch no other Secret: the RBAC grants no other.
"""
