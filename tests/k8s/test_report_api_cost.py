"""What agent reports cost the API server (issue 12): N agents x M reports in steady state.

Each agent (a pod with its own projected token, a real JWT the fake API server also knows for
TokenReview) opens its own connection, as an agent does, and reports M times. Authentication is
the only per-report work that could reach the API server:
- `--token-validation offline`: not one call (keys already fetched, bound pod from the informer);
- `--token-validation tokenreview`: at most one TokenReview per distinct token per worker (the
  verified-token cache), so N agents cost N reviews per worker however often they report.
The CA's own background rounds (`--ca-reload-interval`: the replica ConfigMap it publishes the
reports in, the list of its peers') run whatever the reports do: they are bounded by the rounds
that fit in the measured time, not by the number of reports, and asserted as such."""

from __future__ import annotations

import time

import grpc
import pytest

from meshca_proto import report_pb2
from tests.support.ca_client import report_channel, send_report
from tests.support.kube_api import KubeApiServer
from tests.support.kube_mode import CaFactory, issue, spiffe
from tests.support.metrics import sample_value

AGENTS = 20
REPORTS_EACH = 10
WORKERS = 2
ROUND = 0.5  # seconds between the CA's background rounds
# Calls one background round may make (secret fingerprint, ledger save, peers' list; a spare).
CALLS_PER_ROUND = 4


@pytest.mark.parametrize("mode", ["offline", "tokenreview"])
def test_reports_cost_no_api_call_offline_and_one_review_per_token_and_worker(
    mode: str, kube_api: KubeApiServer, kube_ca: CaFactory
) -> None:
    kube_api.create_namespace("shop")
    tokens = []
    for index in range(AGENTS):
        pod = f"cart-{index}"
        kube_api.create_pod("shop", pod, service_account="cart", node_name="node-a")
        tokens.append(
            kube_api.issue_service_account_token(
                "shop", "cart", audiences=["istio-ca"], pod_name=pod
            )
        )
    ca = kube_ca(
        "ca-0",
        "--no-root-configmaps",
        "--token-validation",
        mode,
        "--workers",
        str(WORKERS),
        "--ca-reload-interval",
        f"{ROUND * 1000:.0f}ms",
    )
    time.sleep(2 * ROUND)  # past start-up's one-off calls (issuer keys, first lists, watches)
    kube_api.reset_counts()

    started = time.monotonic()
    for index, token in enumerate(tokens):
        with report_channel(ca.addr, ca.root_cert_path.read_bytes()) as channel:
            for _ in range(REPORTS_EACH):
                request = report_pb2.AgentReportRequest(agent_id=f"agent-{index}")
                assert list(send_report(channel, request, token=token).tainted) == []
    elapsed = time.monotonic() - started
    calls = {key: n for key, n in kube_api.request_counts().items() if key[0] != "watch"}

    reviews = calls.pop(("create", "tokenreviews"), 0)
    if mode == "offline":
        assert reviews == 0
    else:
        assert AGENTS <= reviews <= AGENTS * WORKERS, reviews
    # Nothing else scales with the reports: no key fetch, no pod lookup; only the rounds.
    per_report = {key: n for key, n in calls.items() if key[1] not in ("configmaps", "secrets")}
    assert per_report == {}, per_report
    rounds = elapsed / ROUND + 2
    assert sum(calls.values()) <= WORKERS * CALLS_PER_ROUND * rounds, (calls, elapsed)
    assert sum(calls.values()) < AGENTS * REPORTS_EACH / 4, calls

    recorded = sample_value(ca.metrics(), "meshca_ca_agent_reports_total", {"outcome": "recorded"})
    assert recorded == AGENTS * REPORTS_EACH


def test_a_report_never_spends_the_review_budget_certificates_need(
    kube_api: KubeApiServer, kube_ca: CaFactory
) -> None:
    """TokenReviews at 0.05/s with a burst of 4: reports with tokens new to the CA take the
    two spare ones, the third is shed (UNAVAILABLE, a hint, no review made) rather than queue;
    two CSRs with new tokens then get their reviews at once (waiting for a slot would take 20 s,
    past their deadline). A report whose token is already verified costs nothing and is
    answered."""
    kube_api.create_namespace("shop")
    tokens = [
        kube_api.issue_service_account_token("shop", "cart", audiences=["istio-ca"])
        for _ in range(5)
    ]
    ca = kube_ca(
        "ca-0",
        "--no-root-configmaps",
        "--token-validation",
        "tokenreview",
        "--kube-qps",
        "0.05",
        "--kube-burst",
        "4",
    )
    with report_channel(ca.addr, ca.root_cert_path.read_bytes()) as channel:

        def report(token: str) -> None:
            send_report(channel, report_pb2.AgentReportRequest(agent_id="a-1"), token=token)

        report(tokens[0])
        report(tokens[1])
        assert kube_api.tokenreview_count == 2
        with pytest.raises(grpc.RpcError) as shed:
            report(tokens[2])
        assert shed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "TokenReview" in (shed.value.details() or "")
        hint = dict(shed.value.trailing_metadata() or ())["grpc-retry-pushback-ms"]
        assert 50 <= int(hint) <= 30_000
        assert kube_api.tokenreview_count == 2

        for token in tokens[3:]:
            started = time.monotonic()
            assert len(issue(ca, token, spiffe("shop", "cart"))) == 2
            assert time.monotonic() - started < 5
        assert kube_api.tokenreview_count == 4

        report(tokens[3])  # verified by its CSR: no budget needed
        assert kube_api.tokenreview_count == 4

    metrics = ca.metrics()
    outcome = {"outcome": "tokenreview-budget"}
    assert sample_value(metrics, "meshca_ca_agent_reports_total", outcome) == 1
    assert sample_value(metrics, "meshca_ca_agent_reports_total", {"outcome": "recorded"}) == 3
    assert sample_value(metrics, "meshca_ca_requests_shed_total", {"kind": "report"}) == 1
