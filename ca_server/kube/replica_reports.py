"""Per-replica reports in Kubernetes mode: one ConfigMap per CA replica in the CA's namespace.

`meshca-ca-replica-<instance>` (label `app.kubernetes.io/component: meshca-ca-replica`) holds
what only that replica knows and everybody needs summed: today `leaves.json`, its leaf ledger
(live leaves signed per authority, see `ca_server.leaf_ledger`), and `agents.json`, the agent
reports it received (`ca_server.agent_reports`). One writer per object, so writes need no
resourceVersion; readers (`meshca authority show`, the other replicas) list by label and sum.
A replica sweeps the spent reports of replicas that are gone (every leaf and agent report
expired), so pod churn does not pile objects up.

Concurrency: called from a worker thread (the rotation driver's `asyncio.to_thread`); every API
call blocks only that thread. Failures are logged, never raised: a report is advisory.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.agent_reports import FleetReports, merge_snapshots
from ca_server.agent_reports import is_spent as agents_spent
from ca_server.leaf_ledger import LeafLedger, is_spent, sum_snapshots
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

NAME_PREFIX = "meshca-ca-replica-"
COMPONENT = "meshca-ca-replica"
LABELS = {"app.kubernetes.io/name": "meshca", "app.kubernetes.io/component": COMPONENT}
SELECTOR = f"app.kubernetes.io/component={COMPONENT}"
LEAVES = "leaves.json"
AGENTS = "agents.json"
# A ConfigMap holds at most 1 MiB; leaves.json stays small (bounded buckets), agents.json is
# cut to the most recently seen agents that fit in this (about 3 500 reporting agents per replica).
AGENTS_MAX_BYTES = 768 * 1024
_REQUEST_TIMEOUT = (2.0, 5.0)
_CONFLICT, _NOT_FOUND = 409, 404


def report_name(instance: str) -> str:
    """A DNS-1123 name for this replica's report."""
    cleaned = re.sub(r"[^a-z0-9.-]+", "-", instance.lower()).strip("-.") or "replica"
    return f"{NAME_PREFIX}{cleaned}"[:253]


class ConfigMapLedgerSink:
    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, instance: str) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self._namespace = namespace
        self._name = report_name(instance)

    def save(self, ledger: LeafLedger, now: datetime) -> None:
        if not (ledger.changed or ledger.agents.changed):
            return
        body = kubernetes.client.V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=kubernetes.client.V1ObjectMeta(
                name=self._name, namespace=self._namespace, labels=LABELS
            ),
            data={
                LEAVES: ledger.snapshot_json(now),
                AGENTS: ledger.agents.snapshot_json(now, AGENTS_MAX_BYTES),
            },
        )
        try:
            try:
                self._core.create_namespaced_config_map(
                    self._namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
            except ApiException as exc:
                if exc.status != _CONFLICT:
                    raise
                self._core.replace_namespaced_config_map(
                    self._name, self._namespace, body, _request_timeout=_REQUEST_TIMEOUT
                )
            self._sweep(now)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            ledger.changed = ledger.agents.changed = True  # try again at the next poll
            detail = api_error_text(exc) if isinstance(exc, ApiException) else exc
            log.warning("could not publish %s/%s: %s", self._namespace, self._name, detail)

    def _sweep(self, now: datetime) -> None:
        for name, leaves, agents in self._reports():
            if name == self._name or not (is_spent(leaves, now) and agents_spent(agents, now)):
                continue
            try:
                self._core.delete_namespaced_config_map(
                    name, self._namespace, _request_timeout=_REQUEST_TIMEOUT
                )
                log.info("removed the spent report %s/%s of a gone replica", self._namespace, name)
            except ApiException as exc:
                if exc.status != _NOT_FOUND:
                    raise

    def _reports(self) -> list[tuple[str, str, str]]:
        """(ConfigMap name, its `leaves.json`, its `agents.json`) of every replica's report."""
        result = self._core.list_namespaced_config_map(
            self._namespace, label_selector=SELECTOR, _request_timeout=_REQUEST_TIMEOUT
        )
        return [
            (
                str(item.metadata.name),
                (item.data or {}).get(LEAVES, "{}"),
                (item.data or {}).get(AGENTS, "{}"),
            )
            for item in result.items or []
            if item.metadata is not None
        ]

    def live(self, now: datetime) -> dict[str, int]:
        where = f"ConfigMap {self._namespace}/"
        return sum_snapshots(((where + name, text) for name, text, _ in self._reports()), now)

    def agents(self, now: datetime) -> FleetReports:
        where = f"ConfigMap {self._namespace}/"
        return merge_snapshots(((where + name, text) for name, _, text in self._reports()), now)

    def figures(self, now: datetime) -> tuple[dict[str, int], FleetReports]:
        where = f"ConfigMap {self._namespace}/"
        reports = self._reports()
        live = sum_snapshots(((where + name, text) for name, text, _ in reports), now)
        return live, merge_snapshots(((where + name, text) for name, _, text in reports), now)
