"""What the fleet's reports are made of: the entry types, the limits on what an agent may say,
the validators that enforce them, and how long an entry counts.

meshca agents send three headers on every CSR (`agent.propagation`): their run's agent id, the
canonical digest of the trust bundle they serve, and the authority of the leaf they renew; and
the same facts in a light periodic report between renewals (`ca_server.report_service`). The
RPC edges hand them to the per-process table (`ca_server.fleet.agent_reports`) — a CSR's only
once it was signed (a refused request records nothing).

**A report counts for the instance its credential proves, never for what it claims.** Each
entry is keyed by `Instance`: the pod the caller's token is bound to (cluster, namespace, pod
name and pod uid, from the verified token's `kubernetes.io` claims or TokenReview's `extra`;
`meshca token` development tokens carry the same claims), checked against the pod informer
when the CA runs one (`PodWatch`: a report from a pod that is gone records nothing). The agent
id the caller chooses is only a label shown beside the entry. So one token can hold at most one
entry: it can say what its own pod trusts and serves, not make up agents, evict them, or change
another pod's entry. A node agent's reports count once, for its own pod, however many
identities the node authorizer lets it serve. A caller whose credential proves no instance
(Istio's agents, a renewal over mTLS, a JWT without pod claims) and a pod that sends no report
headers are *unknown*: at most one per SPIFFE identity, counted apart, never as covered. An
agent restart in the same pod (a new agent id) replaces the pod's entry.

Lifetime of an entry (the rule, in one place): it expires `EXPIRE_AFTER` (four times the longest
report interval an agent accepts, `meshca.wire.MAX_REPORT_INTERVAL`, so 40 min) after
it was last refreshed — a live agent refreshes it every interval (at most 10 min + 20 % jitter),
so only a gone agent's entry expires; an agent with reports turned off (`--report-interval 0`)
counts for that long after each CSR. It is removed at once when the informer says its pod is
gone. A process republishes its table at least every `REPUBLISH_EVERY` (2 min) even when
nothing changed, and a published snapshot older than `STALE_AFTER` (the longest report interval
plus one republication, 14 min) belongs to a process that is gone: its agents have reported
elsewhere since, so it stops counting (`ca_server.fleet.merge`).

The periodic report also names the `kid`s of the JWT-SVID bundle the agent holds (none until a
workload made a JWT call: it fetches the current bundle then), so the JWT key's activation can
wait for them like the X.509 root's (`ca_server.fleet.coverage.jwt_coverage`). A published
entry carries them only when there are some, as one more trailing field, so an entry of an
agent that holds no JWT bundle is published exactly as before.

`AgentEntry` is what one process holds for a pod; `FleetEntry` and `FleetReports` are what
every reader sees once the processes' tables are merged.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from ca_server.authn import Caller
from ca_server.wire import AGENT_ID_HEADER, LEAF_AUTHORITY_HEADER, TRUST_BUNDLE_HEADER
from meshca.wire import MAX_JWT_KID, MAX_REPORT_INTERVAL, MAX_REPORTED_JWT_KIDS

REPORT_HEADERS = frozenset((AGENT_ID_HEADER, TRUST_BUNDLE_HEADER, LEAF_AUTHORITY_HEADER))
EXPIRE_AFTER = 4 * MAX_REPORT_INTERVAL
# A live process republishes at least this often (in Kubernetes mode only a small heartbeat,
# `ca_server.fleet.report_shards`): once per default report period, so an idle replica writes
# once.
REPUBLISH_EVERY = timedelta(minutes=2)
STALE_AFTER = MAX_REPORT_INTERVAL * 1.2 + REPUBLISH_EVERY
SNAPSHOT_FORMAT = 2
# Longest values kept (longer ones are refused at the report edge, ignored in CSR headers).
MAX_AGENT_ID = 253
MAX_DIGEST = 64
MAX_AUTHORITY = 128
MAX_REPORTED_AUTHORITIES = 8  # a fleet signs under a handful of authorities at most
MAX_REPORTED_JWT_KEYS = MAX_REPORTED_JWT_KIDS  # published: prepared, active, a few old ones
_AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_AUTHORITY = re.compile(r"[0-9a-f]{2,128}")
_JWT_KID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # base64url, as a JWK thumbprint
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # DNS-1123, as Kubernetes names
_UID = re.compile(r"[A-Za-z0-9-]{1,64}")
_CLUSTER = re.compile(r"[A-Za-z0-9._:-]{0,128}")


def valid(value: str | None, pattern: re.Pattern[str], longest: int) -> str | None:
    """`value` when it has the shape `pattern` wants; the length is checked first, so a huge
    value costs nothing to refuse."""
    if value is None or len(value) > longest or not pattern.fullmatch(value):
        return None
    return value


def valid_agent_id(value: str | None) -> str | None:
    return valid(value, _AGENT_ID, MAX_AGENT_ID)


def valid_digest(value: str | None) -> str | None:
    return valid(value, _DIGEST, MAX_DIGEST)


def valid_authority(value: str | None) -> str | None:
    return valid(value, _AUTHORITY, MAX_AUTHORITY)


def valid_jwt_kid(value: str | None) -> str | None:
    return valid(value, _JWT_KID, MAX_JWT_KID)


@functools.lru_cache(maxsize=256)
def jwt_kid_set(text: str | None) -> frozenset[str]:
    """The kids of a published entry's comma-joined field; most agents hold the same few
    sets, so one frozenset each is shared by every entry that names it."""
    return frozenset(filter(None, (text or "").split(",")))


@dataclass(frozen=True)
class Instance:
    """The pod a caller's credential proves (see the module docstring)."""

    cluster: str  # "" for tokens no cluster vouched for (local development tokens)
    namespace: str
    pod: str
    uid: str

    @property
    def key(self) -> str:
        # None of the parts can hold "/" (checked by `instance_of`), so the key is unambiguous.
        return f"{self.cluster}/{self.namespace}/{self.pod}/{self.uid}"

    @classmethod
    def from_key(cls, key: str) -> Instance | None:
        parts = key.split("/")
        return cls(*parts) if len(parts) == 4 else None


