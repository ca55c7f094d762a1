"""Whether the pod an agent report is keyed on still exists, from the CA's pod cache.

`ca_server.fleet` keys each report on the pod the caller's token was bound to;
this answers, for pods of the local cluster, whether that pod still exists with that uid and has not
finished (`meshca.pods`), so the entry of a deleted or replaced pod stops counting as soon as
the watch delivers the deletion instead of when it expires. Pods of other clusters, and every
pod before the cache has synced, are "not watched here" (`live=None`): they count until
they expire. `verdicts` asks for a whole fleet in batches (with `--workers N` the cache is the
supervisor's, one round trip per batch).

Concurrency: called from the event loop (recording) and worker threads (publication, merge);
local lookups take a lock held for a dictionary read.
"""

from __future__ import annotations

from ca_server.fleet import Instance, PodVerdict
from ca_server.kube.pod_cache import PodLookup
from meshca.pods import PodInfo

_NOT_WATCHED = PodVerdict(None)


class InformerPodWatch:
    def __init__(self, pods: PodLookup, cluster_id: str) -> None:
        self._pods = pods
        self._cluster_id = cluster_id

    @property
    def version(self) -> tuple[int, bool]:
        """Changes whenever a verdict may have: a reader filtering 100,000 entries every round
        does it again only then (`ca_server.kube.replica_reports`)."""
        return (self._pods.changes, self._pods.synced)

    def verdict(self, instance: Instance) -> PodVerdict:
        return self.verdicts([instance])[0]

    def verdicts(self, instances: list[Instance]) -> list[PodVerdict]:
        if not instances or not self._pods.synced:
            return [_NOT_WATCHED] * len(instances)
        local = [i for i in instances if i.cluster == self._cluster_id]
        found = iter(self._pods.get_many([(i.namespace, i.pod) for i in local]))
        return [
            _judged(instance, next(found)) if instance.cluster == self._cluster_id else _NOT_WATCHED
            for instance in instances
        ]


def _judged(instance: Instance, pod: PodInfo | None) -> PodVerdict:
    if pod is None or pod.uid != instance.uid or not pod.live:
        return PodVerdict(False)
    return PodVerdict(True, pod.node_name)
