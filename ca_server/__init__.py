"""meshca's certificate authority: Istio's `IstioCertificateService` on `grpc.aio`.

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

How the process is served: `serving` (one role chosen at start-up, a single CA or worker `slot`
of `meshca ca --workers N`: server options, monitoring and `/debug/ca`, readiness, the
supervisor), with every name on the CA's wire in `wire`; `server` composes the parts. The
commands reach the CA through this package root (`run_ca`, `WorkerSupervisor`, ... below,
imported on first use) and `config`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ca_server.data_dir_guard import check_data_dir
    from ca_server.dev_issuer import DevIssuerMissing, load_dev_issuer
    from ca_server.root_store import CaSetupError
    from ca_server.server import run_ca
    from ca_server.serving.cpu_scheduling import apply_cpu_scheduling
    from ca_server.serving.workers import WorkerSupervisor, default_worker_count, worker_argv

# What the commands (`meshca ca`, `meshca token`) use, imported on first use: importing
# `ca_server.config` (which every command's argument parser needs) loads this package, and must
# not load gRPC, the server or the authority with it.
_EXPORTS = {
    "run_ca": "ca_server.server",
    "WorkerSupervisor": "ca_server.serving.workers",
    "default_worker_count": "ca_server.serving.workers",
    "worker_argv": "ca_server.serving.workers",
    "apply_cpu_scheduling": "ca_server.serving.cpu_scheduling",
    "check_data_dir": "ca_server.data_dir_guard",
    "CaSetupError": "ca_server.root_store",
    "DevIssuerMissing": "ca_server.dev_issuer",
    "load_dev_issuer": "ca_server.dev_issuer",
}

__all__ = [
    "CaSetupError",
    "DevIssuerMissing",
    "WorkerSupervisor",
    "apply_cpu_scheduling",
    "check_data_dir",
    "default_worker_count",
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
