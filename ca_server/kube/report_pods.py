"""Whether the pod an agent report is keyed on still exists, from the CA's pod informer.

`ca_server.fleet` keys each report on the pod the caller's token was bound to;
this answers, for pods of the local cluster, whether that pod still exists with that uid and has not
finished (`meshca.pods`), so the entry of a deleted or replaced pod stops counting as soon as
the watch delivers the deletion instead of when it expires. Pods of other clusters, and every
pod before the informer has synced, are "not watched here" (`live=None`): they count until
they expire.

Concurrency: called from the event loop (recording) and worker threads (publication, merge);
`PodCache` lookups take a lock held for a dictionary read.
"""

from __future__ import annotations

from ca_server.fleet import Instance, PodVerdict
from ca_server.kube.pod_cache import PodCache


class InformerPodWatch:
    def __init__(self, pods: PodCache, cluster_id: str) -> None:
        self._pods = pods
        self._cluster_id = cluster_id

    @property
    def version(self) -> tuple[int, bool]:
        """Changes whenever a verdict may have: a reader filtering 100,000 entries every round
        does it again only then (`ca_server.kube.replica_reports`)."""
        return (self._pods.changes, self._pods.synced)

    def verdict(self, instance: Instance) -> PodVerdict:
        if instance.cluster != self._cluster_id or not self._pods.synced:
            return PodVerdict(None)
        pod = self._pods.get(instance.namespace, instance.pod)
        if pod is None or pod.uid != instance.uid or not pod.live:
            return PodVerdict(False)
        return PodVerdict(True, pod.node_name)
