"""`meshca ca --workers 2` in Kubernetes mode: each worker is a replica sharing the root through
Secret `istio-ca-secret`, with its own name in the root-publisher Lease, and both issue."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from ca_server.kube.leader import DEFAULT_LEASE_NAME
from ca_server.kube.secret_root import SECRET_NAME
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, assert_verifies, issue, spiffe
from tests.support.metrics import sample_value
from tests.support.processes import wait_for


def _children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def test_workers_are_replicas_sharing_the_secret_root(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.add_service_account_token("cart-token", "default", "cart", audiences=["istio-ca"])
    ca = kube_ca("ca-0", "--workers", "2", "--no-istiod-tls")  # the root's is the one Secret
    assert ca.proc is not None
    workers = _children(ca.proc.pid)
    assert len(workers) == 2

    secret = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    root = base64.b64decode(secret["data"]["root-cert.pem"])
    secrets = kube_api.list("secrets", namespace=CA_NAMESPACE)  # the root's and the JWT keys'
    assert sorted(s["metadata"]["name"] for s in secrets) == ["istio-ca-secret", "meshca-jwt-keys"]
    for _ in range(16):  # a new connection each time: the kernel picks a worker per connection
        chain = issue(ca, "cart-token", spiffe("default", "cart"))
        assert chain[-1].encode() == root
        assert_verifies(chain, root)
    audit = [json.loads(line) for line in ca.log().splitlines() if line.startswith("{")]
    assert {line["pid"] for line in audit if line["outcome"] == "issued"} == workers

    # Each worker has its own name in the API server's eyes (Lease holder, user agent).
    agents = {record.user_agent or "" for record in kube_api.requests()}
    assert any("ca-0-w0" in agent for agent in agents), agents
    assert any("ca-0-w1" in agent for agent in agents), agents
    # One of them holds the root-publisher Lease; the supervisor reports it once.
    wait_for(
        lambda: sample_value(ca.metrics(), "meshca_ca_root_publisher_leader") == 1,
        20,
        "a worker to lead",
    )
    lease = kube_api.get("leases", DEFAULT_LEASE_NAME, namespace=CA_NAMESPACE)
    assert lease["spec"]["holderIdentity"] in {"ca-0-w0", "ca-0-w1"}
