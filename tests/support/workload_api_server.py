"""The agent's real `WorkloadApiServer` on a real Unix socket, hosted on a background loop so
synchronous clients (py-spiffe, grpc's sync stubs, client subprocesses) can drive it.

A pod-mode server (`pod_server`) serves `default` + `ROOTCA` from a `SecretCache` seeded from
a `TestCa`; a node-mode one (`node_server`) puts the real `PeerRelay` on the socket and attests
with the real `NodeAttestor`, whose two lookups are injected: `/proc` is a directory the test
writes (`<pid>/cgroup`, `<pid>/stat`: `tests.support.fake_proc`) and the pods are a dict by UID.
A test may also choose how the relay holds the caller (`pidfd_option`) and stop it between
taking the caller and inspecting it (`before_inspect`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import generate_latest

from agent.jwt_svids import JwtSvidSource
from agent.metrics import AgentMetrics
from agent.secrets import Secret, SecretCache, TlsSecret
from agent.unix_socket import DEFAULT_MAX_CONNECTIONS
from agent.workload.api import WorkloadApiServer
from agent.workload.attestor import NodeAttestor, NodeCaller, ProcessCgroups
from agent.workload.peer_process import PeerProcess
from agent.workload.relay import PeerRelay
from meshca.clock import SystemClock
from meshca.pods import PodInfo
from tests.support.loop import LoopThread
from tests.support.metrics import sample_value
from tests.support.pki import Issued, TestCa


class PodsByUid:
    """The injected pod informer: `PodDirectory` over a dict the test fills."""

    def __init__(self) -> None:
        self.pods: dict[str, PodInfo] = {}

    def add(self, uid: str, namespace: str, service_account: str, phase: str = "Running") -> None:
        self.pods[uid] = PodInfo(namespace, f"{service_account}-pod", uid, service_account,
                                 "node-1", phase)  # fmt: skip

    def pod_by_uid(self, uid: str) -> PodInfo | None:
        return self.pods.get(uid)


def pod_cgroup(pod_uid: str) -> str:
    """What the kubelet's systemd driver (cgroup v2) makes a container's /proc/<pid>/cgroup."""
    slice_uid = pod_uid.replace("-", "_")
    return (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{slice_uid}.slice/cri-containerd-0123abcd.scope\n"
    )


class Hosted:
    """A started server, its cache and metrics, and the loop they run on."""

    def __init__(
        self,
        loop: LoopThread,
        server: WorkloadApiServer,
        cache: SecretCache,
        metrics: AgentMetrics,
    ) -> None:
        self.loop = loop
        self.server = server
        self.cache = cache
        self.metrics = metrics

    def metric(self, name: str, **labels: str) -> float:
        return sample_value(generate_latest(self.metrics.registry).decode(), name, labels)

    @property
    def socket(self) -> Path:
        return self.server.socket_path

    def publish(self, secret: Secret) -> None:
        self.loop.run(self.cache.publish(secret))

    def stream_count(self) -> int:
        async def read() -> int:
            return self.server.stream_count

        return self.loop.run(read())


@contextmanager
def _hosted(
    server: WorkloadApiServer, cache: SecretCache, metrics: AgentMetrics
) -> Iterator[Hosted]:
    with LoopThread() as loop:
        loop.run(server.start())
        try:
            yield Hosted(loop, server, cache, metrics)
        finally:
            loop.run(server.stop(0.5))


@contextmanager
def pod_server(
    socket: Path,
    ca: TestCa,
    issued: Issued,
    *,
    max_streams: int = 1024,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> Iterator[Hosted]:
    """A pod agent's Workload API serving `issued` as `default` and `ca`'s root."""
    cache = SecretCache()
    metrics = AgentMetrics(SystemClock())

    server = WorkloadApiServer(
        cache,
        socket,
        trust_domain=ca.trust_domain,
        metrics=metrics,
        max_streams=max_streams,
        max_connections=max_connections,
    )
    with _hosted(server, cache, metrics) as hosted:
        hosted.publish(ca.root_secret())
        hosted.publish(issued.tls_secret())
        yield hosted


@contextmanager
def node_server(
    socket: Path,
    ca: TestCa,
    issued: dict[str, Issued],
    pods: PodsByUid,
    proc_root: Path,
    *,
    max_streams_per_caller: int | None = None,
    pidfd_option: int | None = None,
    before_inspect: Callable[[PeerProcess], None] | None = None,
    jwt: JwtSvidSource | None = None,
) -> Iterator[Hosted]:
    """A node agent's Workload API: each of `issued` published under its SPIFFE ID, callers
    attested through the relay against `pods` and the files under `proc_root`. `pidfd_option`
    replaces the relay's `SO_PEERPIDFD` (one the kernel does not know: the start-time way);
    `before_inspect` runs on the loop after the relay took a caller, before it is inspected.
    `jwt`: the JWT-SVIDs it serves (none: the JWT profile answers FAILED_PRECONDITION)."""
    cache = SecretCache()
    metrics = AgentMetrics(SystemClock())

    attestor = NodeAttestor(pods, ca.trust_domain, ProcessCgroups(proc_root))

    def inspect(caller: PeerProcess) -> str:
        if before_inspect is not None:
            before_inspect(caller)
        return attestor.pod_uid_of(caller)

    relay = PeerRelay(socket, inspect, socket_mode=0o666)
    if pidfd_option is not None:
        relay.pidfd_option = pidfd_option
    server = WorkloadApiServer(
        cache,
        socket,
        trust_domain=ca.trust_domain,
        callers=NodeCaller(relay, attestor),
        metrics=metrics,
        socket_mode=0o666,
        max_streams_per_caller=max_streams_per_caller,
        relay=relay,
        jwt=jwt,
    )
    with _hosted(server, cache, metrics) as hosted:
        hosted.publish(ca.root_secret())
        for spiffe_id, cert in issued.items():
            hosted.publish(TlsSecret(spiffe_id, cert.cert_pem, cert.key_pem))
        yield hosted
