"""The fleet: which leaves are live and which trust bundle each agent holds, across CA processes.

    agents ──CSR headers / periodic Report──▶ AgentReports (this process's table)
                                               │ published with the LeafLedger by a LedgerSink
                                               ▼ (files in --data-dir, or replica ConfigMaps)
    every CA process's snapshots ──merge──▶ FleetReports ──coverage──▶ AgentCoverage
                                                                        (the activation gate)

The authority (`ca_server.authority`) reads the fleet to decide when a new root may sign and an
old one may go; the fleet never reads the authority. `ca_server.server` builds this process's
table once (`AgentReports`) and hands it to the driver (which publishes it with the ledger)
and to both RPC services (which record into it).

Modules:
- `entries`: what a report is made of (`Instance`, `AgentEntry`, `FleetEntry`,
  `FleetReports`), the limits on what an agent may say and their validators, `PodWatch`, and
  how long an entry counts (`EXPIRE_AFTER`, `REPUBLISH_EVERY`, `STALE_AFTER`);
- `agent_reports`: this process's table (`AgentReports`), bounded, with its attribution;
- `merge`: every process's published snapshot merged (`merge_snapshots`, `SnapshotCache`),
  and when a gone process's snapshot is spent;
- `coverage`: which authorities the fleet trusts and serves (`authority_coverage`,
  `subset_digests`), the activation gate's figure (`gate_coverage` -> `AgentCoverage`), and
  the JWT key's (`jwt_coverage`: agents report the kids they hold);
- `leaf_ledger`: live leaves per authority per process (`LeafLedger`) and where a process
  publishes them with its table (`LedgerSink`; `DirectoryLedgerSink` for `--data-dir`, the
  Kubernetes sink is `ca_server.kube.replica_reports`);
- `report_shards`: the table published as shards plus a heartbeat in Kubernetes mode, and
  their incremental merge (`ShardMerger`);
- `issued_leaves`: the latest leaf per identity (what `/debug/ca` and `meshca status` list).

The rest of the product imports this facade only (`__all__`; `tests/test_layers.py` holds it).
Concurrency: recorded on the CA's event loop, published and merged in worker threads; each
table, ledger and cache guards its state with a lock.
"""

from __future__ import annotations

from ca_server.fleet.agent_reports import AgentReports
from ca_server.fleet.coverage import (
    AgentCoverage,
    Coverage,
    authority_coverage,
    gate_coverage,
    jwt_coverage,
    subset_digests,
)
from ca_server.fleet.entries import (
    EXPIRE_AFTER,
    MAX_AGENT_ID,
    MAX_AUTHORITY,
    MAX_DIGEST,
    MAX_JWT_KID,
    MAX_REPORTED_AUTHORITIES,
    MAX_REPORTED_JWT_KEYS,
    REPORT_HEADERS,
    REPUBLISH_EVERY,
    STALE_AFTER,
    AgentEntry,
    FleetEntry,
    FleetReports,
    Instance,
    PodVerdict,
    PodWatch,
    valid_agent_id,
)
from ca_server.fleet.issued_leaves import ISSUED_LEAVES_CAPACITY, IssuedLeaf, IssuedLeaves
from ca_server.fleet.leaf_ledger import DirectoryLedgerSink, LeafLedger, LedgerSink, sum_snapshots
from ca_server.fleet.leaf_ledger import is_spent as ledger_spent
from ca_server.fleet.merge import is_spent as agents_spent
from ca_server.fleet.merge import merge_snapshots, without_gone_pods
from ca_server.fleet.report_shards import (
    ProcessReports,
    ShardMerger,
    ShardObject,
    build_layout,
    generation_of,
    heartbeat_text,
    parse_heartbeat,
    parse_shard,
)

__all__ = [
    "EXPIRE_AFTER",
    "ISSUED_LEAVES_CAPACITY",
    "MAX_AGENT_ID",
    "MAX_AUTHORITY",
    "MAX_DIGEST",
    "MAX_JWT_KID",
    "MAX_REPORTED_AUTHORITIES",
    "MAX_REPORTED_JWT_KEYS",
    "REPORT_HEADERS",
    "REPUBLISH_EVERY",
    "STALE_AFTER",
    "AgentCoverage",
    "AgentEntry",
    "AgentReports",
    "Coverage",
    "DirectoryLedgerSink",
    "FleetEntry",
    "FleetReports",
    "Instance",
    "IssuedLeaf",
    "IssuedLeaves",
    "LeafLedger",
    "LedgerSink",
    "PodVerdict",
    "PodWatch",
    "ProcessReports",
    "ShardMerger",
    "ShardObject",
    "agents_spent",
    "authority_coverage",
    "build_layout",
    "gate_coverage",
    "generation_of",
    "heartbeat_text",
    "jwt_coverage",
    "ledger_spent",
    "merge_snapshots",
    "parse_heartbeat",
    "parse_shard",
    "subset_digests",
    "sum_snapshots",
    "valid_agent_id",
    "without_gone_pods",
]
