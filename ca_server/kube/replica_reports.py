"""Per-replica reports in Kubernetes mode: one ConfigMap per CA replica in the CA's namespace.

`meshca-ca-replica-<instance>` (label `app.kubernetes.io/component: meshca-ca-replica`) holds
what only that replica knows and everybody needs summed: `leaves.json`, its leaf ledger (live
leaves signed per authority, see `ca_server.fleet.leaf_ledger`), and the agent reports it
received (`ca_server.fleet.agent_reports`), split by a stable hash of the pod into shards that
each fit a ConfigMap (`AGENTS_SHARD_BYTES`; shard 0 in `agents.json` of the report, shard N > 0 in
`<report>-agents-N`, same label; each with its `generation`), and `heartbeat.json`, the small
"alive, my shards are these generations" (`ca_server.fleet.report_shards`, which states the
rules). A shard is rewritten only when its content changed (who reports, which bundle and leaves);
the report itself every `REPUBLISH_EVERY` (the heartbeat) or when the leaves, shard 0 or what
the heartbeat counts changed — so an idle replica writes one object per report period.
Readers parse only the shards whose generation changed and re-decide only their pods
(`ShardMerger`). One writer per object, so writes need no resourceVersion; readers (`meshca
authority show`, the other replicas) list or watch by label and sum. A replica sweeps the
spent reports of replicas that are gone (stale heartbeat, every leaf expired) with their
shards, and its own shards beyond the count it needs, so pod churn does not pile objects up.

Concurrency: called from a worker thread (the rotation driver's `asyncio.to_thread`); every API
call blocks only that thread. Failures are logged, never raised: a report is advisory.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from datetime import datetime
from typing import Any, NamedTuple

import kubernetes.client
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ca_server.fleet import (
    REPUBLISH_EVERY,
    STALE_AFTER,
    AgentReports,
    FleetReports,
    LeafLedger,
    PodWatch,
    ProcessReports,
    ShardMerger,
    ShardObject,
    agents_spent,
    build_layout,
    generation_of,
    heartbeat_text,
    ledger_spent,
    parse_heartbeat,
    parse_shard,
    sum_snapshots,
    without_gone_pods,
)
from meshca.informer import Informer
from meshca.kube_client import api_error_text

log = logging.getLogger(__name__)

NAME_PREFIX = "meshca-ca-replica-"
COMPONENT = "meshca-ca-replica"
LABELS = {"app.kubernetes.io/name": "meshca", "app.kubernetes.io/component": COMPONENT}
SELECTOR = f"app.kubernetes.io/component={COMPONENT}"
LEAVES = "leaves.json"
AGENTS = "agents.json"
HEARTBEAT = "heartbeat.json"
GENERATION = "generation"
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


class ReportObject(NamedTuple):
    """One report ConfigMap's texts (`heartbeat`/`generation`: `None` when absent)."""

    name: str
    leaves: str
    agents: str
    heartbeat: str | None
    generation: str | None


def _texts(name: str, data: dict[str, Any]) -> ReportObject:
    heartbeat, generation = data.get(HEARTBEAT), data.get(GENERATION)
    return ReportObject(
        name,
        str(data.get(LEAVES, "{}")),
        str(data.get(AGENTS, "{}")),
        heartbeat if isinstance(heartbeat, str) else None,
        generation if isinstance(generation, str) else None,
    )


def _report_texts(obj: Any) -> ReportObject:
    return _texts(str(obj.metadata.name), obj.data or {})


def _shard_index(name: str) -> tuple[str, int] | None:
    """(owner report name, index) for a shard object's name, else `None`."""
    owner, infix, index = name.rpartition(SHARD_INFIX)
    return (owner, int(index)) if infix and owner and index.isdigit() else None


