"""meshca's certificate authority: Istio's `IstioCertificateService` over gRPC.

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
signer, publish `root-cert.pem`, and publish the leaf ledger (`fleet.leaf_ledger`: live
leaves per authority). `server` holds the driver and never asks which kind it is.

What the fleet holds: meshca agents report their trust bundle and leaf authorities on every CSR
(headers, recorded by `service`) and between renewals on meshca's own RPC (`report_service`,
`meshca.v1.AgentReportService`, whose answer names the tainted authorities — as does the taint
notice `meshca.taint_notice` that the drivers (`authority.root_bundle`) and
`kube.root_publisher` publish beside the bundle, so agents learn a taint as fast as a new
root); the `fleet` package (one facade, `ca_server.fleet`, below `authority`) keeps this
process's table (`fleet.agent_reports`), merges every process's (`fleet.merge`) and applies the
coverage rule (`fleet.coverage`), which `meshca authority show`, the activation gate and the
plugged-in guard read. `server` builds the table once and hands it to the driver (which
publishes it with the ledger) and to both services (which record into it).

How the process is served: `serving` (one role chosen at start-up, a single CA or worker `slot`
of `meshca ca --workers N`: server options, monitoring and `/debug/ca`, readiness, the
supervisor), with every name on the CA's wire in `wire`; `server` composes the parts. The
commands reach the CA through this package root (`run_ca`, `WorkerSupervisor`, the flag table
`add_ca_arguments`, ... below, imported on first use), `authority`, `fleet` and `config`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ca_server.authority import check_data_dir
    from ca_server.dev_issuer import DevIssuerMissing, load_dev_issuer
    from ca_server.errors import CaSetupError
    from ca_server.flags import add_ca_arguments, duration_argument
    from ca_server.kube.supervisor_caches import SupervisorCaches
    from ca_server.server import run_ca
    from ca_server.serving.cpu_scheduling import apply_cpu_scheduling
    from ca_server.serving.cq_server import check_rpc_server
    from ca_server.serving.workers import WorkerSupervisor, default_worker_count, worker_argv

# What the commands (`meshca ca`, `meshca token`) use, imported on first use: importing
# `ca_server.config` or the flags (which every command's argument parser needs) loads this
# package, and must not load gRPC, the server or the authority with it.
_EXPORTS = {
    "add_ca_arguments": "ca_server.flags",
    "duration_argument": "ca_server.flags",
    "run_ca": "ca_server.server",
    "WorkerSupervisor": "ca_server.serving.workers",
    "SupervisorCaches": "ca_server.kube.supervisor_caches",
    "default_worker_count": "ca_server.serving.workers",
    "worker_argv": "ca_server.serving.workers",
    "apply_cpu_scheduling": "ca_server.serving.cpu_scheduling",
    "check_rpc_server": "ca_server.serving.cq_server",
    "check_data_dir": "ca_server.authority",
    "CaSetupError": "ca_server.errors",
    "DevIssuerMissing": "ca_server.dev_issuer",
    "load_dev_issuer": "ca_server.dev_issuer",
}

__all__ = [
    "CaSetupError",
    "DevIssuerMissing",
    "SupervisorCaches",
    "WorkerSupervisor",
    "add_ca_arguments",
    "apply_cpu_scheduling",
    "check_data_dir",
    "check_rpc_server",
    "default_worker_count",
    "duration_argument",
    "load_dev_issuer",
    "run_ca",
    "worker_argv",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ca_server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
