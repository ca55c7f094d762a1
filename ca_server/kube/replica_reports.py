"""Per-replica reports in Kubernetes mode: one ConfigMap per CA replica in the CA's namespace.

`meshca-ca-replica-<instance>` (label `app.kubernetes.io/component: meshca-ca-replica`) holds
what only that replica knows and everybody needs summed: today `leaves.json`, its leaf ledger
(live leaves signed per authority, see `ca_server.leaf_ledger`), and `agents.json`, the agent
reports it received (`ca_server.agent_reports`), split by a stable hash of the pod into shards
that each fit a ConfigMap (`AGENTS_SHARD_BYTES`; shard N > 0 in `<report>-agents-N`, same
label). A shard is rewritten when what decisions read changed (who reports, which bundle and
leaves), else only every `REPUBLISH_EVERY` so readers can tell a live replica from a gone one;
readers parse only the shards whose text changed (`SnapshotCache`). One writer per object, so
writes need no resourceVersion; readers (`meshca authority show`, the other replicas) list by
label and sum. A replica sweeps the spent reports of replicas that are gone (every leaf and
agent report expired), and its own shards beyond the count it needs, so pod churn does not pile
objects up.

Concurrency: called from a worker thread (the rotation driver's `asyncio.to_thread`); every API
call blocks only that thread. Failures are logged, never raised: a report is advisory.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from datetime import datetime
from typing import Any

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.agent_reports import (
    REPUBLISH_EVERY,
    FleetReports,
    PodWatch,
    Shard,
    SnapshotCache,
    merge_snapshots,
)
from ca_server.agent_reports import is_spent as agents_spent
from ca_server.leaf_ledger import LeafLedger, is_spent, sum_snapshots
from meshca.informer import Informer
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

NAME_PREFIX = "meshca-ca-replica-"
COMPONENT = "meshca-ca-replica"
LABELS = {"app.kubernetes.io/name": "meshca", "app.kubernetes.io/component": COMPONENT}
SELECTOR = f"app.kubernetes.io/component={COMPONENT}"
LEAVES = "leaves.json"
AGENTS = "agents.json"
# A ConfigMap holds at most 1 MiB; leaves.json stays small (bounded buckets). The agent reports
# are split by a stable hash of the pod into shards of at most this many bytes (about 2,500
# pods each): shard 0 in the replica's report, shard N in `<report>-agents-N`.
AGENTS_SHARD_BYTES = 768 * 1024
SHARD_INFIX = "-agents-"
_REQUEST_TIMEOUT = (2.0, 5.0)
_CONFLICT, _NOT_FOUND = 409, 404


def report_name(instance: str) -> str:
    """A DNS-1123 name for this replica's report."""
    cleaned = re.sub(r"[^a-z0-9.-]+", "-", instance.lower()).strip("-.") or "replica"
    return f"{NAME_PREFIX}{cleaned}"[:253]


def _report_texts(obj: Any) -> tuple[str, str, str]:
    data = obj.data or {}
    return (str(obj.metadata.name), str(data.get(LEAVES, "{}")), str(data.get(AGENTS, "{}")))