class ReplicaReportsWatch:
    """Every replica's report objects from a watch (a running CA's driver reads them every
    round): a round then costs nothing at the API server, and only the objects that changed
    are transferred. `meshca authority show` lists instead (one call, no thread)."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        core = kubernetes.client.CoreV1Api(api)
        self._informer: Informer[ReportObject] = Informer(
            "replica-reports",
            functools.partial(core.list_namespaced_config_map, namespace),
            _report_texts,
            list_kwargs={"label_selector": SELECTOR},
        )

    @property
    def synced(self) -> bool:
        return self._informer.synced

    def reports(self) -> list[ReportObject]:
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
        self._merger = ShardMerger()  # a merge re-decides only the shards that changed
        self._filtered: tuple[FleetReports, Any, FleetReports] | None = None
        # shard name -> (content decision, generation, unix seconds written)
        self._written: dict[str, tuple[str, str, float]] = {}
        self._shard0 = ("{}", generation_of("{}"))  # shard 0's text and generation, as written
        self._beat_at: float | None = None
        self._missing = False  # an own shard written earlier is gone: write it again
        self._beat_decision: str | None = None
        self._shard_count = 0
        self._next_sweep = 0.0

    def save(self, ledger: LeafLedger, agents: AgentReports, now: datetime) -> None:
        """Publishes the shards whose content changed, then the report (leaves, shard 0, the
        heartbeat) when any of those changed or the heartbeat is due; deletes shards no longer
        needed. A routine re-report changes nothing here, so it writes nothing."""
        agents.prune(now)
        if self._merger.last is not None:
            agents.reclaim(self._merger.last)  # what readers see (this replica's last merge)
        stamp = now.timestamp()
        beat_due = self._beat_at is None or stamp - self._beat_at >= REPUBLISH_EVERY.total_seconds()
        leaves_changed = ledger.changed
        if not (leaves_changed or agents.changed or beat_due or self._missing):
            return
        self._missing = False
        layout = build_layout(agents.shard_view(now), AGENTS_SHARD_BYTES, 64, self._shard_count)
        shard0: tuple[str, str, float] | None = None
        try:
            report_due = (
                leaves_changed or beat_due or layout.heartbeat_decision != self._beat_decision
            )
            for shard in layout.shards:  # shards first: the heartbeat never lists a missing one
                name = self._shard_name(shard.index)
                written = self._written.get(name)
                if written is not None and written[0] == shard.decision:
                    continue
                text = shard.text(stamp)
                generation = generation_of(text)
                if shard.index == 0:  # written with the report, below
                    self._shard0, report_due = (text, generation), True
                    shard0 = (shard.decision, generation, stamp)
                    continue
                self._write(name, {AGENTS: text, GENERATION: generation})
                self._written[name] = (shard.decision, generation, stamp)
            if report_due:
                text, generation = self._shard0
                generations = {
                    shard.index: self._written[self._shard_name(shard.index)][1]
                    for shard in layout.shards[1:]
                }
                generations[0] = generation
                self._write(
                    self._name,
                    {
                        LEAVES: ledger.snapshot_json(now),
                        AGENTS: text,
                        GENERATION: generation,
                        HEARTBEAT: heartbeat_text(layout, generations, now),
                    },
                )
                self._beat_at, self._beat_decision = stamp, layout.heartbeat_decision
                if shard0 is not None:
                    self._written[self._name] = shard0
            watched = self._watch is not None and self._watch.synced
            resized = len(layout.shards) != self._shard_count
            if watched or resized or stamp >= self._next_sweep:
                # Free from the watch; else a list call, once a period or on a resize.
                self._sweep(now, len(layout.shards))
                self._shard_count = len(layout.shards)
                self._next_sweep = stamp + REPUBLISH_EVERY.total_seconds()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            ledger.changed = agents.changed = True  # try again at the next poll
            self._written.clear()
            self._beat_at = None
            detail = api_error_text(exc) if isinstance(exc, ApiException) else exc
            log.warning("could not publish %s/%s: %s", self._namespace, self._name, detail)

    def _shard_name(self, index: int) -> str:
        return self._name if index == 0 else f"{self._name[:230]}{SHARD_INFIX}{index}"

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

    def _sweep(self, now: datetime, count: int) -> None:
        """Deletes this replica's shards beyond `count`, and the report of a gone replica (its
        heartbeat stale, every leaf expired) with its shards — or shards whose report is gone
        and that are older than `STALE_AFTER`. Forgets having written an own shard that is
        missing (deleted by someone), so the next publication writes it again."""
        reports = self._reports()
        names = {report.name for report in reports}
        spent_owners = {
            report.name
            for report in reports
            if _shard_index(report.name) is None
            and report.name != self._name
            and ledger_spent(report.leaves, now)
            and _heartbeat_spent(report, now)
        }
        for report in reports:
            shard = _shard_index(report.name)
            if report.name == self._name:
                continue
            if shard is not None and shard[0] == self._name[:230]:
                if shard[1] < count:
                    continue
                what = "a shard no longer needed"
            elif shard is not None:
                if shard[0] not in spent_owners and (
                    shard[0] in names or not _shard_spent(report.agents, now)
                ):
                    continue
                what = "a shard of a gone replica"
            elif report.name in spent_owners:
                what = "the spent report of a gone replica"
            else:
                continue
            try:
                self._core.delete_namespaced_config_map(
                    report.name, self._namespace, _request_timeout=_REQUEST_TIMEOUT
                )
                log.info("removed %s %s/%s", what, self._namespace, report.name)
            except ApiException as exc:
                if exc.status != _NOT_FOUND:
                    raise
            self._written.pop(report.name, None)
        settled = now.timestamp() - REPUBLISH_EVERY.total_seconds()
        for name, (_decision, _generation, written) in list(self._written.items()):
            if name not in names and written <= settled:
                del self._written[name]
                self._missing = True

    def _reports(self) -> list[ReportObject]:
        """Every replica's report objects. From the watch when one runs and has synced; else a
        list, decoded as plain JSON, not into client model objects (with tens of shards of
        ~700 KiB that is most of its cost)."""
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
                reports.append(_texts(name, data))
        return reports

    def _processes(self, reports: list[ReportObject]) -> list[ProcessReports]:
        """The reports grouped by the replica that wrote them: its heartbeat and shards."""
        where = f"ConfigMap {self._namespace}/"
        beats: dict[str, str | None] = {}
        shards: dict[str, dict[int, ShardObject]] = {}
        for report in reports:
            shard = _shard_index(report.name)
            owner, index = shard if shard is not None else (report.name, 0)
            if shard is None:
                beats[owner] = report.heartbeat
            generation = report.generation or generation_of(report.agents)
            shards.setdefault(owner, {})[index] = ShardObject(
                where + report.name, generation, report.agents
            )
        return [
            ProcessReports(where + owner, beats.get(owner), owned)
            for owner, owned in sorted(shards.items())
        ]

    def _merged(self, reports: list[ReportObject], now: datetime) -> FleetReports:
        """The merge without the pods the informer says are gone; the filter (a lookup per
        entry) is reused while neither the merge nor the pod informer changed."""
        merged = self._merger.merge(self._processes(reports), now)
        version = getattr(self._pods, "version", None)  # read before filtering: never newer
        cached = self._filtered
        fresh = cached is not None and cached[0] is merged and cached[1] == version
        if version is not None and cached is not None and fresh:
            return cached[2]
        result = without_gone_pods(merged, self._pods)
        if version is not None:
            self._filtered = (merged, version, result)
        return result

    def live(self, now: datetime) -> dict[str, int]:
        where = f"ConfigMap {self._namespace}/"
        return sum_snapshots(((where + r.name, r.leaves) for r in self._reports()), now)

    def agents(self, now: datetime) -> FleetReports:
        return self._merged(self._reports(), now)

    def figures(self, now: datetime) -> tuple[dict[str, int], FleetReports]:
        where = f"ConfigMap {self._namespace}/"
        reports = self._reports()
        live = sum_snapshots(((where + r.name, r.leaves) for r in reports), now)
        return live, self._merged(reports, now)


def _heartbeat_spent(report: ReportObject, now: datetime) -> bool:
    """Whether a replica's report no longer counts for agents: its heartbeat is stale (or,
    from an older CA version without one, its snapshot is spent)."""
    if report.heartbeat is None:
        return agents_spent(report.agents, now)
    try:
        published = parse_heartbeat(report.heartbeat).published
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    return published + STALE_AFTER.total_seconds() <= now.timestamp()


def _shard_spent(text: str, now: datetime) -> bool:
    """A shard whose replica's report is gone: spent once older than `STALE_AFTER`."""
    try:
        written = parse_shard(text).written
    except (ValueError, TypeError, KeyError, AttributeError):
        return agents_spent(text, now)
    return written + STALE_AFTER.total_seconds() <= now.timestamp()
