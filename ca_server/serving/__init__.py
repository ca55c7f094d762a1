"""How the CA process is served, as opposed to what it serves: one role chosen at start-up, and
the parts around the gRPC services that do not depend on the signing authority's mode.

Module map:
- `role`: the serving role, chosen once (`serving_role_for`): a single CA process, or worker
  `slot` of `meshca ca --workers N`. It supplies the gRPC server options, the monitoring
  (`/metrics` `/healthz` `/ready`) and debug (`/debug/ca`) HTTP servers or, for a worker, the
  ready file and the status it publishes; it sees the running CA only through a `ServingView`
  of plain inputs, so it imports none of the authority modules.
- `workers`: the supervisor of `--workers N` (ports shared with `SO_REUSEPORT`, restarts, the
  merged monitoring pages) and `die_with_parent`.
- `worker_status`: a worker's part of `/debug/ca` (published as a file) and the supervisor's
  merge of the parts.
- `status`: the `/debug/ca` document itself (`meshca status` reads it).
- `readiness`: whether the signing chain is usable now: what `/ready` (or the ready file)
  says beyond "serving".
- `tls`: the CA's own serving certificate on its gRPC ports, kept in step with the authority.
- `endpoints`: what every CA gRPC server carries beside its services: health, reflection, the
  listening ports.
- `cpu_scheduling`: the CA's threads under `SCHED_BATCH` (`--cpu-scheduling`), set first thing.
- `cq_server`: the CA's gRPC server (`--rpc-server`, `rpc_server_for`): one thread polling
  grpcio's completion queue runs the handlers inline and hands those that wait to the event
  loop; `grpc.aio`'s server is the fallback. `cq_calls`: one call on it (the servicer context,
  streaming reads and writes, a handler resumed on the loop). `grpc_core`: grpcio's private
  Cython core, imported and feature-detected in this one module (`completion_queue_problem`).

Concurrency: the gRPC server's completion-queue thread runs request handlers until they wait
(`cq_server`); the role's publishing and the readiness watch run on the
CA's asyncio event loop (file writes in worker threads); the monitoring and debug HTTP servers
run in their own threads and only read (the readiness flag, the metrics, the current authority
reference, the leaves registry under its lock); `tls.ServingTls.fetch` runs on gRPC's threads.
The supervisor (`workers`) is a separate, single-threaded process with its own monitoring
thread. Nothing here blocks the event loop.

This package's `__init__` imports nothing, so `ca_server.config` can read
`cpu_scheduling.CPU_SCHEDULING_CHOICES` without loading the serving stack.
"""