def instance_of(caller: Caller) -> Instance | None:
    """The pod `caller` authenticated as, or `None` when its credential names none (or names
    one in a shape no Kubernetes pod has)."""
    cluster = str(caller.extra.get("cluster_id", ""))
    if (
        valid(caller.pod_name, _NAME, 253) is None
        or valid(caller.pod_uid, _UID, 64) is None
        or valid(cluster, _CLUSTER, 128) is None
    ):
        return None
    assert caller.pod_name is not None and caller.pod_uid is not None
    return Instance(cluster, caller.identity.namespace, caller.pod_name, caller.pod_uid)


@dataclass(frozen=True)
class PodVerdict:
    live: bool | None  # None: not watched here (no informer, another cluster's pod)
    node: str | None = None


class PodWatch(Protocol):
    """Whether a pod still exists as the token named it (`ca_server.kube.report_pods`)."""

    def verdict(self, instance: Instance) -> PodVerdict: ...

    def verdicts(self, instances: list[Instance]) -> list[PodVerdict]:
        """`verdict` of each, in order: one call for a whole fleet (the pods may be another
        process's cache, `ca_server.kube.cache_client`)."""
        ...


@dataclass(frozen=True)
class AgentEntry:
    identity: str  # the SPIFFE ID the credential proved
    label: str | None  # the agent id the caller chose: shown, never a key
    bundle: str | None  # the trust bundle digest the agent serves, if it sent a valid one
    # The authorities of the leaves it serves, sorted and comma-joined (None: named none).
    authority: str | None
    node: str | None  # from the pod informer, when one runs
    # The kids of the JWT bundle it holds, sorted and comma-joined (None: holds none, or said
    # nothing: an older agent, or only CSRs so far).
    jwt_keys: str | None
    refreshed: float  # unix seconds of the last report
    until: float  # unix seconds after which the entry is forgotten
    # Unix seconds since when this process has held this content for the pod: a routine
    # re-report saying the same leaves it unchanged, so a published shard stays byte-identical
    # (`ca_server.fleet.report_shards`); readers let the largest `since` win across processes.
    since: float

    @property
    def content(self) -> EntryContent:
        """What a reader counts (not when it was said)."""
        return (self.identity, self.label, self.bundle, self.authority, self.node, self.jwt_keys)


