"""The meshca agent: gets workloads their identity from the CA, keeps it fresh, and hands it to
Envoy (SDS over a Unix socket), to SPIFFE-aware applications (the SPIFFE Workload API, another
Unix socket) and to everything else (files).

Certificate path (one direction, one module each):
identity source (`identity_sources`: the pod's one identity, or `node_identities` for a node) →
`scheduler` (when is each identity due: `rotation`, the pure policy; restore first through the
`file_output` start hook, which reads via `cert_state` and `output_dir`) → a `signing` request
to `ca_client` (the CA call; the answer must pass `acceptance`; its roots go to `trust_bundle`,
which also watches the root file) → `secrets.SecretCache` → consumers: `sds` (Envoy),
`workload` (the SPIFFE Workload API), `file_output` (`output_dir`'s `..data` layout), `metrics`,
`status` (readiness).

Module map:

- `main`: the `Agent`, composed once from `config`; holds one `certificate_source`
  (CA-backed scheduler, or `file_mounted` files) and never asks which kind.
- `identity_sources`: which identities to serve, one source chosen once (`SingleIdentitySource`
  for a pod agent; `node_identities`: the node's pods or a static list); `identity_source`: what
  a source is (the protocol and its `IdentitySet` snapshot), below the sources and the scheduler.
- `scheduler`: the one driver over a set of identities (priority, bounded concurrency,
  per-identity backoff); `scheduler_state`: what it holds (each `IdentityState`, the
  `FetchQueue`); `rotation`: when to renew and retry, key + CSR; `backoff`.
- `signing`: what the pipeline passes (`SigningRequest` in, `SignedCertificate` out) and the
  `CertificateSigner` the scheduler asks.
- `acceptance`: the one "may this certificate be served" rule, for the CA's answer, restored
  files and mounted files.
- `ca_client` (gRPC/TLS to the CA: the `CertificateSigner` in use), `token` (service-account token
  and the identity in it), `propagation` (what every CSR reports to the CA: agent id, bundle digest,
  leaf authority), `reporter` (the same facts between renewals; the answer's tainted authorities go
  to the scheduler, which re-signs their leaves paced over `--taint-resign-window`), `taint_file`
  (the same taints, sooner: the CA's notice beside the root file), `taints` (the one rule both feed:
  what is known of the taints; at most one early re-sign per leaf per taint).
- `trust_bundle`: the served `ROOTCA`, learned from the watched root file (`polled_file`: one
  file followed by polling its status, the taint notice's way too) and the CA's answers; a
  change reaches SDS, the files and the CA connection without asking for a leaf.
- `output_dir` (write a generation, read the current one), `file_output` (cache → files, and
  the restore hook), `cert_state` (may a previous run's files be served again).
- `file_mounted` (FILE_MOUNTED_CERTS and `file-cert:`/`file-root:` names; with
  `credential_bundle`, the kubelet's one-file `podCertificate` bundle parsed strictly), `sds` (with
  `sds_decoding`: its registration on `meshca.grpc_services`' one lenient decoder), `status`
  (the HTTP status endpoint), `secret_status` (what is served per resource name, for the
  gauges and `/debug/secrets`), `metrics`, `secrets`.
- `workload` (a package: its own module map): the SPIFFE Workload API from the same cache
  (`workload.api`; who is asking is a `CallerResolver`'s business) and node mode's caller
  attestation (`workload.attestor`: peer credentials → cgroup → pod → identity;
  `workload.relay`: the public socket, taking `SO_PEERCRED`; `workload.peer_process`: the
  connecting process held by a pidfd or its start time, so what is read of its pid is its own).
- `jwt_svids`: JWT-SVIDs for the Workload API's JWT profile: tokens from the CA cached per
  identity and audience set, the JWT bundle kept current, validation against it;
- `unix_socket`: the one rule for the paths of those sockets (SDS, Workload API, relay): a
  live socket is never taken over, a dead one is, and only the socket bound is removed.
- `errors`: every error the agent raises on purpose, drawn once; `config`: flags and
  environment (`AgentConfig.from_args`). The commands (`meshca agent`, `meshca up`) live above
  the agent in `meshca.commands`; the pod watch uses the runtime's `meshca.informer`.

Concurrency model: one asyncio event loop runs the scheduler's workers and timers, the CA
client, the SDS and Workload API servers (and node mode's peer relay) and the file output (a
cache listener). Blocking work hops off it: key generation and restore reads run in
`asyncio.to_thread`; watchdog's observer thread and the
status HTTP server's thread only hand events to the loop (`call_soon_threadsafe`) or read
immutable snapshots. Time comes from one injected `meshca.clock.Clock`, chosen at the root
(`main.run_agent_command`, `meshca.commands.up`).
"""
