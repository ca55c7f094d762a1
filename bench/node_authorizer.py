"""Node authorizer cost per decision with 100 and 2,000 pods on the caller's node.

Run: `.venv/bin/python -m bench.node_authorizer [--decisions 20000] [--sizes 100 2000]`

The fake API server (`tests/support/kube_api`) gets two nodes, one per size, each with its node
agent's pod and that many running pods; the CA's real `PodCache` lists them through its real
informer, and `NodeAuthorizer.authorize` is timed for an allowed impersonation (the most
expensive path: every check runs) by each node's agent. The baseline, measured in the same run
over the same cache and the same authorizer, is the previous algorithm: copy the list of the
node's pods and scan it for a live pod of the target service account. Repetitions alternate
between the four figures; medians are printed (µs per decision) with the ratios large ÷ small
(≈ 1: independent of the pods on the node) and scan ÷ indexed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import cast

from ca_server.authn import Caller
from ca_server.kube.node_authorizer import NodeAuthorizer
from ca_server.kube.pod_cache import PodCache
from certs import SpiffeId
from meshca.pods import PodInfo
from tests.support.kube_api import KubeApiServer

TRUST_DOMAIN = "cluster.local"
ACCOUNTS = [("istio-system", "ztunnel")]


def caller_on(node: str) -> Caller:
    """The node agent of `node`, as its pod-bound token authenticates it."""
    return Caller(
        SpiffeId(TRUST_DOMAIN, "istio-system", "ztunnel"),
        "bench",
        subject="system:serviceaccount:istio-system:ztunnel",
        pod_name=f"ztunnel-{node}",
        pod_uid=f"uid-ztunnel-{node}",
    )


def seed(server: KubeApiServer, sizes: list[int]) -> None:
    """Per size, a node `node-<size>` with its node agent and `size` running pods of distinct
    service accounts. The target (the last account) is the worst case for a scan that stops
    at the first match."""
    server.create_namespace("shop")
    server.create_namespace("istio-system")
    for size in sizes:
        node = f"node-{size}"
        server.create_pod(
            "istio-system",
            f"ztunnel-{node}",
            service_account="ztunnel",
            uid=f"uid-ztunnel-{node}",
            node_name=node,
        )
        for index in range(size):
            server.create_pod(
                "shop", f"{node}-app-{index}", service_account=f"sa-{index}", node_name=node
            )


class ScanningPods:
    """The pod cache as the authorizer used it before the index: the node's pods copied as a
    list (as the informer's by-node `by_index` did under its lock) and scanned per request for
    a live pod of the target's service account. Same cache, same other checks."""

    def __init__(self, cache: PodCache, sizes: list[int]) -> None:
        self._cache = cache
        self._by_node: dict[str, list[PodInfo]] = {}
        for size in sizes:
            node = f"node-{size}"
            pods = [cache.get("shop", f"{node}-app-{index}") for index in range(size)]
            self._by_node[node] = [pod for pod in pods if pod is not None]

    @property
    def synced(self) -> bool:
        return self._cache.synced

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return self._cache.get(namespace, name)

    def runs_on_node(self, node_name: str, namespace: str, service_account: str) -> bool:
        return any(
            pod.namespace == namespace and pod.service_account == service_account and pod.live
            for pod in list(self._by_node.get(node_name, []))
        )


def decide(authorizer: NodeAuthorizer, caller: Caller, target: SpiffeId) -> None:
    """One decision; `authorize` never awaits, so one coroutine step runs it to completion."""
    coroutine = authorizer.authorize(caller, target)
    try:
        coroutine.send(None)
    except StopIteration:
        return
    raise AssertionError("authorize suspended")


def time_us(run: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--sizes", type=int, nargs=2, default=[100, 2000])
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    sizes: list[int] = args.sizes
    with KubeApiServer() as server:
        seed(server, sizes)
        cache = PodCache(server.api_client())
        cache.start()
        try:
            if not cache.wait_synced(60):
                raise SystemExit("the pod cache did not sync")
            indexed = NodeAuthorizer(ACCOUNTS, cache, TRUST_DOMAIN, "Kubernetes")
            # A duck-typed stand-in for the cache: the authorizer reads only these members.
            scanning_pods = cast(PodCache, ScanningPods(cache, sizes))
            scanning = NodeAuthorizer(ACCOUNTS, scanning_pods, TRUST_DOMAIN, "Kubernetes")
            runs: dict[tuple[str, int], Callable[[], None]] = {}
            for size in sizes:
                caller = caller_on(f"node-{size}")
                target = SpiffeId(TRUST_DOMAIN, "shop", f"sa-{size - 1}")
                for name, authorizer in (("indexed", indexed), ("scan", scanning)):
                    run = functools.partial(decide, authorizer, caller, target)
                    run()  # raises if the decision is a denial
                    runs[(name, size)] = run
            samples: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
            # Alternating repetitions, so load from other processes hits every figure alike.
            for _ in range(args.repetitions):
                for (name, size), timed in runs.items():
                    # The scan grows with the node; fewer calls keep the bench short.
                    calls = args.decisions if name == "indexed" else max(200, args.decisions // 20)
                    samples[(name, size)].append(time_us(timed, calls))
        finally:
            cache.stop()
    median = {key: statistics.median(values) for key, values in samples.items()}
    small, large = sizes
    print(
        f"{'pods on node':>12} {'indexed µs':>11} {'previous scan µs':>17} {'scan ÷ indexed':>15}"
    )
    for size in sizes:
        indexed_us, scan_us = median[("indexed", size)], median[("scan", size)]
        print(f"{size:>12} {indexed_us:>11.2f} {scan_us:>17.1f} {scan_us / indexed_us:>15.1f}")
    indexed_ratio = median[("indexed", large)] / median[("indexed", small)]
    scan_ratio = median[("scan", large)] / median[("scan", small)]
    print(f"indexed: {large} ÷ {small} pods = {indexed_ratio:.2f} (1.0 = independent of the node)")
    print(f"previous scan: {large} ÷ {small} pods = {scan_ratio:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