EntryContent = tuple[str, str | None, str | None, str | None, str | None, str | None]
"""identity, label, bundle digest, leaf authorities, node, JWT kids (`AgentEntry`)."""


def published_fields(content: EntryContent, *times: float) -> list[Any]:
    """An entry as a snapshot or shard lists it: the first five of `content`, `times`, then
    the JWT kids only when it holds some (an entry without them is as an older CA wrote it)."""
    *counted, jwt_keys = content
    return [*counted, *times, jwt_keys] if jwt_keys else [*counted, *times]


def split_published(fields: list[Any], times: int) -> tuple[list[Any], str | None]:
    """`published_fields` read back: (the five fields and `times` times, the JWT kids or
    None). Raises `ValueError` for a list of any other length (the reader counts it as
    unreadable)."""
    if not isinstance(fields, list) or len(fields) not in (5 + times, 6 + times):
        raise ValueError(f"an entry of {len(fields) if isinstance(fields, list) else '?'} fields")
    jwt_keys = fields[5 + times] if len(fields) == 6 + times else None
    return fields[: 5 + times], jwt_keys if isinstance(jwt_keys, str) else None


@dataclass(frozen=True)
class FleetEntry:
    """One pod's latest report, as every reader sees it."""

    key: str
    identity: str
    label: str | None
    bundle: str | None
    leaves: frozenset[str]  # authorities of the leaves it serves
    node: str | None
    refreshed: float
    jwt_keys: frozenset[str] = frozenset()  # kids of the JWT bundle it holds (none: holds none)

    @classmethod
    def decoded(
        cls, key: Any, identity: Any, label: Any, bundle: Any, leaves: Any, node: Any,
        refreshed: Any, jwt_keys: str | None = None,
    ) -> FleetEntry:  # fmt: skip
        """An entry from its published JSON fields (a snapshot's or a shard's). An optional
        text of the wrong type reads as absent; a malformed `leaves` or `refreshed` raises, so
        the snapshot counts as unreadable (unseen) rather than as an agent serving nothing."""
        return cls(
            str(key),
            str(identity),
            label if isinstance(label, str) else None,
            bundle if isinstance(bundle, str) else None,
            frozenset(filter(None, (leaves or "").split(","))),
            node if isinstance(node, str) else None,
            float(refreshed),
            jwt_kid_set(jwt_keys),
        )

    @property
    def pod(self) -> str:
        """`namespace/name` of the pod the credential proved."""
        instance = Instance.from_key(self.key)
        return f"{instance.namespace}/{instance.pod}" if instance is not None else self.key


@dataclass(frozen=True)
class FleetReports:
    """Every process's reports merged: per pod its latest entry, the identities that sent no
    instance, and what could not be seen."""

    entries: dict[str, FleetEntry]
    unknown: frozenset[str]
    dropped: int = 0  # entries a process cut to fit or evicted: unseen
    unreadable: int = 0  # snapshots that could not be read: how many agents, nobody knows
    stale: int = 0  # snapshots of processes gone longer than STALE_AFTER: not counted
    callers: dict[str, tuple[int, int]] = field(default_factory=dict)  # identity -> counts

    @classmethod
    def merged(
        cls,
        entries: dict[str, FleetEntry],
        unknown: set[str],
        unseen: tuple[int, int, int],
        callers: dict[str, list[int]],
    ) -> FleetReports:
        """What a merge of snapshots or shards ends with: `unseen` is (dropped, unreadable,
        stale), `callers` the per-identity [reports, relabels] it summed."""
        dropped, unreadable, stale = unseen
        counts = {identity: (c[0], c[1]) for identity, c in callers.items()}
        return cls(entries, frozenset(unknown), dropped, unreadable, stale, counts)

    @property
    def bundles(self) -> dict[str, str | None]:
        return {key: entry.bundle for key, entry in self.entries.items()}

    @property
    def leaves(self) -> dict[str, frozenset[str]]:
        return {key: entry.leaves for key, entry in self.entries.items()}