class ReplicaReportsWatch:
    """Every replica's report objects from a watch (a running CA's rotator reads them every
    round): a round then costs nothing at the API server, and only the objects that changed
    are transferred. `meshca authority show` lists instead (one call, no thread)."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        core = kubernetes.client.CoreV1Api(api)
        self._informer: Informer[tuple[str, str, str]] = Informer(
            "replica-reports",
            functools.partial(core.list_namespaced_config_map, namespace),
            _report_texts,
            list_kwargs={"label_selector": SELECTOR},
        )

    @property
    def synced(self) -> bool:
        return self._informer.synced

    def reports(self) -> list[tuple[str, str, str]]:
        return sorted(self._informer.items().values())

    def start(self) -> None:
        self._informer.start()

    def stop(self) -> None:
        self._informer.stop()


class ConfigMapLedgerSink:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        instance: str,
        pods: PodWatch | None = None,
        watch: ReplicaReportsWatch | None = None,
    ) -> None:
        self._watch = watch  # read from when synced, else a list call
        self._core = kubernetes.client.CoreV1Api(api)
        self._namespace = namespace
        self._name = report_name(instance)
        self._pods = pods  # drops every replica's reports of pods that are gone
        self._cache = SnapshotCache()  # a merge parses only the shards that changed
        self._written: dict[str, tuple[str, float]] = {}  # shard name -> (decision, written)
        self._shard_count = 0
        self._next_sweep = 0.0

    def save(self, ledger: LeafLedger, now: datetime) -> None:
        """Publishes the shards that changed (what decisions read) or are due for
        republication, shard 0 with the leaf ledger; deletes shards no longer needed."""
        ledger.agents.prune(now)
        leaves_changed = ledger.changed
        if not (leaves_changed or ledger.agents.due(now)):
            return
        shards = ledger.agents.snapshot_shards(now, AGENTS_SHARD_BYTES)
        try:
            for shard in shards:
                name = self._shard_name(shard.index)
                if not (shard.index == 0 and leaves_changed) and not self._due(name, shard, now):
                    continue
                data = {AGENTS: shard.text}
                if shard.index == 0:
                    data[LEAVES] = ledger.snapshot_json(now)
                self._write(name, data)
                self._written[name] = (shard.decision, now.timestamp())
            watched = self._watch is not None and self._watch.synced
            resized = len(shards) != self._shard_count
            if watched or resized or now.timestamp() >= self._next_sweep:
                # Free from the watch; else a list call, once a minute or on a resize.
                self._sweep(now, len(shards))
                self._shard_count = len(shards)
                self._next_sweep = now.timestamp() + REPUBLISH_EVERY.total_seconds()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            ledger.changed = ledger.agents.changed = True  # try again at the next poll
            self._written.clear()
            detail = api_error_text(exc) if isinstance(exc, ApiException) else exc
            log.warning("could not publish %s/%s: %s", self._namespace, self._name, detail)

    def _shard_name(self, index: int) -> str:
        return self._name if index == 0 else f"{self._name[:230]}{SHARD_INFIX}{index}"

    def _due(self, name: str, shard: Shard, now: datetime) -> bool:
        written = self._written.get(name)
        return (
            written is None
            or written[0] != shard.decision
            or now.timestamp() - written[1] >= REPUBLISH_EVERY.total_seconds()
        )

    def _write(self, name: str, data: dict[str, str]) -> None:
        body = kubernetes.client.V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=kubernetes.client.V1ObjectMeta(
                name=name, namespace=self._namespace, labels=LABELS
            ),
            data=data,
        )
        # One call when this process wrote it before (replace), else create; the other on a
        # miss (a restart, or a shard a sweep removed).
        calls = [
            lambda: self._core.create_namespaced_config_map(
                self._namespace, body, _request_timeout=_REQUEST_TIMEOUT
            ),
            lambda: self._core.replace_namespaced_config_map(
                name, self._namespace, body, _request_timeout=_REQUEST_TIMEOUT
            ),
        ]
        first, second = reversed(calls) if name in self._written else calls
        try:
            first()
        except ApiException as exc:
            if exc.status not in (_CONFLICT, _NOT_FOUND):
                raise
            second()

    def _own_extra_shard(self, name: str, count: int) -> bool | None:
        """None: not one of this replica's shards; else whether it is beyond `count`."""
        prefix = f"{self._name[:230]}{SHARD_INFIX}"
        if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
            return None
        return int(name[len(prefix) :]) >= count

    def _sweep(self, now: datetime, count: int) -> None:
        for name, leaves, agents in self._reports():
            extra = self._own_extra_shard(name, count)
            if name == self._name or extra is False:
                continue
            if extra is None and not (is_spent(leaves, now) and agents_spent(agents, now)):
                continue
            try:
                self._core.delete_namespaced_config_map(
                    name, self._namespace, _request_timeout=_REQUEST_TIMEOUT
                )
                self._written.pop(name, None)
                what = "a shard no longer needed" if extra else "the spent report of a gone replica"
                log.info("removed %s %s/%s", what, self._namespace, name)
            except ApiException as exc:
                if exc.status != _NOT_FOUND:
                    raise

    def _reports(self) -> list[tuple[str, str, str]]:
        """(ConfigMap name, its `leaves.json`, its `agents.json`) of every replica's report.
        From the watch when one runs and has synced; else a list, decoded as plain JSON, not
        into client model objects (with tens of shards of ~700 KiB that is most of its cost)."""
        if self._watch is not None and self._watch.synced:
            return self._watch.reports()
        response: Any = self._core.list_namespaced_config_map(
            self._namespace,
            label_selector=SELECTOR,
            _request_timeout=_REQUEST_TIMEOUT,
            _preload_content=False,
        )
        try:
            listed = json.loads(response.data)
        finally:
            response.release_conn()
        reports = []
        for item in listed.get("items") or []:
            name = (item.get("metadata") or {}).get("name")
            data = item.get("data") or {}
            if isinstance(name, str) and isinstance(data, dict):
                reports.append((name, str(data.get(LEAVES, "{}")), str(data.get(AGENTS, "{}"))))
        return reports

    def live(self, now: datetime) -> dict[str, int]:
        where = f"ConfigMap {self._namespace}/"
        return sum_snapshots(((where + name, text) for name, text, _ in self._reports()), now)

    def agents(self, now: datetime) -> FleetReports:
        where = f"ConfigMap {self._namespace}/"
        return merge_snapshots(
            ((where + name, text) for name, _, text in self._reports()),
            now,
            self._pods,
            self._cache,
        )

    def figures(self, now: datetime) -> tuple[dict[str, int], FleetReports]:
        where = f"ConfigMap {self._namespace}/"
        reports = self._reports()
        live = sum_snapshots(((where + name, text) for name, text, _ in reports), now)
        agents = ((where + name, text) for name, _, text in reports)
        return live, merge_snapshots(agents, now, self._pods, self._cache)
