"""meshca as a Pod Certificate signer on a real kube-apiserver + etcd: requests answered per
second and the time from a request's creation to its `Issued` status (issue 31, Done means 1).

Run: `.venv/bin/python -m bench.pod_certificates [--requests 1000] [--rates 0,50]
[--concurrency 8] [--workers 1]`

One control plane as production runs it (`--authorization-mode=Node,RBAC`, NodeRestriction),
one `meshca ca --pod-certificate-signer` with deploy/'s RBAC, `--requests` pods bound to one
Node, each with a `podCertificate` volume for meshca's signer and one for the baseline's. A
client playing the kubelet (`system:node:<name>`) creates one request per pod from
`--concurrency` threads, each with its own fresh ECDSA P-256 key, all at once (rate 0: the
throughput, its latency mostly the queue) or at each of `--rates` per second (the latency of an
answer at that load); a raw watch (as the admin) notes when each request's status arrives.
Times are the bench's own clock: from just before the create call to the watch event showing
the answer.

The baseline, in the same run and on the same cluster: the same requests for a second signer
name that the bench answers itself from one thread (watch, then one status update with the
resourceVersion read, a `Failed` condition and no signing) — the API server's create, watch
and status-update round trip, which no signer can beat. meshca's figures are shown beside it
and as a ratio.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes.client
from kubernetes.watch.watch import iter_resp_lines

from ca_server.kube.pod_certificates.checks import Refusal
from ca_server.kube.pod_certificates.requests import PendingRequest, request_from_json
from ca_server.kube.pod_certificates.status import refused_status, status_body
from tests.support.ca_process import CaProcess
from tests.support.kube_api_calls import POD_CERTIFICATE_SIGNER
from tests.support.kubelet_pcr import create_pcr, generate_key, outcome, stub_csr
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane, apply_deploy_rbac

NODE = "bench-node"
BASELINE_SIGNER = "bench.example.com/no-signing"


@dataclass
class Run:
    """One signer's requests: when each was sent and when its answer was seen, by request."""

    signer: str
    sent: dict[str, float] = field(default_factory=dict)  # request name -> monotonic
    answered: dict[str, tuple[float, str]] = field(default_factory=dict)  # name -> (t, outcome)

    def note(self, name: str, kind: str) -> None:
        self.answered.setdefault(name, (time.monotonic(), kind))

    def all_answered(self) -> bool:
        return all(name in self.answered for name in list(self.sent))


class StatusWatch:
    """A raw watch of PodCertificateRequests for one signer: notes each answer in `run`, and
    for the baseline answers each new request itself (`answer=True`)."""

    def __init__(self, api: kubernetes.client.ApiClient, run: Run, answer: bool) -> None:
        self._api: Any = kubernetes.client.CertificatesV1Api(api)
        self.run = run  # replaced between phases (the signer's name stays)
        self._answer = answer
        self._stop = threading.Event()
        self._response: Any = None
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._response is not None:
            self._response.shutdown()

    def _watch(self) -> None:
        version = ""
        while not self._stop.is_set():
            self._response = self._api.list_pod_certificate_request_for_all_namespaces(
                field_selector=f"spec.signerName={self.run.signer}",
                watch=True,
                resource_version=version or None,
                timeout_seconds=300,
                _preload_content=False,
            )
            try:
                for line in iter_resp_lines(self._response):
                    if not line:
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._seen(obj)
            except Exception:
                if self._stop.is_set():
                    return
                raise

    def _seen(self, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        kind = outcome(obj)
        if kind:
            self.run.note(name, kind)
            return
        if self._answer:
            request = request_from_json(obj)
            assert isinstance(request, PendingRequest)
            refusal = Refusal("Failed", "Baseline", "the bench's baseline: answered, not signed")
            body = status_body(request, refused_status(refusal, datetime.now(UTC)))
            self._api.replace_namespaced_pod_certificate_request_status(
                request.name, request.namespace, body
            )


def pod_body(namespace: str, name: str) -> dict[str, Any]:
    sources = [
        {
            "podCertificate": {
                "signerName": signer,
                "keyType": "ECDSAP256",
                "credentialBundlePath": f"{i}.pem",
            }
        }
        for i, signer in enumerate((POD_CERTIFICATE_SIGNER, BASELINE_SIGNER))
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "serviceAccountName": "app",
            "nodeName": NODE,
            "automountServiceAccountToken": False,
            "containers": [{"name": "app", "image": "example.invalid/app:1"}],
            "volumes": [{"name": "certs", "projected": {"sources": sources}}],
        },
    }


def requests_for(
    pods: list[Any], account_uid: str, node: Any, signer: str
) -> list[tuple[str, dict[str, Any]]]:
    """(pod name, request body) per pod, each with a fresh P-256 key (made before timing)."""
    bodies = []
    for pod in pods:
        csr = stub_csr(generate_key("ECDSAP256"))
        bodies.append(
            (
                pod.metadata.name,
                {
                    "apiVersion": "certificates.k8s.io/v1",
                    "kind": "PodCertificateRequest",
                    "metadata": {"namespace": pod.metadata.namespace, "generateName": "req-"},
                    "spec": {
                        "signerName": signer,
                        "podName": pod.metadata.name,
                        "podUID": pod.metadata.uid,
                        "serviceAccountName": "app",
                        "serviceAccountUID": account_uid,
                        "nodeName": NODE,
                        "nodeUID": node.metadata.uid,
                        "maxExpirationSeconds": 86400,
                        "stubPKCS10Request": base64.b64encode(csr).decode(),
                    },
                },
            )
        )
    return bodies


