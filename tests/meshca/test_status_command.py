"""`meshca status` without daemons: CA rates from two readings, the tables' edge cases, and
`--watch` riding out a daemon that does not answer. (Against real daemons:
tests/e2e/test_status.py.)"""

from __future__ import annotations

import argparse
import io
from datetime import timedelta

from meshca.commands.status import CLEAR_SCREEN, add_arguments, run
from meshca.commands.status_fetch import Snapshot, parse_counters
from meshca.commands.status_render import ca_rates, render_agent, render_slots
from tests.support.processes import free_port

EXPOSITION = """\
# TYPE meshca_ca_csr_requests counter
meshca_ca_csr_requests_total {requests}
# TYPE meshca_ca_certificates_issued counter
meshca_ca_certificates_issued_total {issued}
# TYPE meshca_ca_denials counter
meshca_ca_denials_total{{code="PERMISSION_DENIED",reason="csr-identity-mismatch"}} {denied}
# TYPE meshca_ca_requests_in_flight gauge
meshca_ca_requests_in_flight 2
"""


def ca_snapshot(taken_at: float, requests: int, issued: int, denied: int) -> Snapshot:
    document = {"started": "2030-01-01T00:00:00+00:00", "now": "2030-01-01T00:01:40+00:00"}
    exposition = EXPOSITION.format(requests=requests, issued=issued, denied=denied)
    return Snapshot("ca", document, parse_counters(exposition), taken_at)


def test_ca_rates_since_start_then_over_the_last_interval() -> None:
    first = ca_snapshot(1000.0, requests=300, issued=200, denied=100)
    rates = ca_rates(first, None)  # 100 s since the CA started
    assert rates["over"] == "since start" and rates["window_seconds"] == 100
    assert rates["requests"] == {"total": 300, "per_second": 3.0}
    assert rates["issued"] == {"total": 200, "per_second": 2.0}
    assert rates["in_flight"] == 2
    assert rates["refusals"] == [
        {
            "reason": "csr-identity-mismatch",
            "code": "PERMISSION_DENIED",
            "total": 100,
            "per_second": 1.0,
        }
    ]
    second = ca_snapshot(1004.0, requests=340, issued=236, denied=104)
    rates = ca_rates(second, first)  # 4 s later
    assert rates["over"] == "last interval" and rates["window_seconds"] == 4
    assert rates["requests"]["per_second"] == 10.0
    assert rates["issued"]["per_second"] == 9.0
    assert rates["refusals"][0]["per_second"] == 1.0


def test_an_agent_serving_nothing_yet_says_so() -> None:
    assert render_agent({"secrets": []}) == "the agent serves no secrets yet"


def test_failing_and_pending_rows_show_the_error_and_no_certificate() -> None:
    pending = {
        "resource_name": "spiffe://cluster.local/ns/shop/sa/cart",
        "type": None,
        "status": "PENDING",
        "valid": False,
        "serial": None,
        "not_before": None,
        "not_after": None,
        "time_left_seconds": None,
        "next_rotation": None,
        "consecutive_failures": 4,
        "last_error": "PERMISSION_DENIED: not on this node",
    }
    expired = {
        **pending,
        "resource_name": "default",
        "type": "cert_chain",
        "status": "EXPIRED",
        "serial": "1f",
        "not_before": "2030-01-01T00:00:00+00:00",
        "not_after": "2030-01-01T01:00:00+00:00",
        "time_left_seconds": -5.0,
        "consecutive_failures": 0,
        "last_error": None,
    }
    lines = render_agent({"secrets": [pending, expired]}).splitlines()
    assert lines[1].split()[:4] == [pending["resource_name"], "-", "PENDING", "false"]
    assert lines[1].endswith("(4 in a row) PERMISSION_DENIED: not on this node")
    assert "EXPIRED" in lines[2].split()[7:] and "2030-01-01T01:00:00Z" in lines[2]


def test_watch_keeps_redrawing_while_nothing_answers() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--watch", "--interval", "10ms", f"127.0.0.1:{free_port()}"])
    assert args.interval == timedelta(milliseconds=10)
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt  # Ctrl-C

    out = io.StringIO()
    assert run(args, out, sleep) == 0
    frames = out.getvalue().split(CLEAR_SCREEN)[1:]
    assert len(frames) == 3 and naps == [0.01] * 3
    assert all("cannot reach" in frame and "(retrying)" in frame for frame in frames)


def test_a_ca_without_slots_says_why_and_unreadable_figures_show_as_unknown() -> None:
    plugged = {"authorities": None, "agents_unknown": None, "coverage": None}
    assert "plugged-in CA" in render_slots(plugged) and "--cacerts-dir" in render_slots(plugged)

    row = {
        "id": "ab" * 20,
        "state": "active",
        "tainted": True,
        "not_before": "2030-01-01T00:00:00+00:00",
        "not_after": "2031-01-01T00:00:00+00:00",
        "issuer": "CN=meshca root",
        "live_leaves": "unknown",
        "agents_trusting": "unknown",
        "agents_reporting": "unknown",
        "agents_serving": "unknown",
    }
    unread = {
        "authorities": [row],
        "agents_unknown": "unknown",
        "coverage": {
            "agents_reporting": "unknown",
            "agents_unknown": "unknown",
            "reports_left_out": "unknown",
            "authorities": [],
        },
    }
    lines = render_slots(unread).splitlines()
    assert lines[2].split() == [
        row["id"], "active", "yes", row["not_before"], row["not_after"], "unknown",
        "unknown/unknown", "unknown", "CN=meshca", "root",
    ]  # fmt: skip
    assert lines[-1] == "coverage: unknown agents reporting, unknown callers without a report " + (
        "(not counted)"
    )

    partial = {
        **unread,
        "coverage": {
            "agents_reporting": 4,
            "agents_unknown": 0,
            "reports_left_out": 7,
            "authorities": [
                {"id": row["id"], "state": "active", "agents_trusting": 1, "fraction": 0.25}
            ],
        },
    }
    coverage = render_slots(partial).splitlines()[-2:]
    assert coverage[0].endswith("7 reports did not fit in the published reports: a lower bound")
    assert coverage[1].split() == ["active", row["id"], "trusted", "by", "1/4", "(25%)"]
