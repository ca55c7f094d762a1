"""`meshca.v1.AgentReportService/Report` on a real `meshca ca` process: authenticated like
CreateCertificate, refuses what it cannot use with a status and a message that says what to
fix, never signs anything, counts into coverage, and answers with the tainted authorities."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.trust_bundle import bundle_digest
from certs import load_certs
from meshca_proto import report_pb2
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_client import report_channel, send_report
from tests.support.ca_process import CaProcess
from tests.support.metrics import sample_value
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # runs a CA


def _show(ca: CaProcess) -> dict[str, Any]:
    result = meshca_authority(data_dir_target(ca.data_dir), "show", "-o", "json")
    assert result.returncode == 0, result.stderr
    shown: dict[str, Any] = json.loads(result.stdout)
    return shown


def _authority(ca: CaProcess, *args: str) -> None:
    result = meshca_authority(data_dir_target(ca.data_dir), *args)
    assert result.returncode == 0, result.stderr


def test_report_is_authenticated_recorded_and_answers_the_taints(tmp_path: Path) -> None:
    ca = CaProcess(tmp_path / "data", "--ca-reload-interval", "200ms")
    ca.start()
    try:
        root = ca.root_cert_path.read_bytes()
        first = load_certs(root)[0]
        token = ca.mint_token("default", "sleep")
        good = report_pb2.AgentReportRequest(
            agent_id="node-1-0a0b0c0d",
            trust_bundle_sha256=bundle_digest([first]),
            leaf_authorities=["ab" * 20, "not hex"],
        )
        with report_channel(ca.addr, root) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                send_report(channel, good)  # no credential
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in (refused.value.details() or "")

            with pytest.raises(grpc.RpcError) as refused:
                send_report(channel, report_pb2.AgentReportRequest(), token=token)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "agent_id" in (refused.value.details() or "")

            # A string field that is not UTF-8: refused with a reason, not a grpc traceback.
            with pytest.raises(grpc.RpcError) as refused:
                send_report(channel, b"\x0a\x02\xff\xfe", token=token)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not decode" in (refused.value.details() or "")

            answer = send_report(channel, good, token=token)
            assert list(answer.tainted) == []

            wait_for(lambda: _show(ca)["authorities"][0]["agents_reporting"] == 1, 10, "counted")
            assert _show(ca)["authorities"][0]["agents_trusting"] == 1
            metrics = ca.metrics()
            assert (
                sample_value(metrics, "meshca_ca_agent_reports_total", {"outcome": "recorded"}) == 1
            )
            assert sample_value(metrics, "citadel_server_csr_count") == 0  # nothing signed

            _authority(ca, "prepare")
            _authority(ca, "activate")
            old = _show(ca)["authorities"][-1]["id"]
            _authority(ca, "taint", old)

            def tainted() -> list[report_pb2.TaintedAuthority]:
                return list(send_report(channel, good, token=token).tainted)

            wait_for(lambda: len(tainted()) == 1, 10, "the taint in the answer")
            (only,) = tainted()
            assert only.id == old and 0 <= only.seconds_since_taint < 30
    finally:
        ca.stop()
    assert "Traceback" not in ca.log()