def drive(
    kubelet: kubernetes.client.ApiClient,
    run: Run,
    bodies: list[tuple[str, dict[str, Any]]],
    concurrency: int,
    rate: float,
    timeout: float,
) -> float:
    """Creates every request from `concurrency` threads, all at once (`rate` 0) or `rate` per
    second; returns the wall time from the first create to the last answer."""
    started = time.monotonic()
    lock = threading.Lock()
    slots = iter(range(len(bodies)))

    def create(item: tuple[str, dict[str, Any]]) -> None:
        if rate > 0:
            with lock:
                slot = next(slots)
            time.sleep(max(0.0, started + slot / rate - time.monotonic()))
        sent = time.monotonic()
        name = create_pcr(kubelet, item[1])["metadata"]["name"]
        run.sent[name] = sent

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(create, bodies))
    deadline = time.monotonic() + timeout
    while not run.all_answered():
        if time.monotonic() > deadline:
            answered = sum(1 for name in run.sent if name in run.answered)
            raise TimeoutError(f"{run.signer}: {answered} of {len(bodies)} answered")
        time.sleep(0.05)
    return max(run.answered[name][0] for name in run.sent) - started


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


@dataclass(frozen=True)
class Figures:
    name: str
    requests: int
    outcomes: dict[str, int]
    per_second: float
    p50: float
    p99: float
    worst: float

    @classmethod
    def of(cls, name: str, run: Run, wall: float) -> Figures:
        latencies = [run.answered[request][0] - sent for request, sent in run.sent.items()]
        kinds: dict[str, int] = {}
        for request in run.sent:
            kind = run.answered[request][1]
            kinds[kind] = kinds.get(kind, 0) + 1
        return cls(
            name,
            len(run.sent),
            kinds,
            len(run.answered) / wall,
            statistics.median(latencies),
            percentile(latencies, 0.99),
            max(latencies),
        )

    def line(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return (
            f"{self.name:<44} {self.requests:>5} ({kinds})  {self.per_second:8.1f}/s  "
            f"p50 {self.p50 * 1000:7.1f} ms  p99 {self.p99 * 1000:7.1f} ms  "
            f"max {self.worst * 1000:7.1f} ms"
        )


def run(options: argparse.Namespace) -> list[Figures]:
    directory = Path(tempfile.mkdtemp(prefix="bench-pcr-"))
    plane = RealControlPlane(node_authorization=True).start()
    ca: CaProcess | None = None
    watches: list[StatusWatch] = []
    kubelet = None
    try:
        ca_namespace, app = "meshca-bench", "app-bench"
        for namespace in (ca_namespace, app):
            plane.create_namespace(namespace)
        plane.create_service_account(ca_namespace, "meshca")
        plane.create_service_account(app, "app")
        apply_deploy_rbac(plane, ca_namespace, "meshca")
        kubeconfig = plane.account_kubeconfig(directory / "ca.kubeconfig", ca_namespace, "meshca")
        node = plane.ensure_node(NODE)
        uid = str(plane.core.read_namespaced_service_account("app", app).metadata.uid)
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            pods = list(
                pool.map(
                    lambda i: plane.core.create_namespaced_pod(app, pod_body(app, f"p-{i}")),
                    range(options.requests),
                )
            )
        print(f"{len(pods)} pods in {time.monotonic() - started:.1f}s", flush=True)
        ca = CaProcess(
            directory / "ca",
            *("--kubeconfig", str(kubeconfig), "--namespace", ca_namespace),
            *(
                "--pod-certificate-signer",
                POD_CERTIFICATE_SIGNER,
                "--workers",
                str(options.workers),
            ),
            *("--no-root-configmaps", "--no-istiod-tls", "--log-level", "WARNING"),
        )
        ca.start(timeout=120)
        wait_for(
            lambda: "meshca_ca_root_publisher_leader 1.0" in ca.metrics(), 60, "the CA to lead"
        )
        kubelet = plane.client_as(f"system:node:{NODE}", "system:nodes")
        watches = [
            StatusWatch(plane.admin(), Run(BASELINE_SIGNER), answer=True),
            StatusWatch(plane.admin(), Run(POD_CERTIFICATE_SIGNER), answer=False),
        ]
        for watch in watches:
            watch.start()
        time.sleep(1.0)  # both watches established before the first create
        figures = []
        for rate in options.rates:
            pace = f"{rate:g}/s" if rate > 0 else "burst"
            for label, watch in (
                ("baseline (answered, no signing)", watches[0]),
                ("meshca", watches[1]),
            ):
                current = watch.run = Run(watch.run.signer)
                bodies = requests_for(pods, uid, node, current.signer)
                wall = drive(kubelet, current, bodies, options.concurrency, rate, options.timeout)
                figures.append(Figures.of(f"{label}, {pace}", current, wall))
                print(figures[-1].line(), flush=True)
        return figures
    finally:
        for watch in watches:
            watch.stop()
        if kubelet is not None:
            kubelet.close()
        if ca is not None:
            ca.stop()
        plane.stop()
        shutil.rmtree(directory, ignore_errors=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8, help="creating threads")
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=[0.0, 50.0],
        help="requests per second, comma-separated; 0: all at once (default 0,50)",
    )
    parser.add_argument("--workers", type=int, default=1, help="meshca ca --workers")
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    figures = run(options)
    print()
    ok = True
    for baseline, signed in zip(figures[::2], figures[1::2], strict=True):
        print(baseline.line())
        print(signed.line())
        print(
            f"  meshca ÷ baseline: rate {signed.per_second / baseline.per_second:.2f}x, "
            f"p50 {signed.p50 / baseline.p50:.2f}x, p99 {signed.p99 / baseline.p99:.2f}x"
        )
        ok &= signed.outcomes == {"Issued": signed.requests}
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
