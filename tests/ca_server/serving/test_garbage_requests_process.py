"""Bytes that are not a request, to every method a real `meshca ca` serves, on both RPC servers.

The CA's port carries its own services (CreateCertificate, the agent report), which decode
leniently and refuse after authenticating, and grpcio's health and reflection services, which
anyone may call. Before, garbage to `Health/Check`, `Health/Watch` or `ServerReflectionInfo`
logged an ERROR and an 8-9 line traceback per request, answered `UNKNOWN` (grpc.aio) or
`INTERNAL` (completion-queue `Check`). Each server must answer the same status for the same
garbage, log no traceback and no ERROR, say it once per peer (per minute: the time side is
tests/ca_server/serving/test_endpoints.py), and go on serving.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from certs import SpiffeId, build_csr, generate_private_key
from tests.support.ca_client import ca_stub, create_certificate, report_channel
from tests.support.ca_process import CaProcess

pytestmark = pytest.mark.process  # runs a CA per server

GARBAGE = b"\xff\xff\xff\xff"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
CREATE = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
REPORT = "/meshca.v1.AgentReportService/Report"
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def refusal(channel: grpc.Channel, method: str, token: str | None = None) -> grpc.StatusCode:
    headers = [("authorization", f"Bearer {token}")] if token else []
    with pytest.raises(grpc.RpcError) as refused:
        if method == WATCH:
            list(channel.unary_stream(method)(GARBAGE, metadata=headers, timeout=10))
        elif method == REFLECTION:
            list(channel.stream_stream(method)(iter([GARBAGE]), metadata=headers, timeout=10))
        else:
            channel.unary_unary(method)(GARBAGE, metadata=headers, timeout=10)
    code: grpc.StatusCode = refused.value.code()
    return code


@pytest.mark.parametrize("rpc_server", ["completion-queue", "aio"])
def test_garbage_to_every_method_gets_one_status_on_both_servers(tmp_path: Path, rpc_server: str):
    ca = CaProcess(tmp_path / "data", "--rpc-server", rpc_server)
    ca.start()
    try:
        root = ca.root_cert_path.read_bytes()
        token = ca.mint_token("default", "sleep")
        with report_channel(ca.addr, root) as channel:
            answers = {
                "CreateCertificate, anonymous": refusal(channel, CREATE),
                "CreateCertificate": refusal(channel, CREATE, token),
                "Report, anonymous": refusal(channel, REPORT),
                "Report": refusal(channel, REPORT, token),
                **{
                    f"{method} #{attempt}": refusal(channel, method)
                    for attempt in range(3)
                    for method in (CHECK, WATCH, REFLECTION)
                },
            }
            stub = health_pb2_grpc.HealthStub(channel)
            serving = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert answers == {
            "CreateCertificate, anonymous": UNAUTHENTICATED,
            "CreateCertificate": INVALID,
            "Report, anonymous": UNAUTHENTICATED,
            "Report": INVALID,
            **{
                f"{method} #{attempt}": INVALID
                for attempt in range(3)
                for method in (CHECK, WATCH, REFLECTION)
            },
        }
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        csr = build_csr(generate_private_key(), SpiffeId("cluster.local", "default", "sleep"))
        with ca_stub(ca.addr, root) as ca_service:
            assert create_certificate(ca_service, csr, token=token)
    finally:
        ca.stop()
    log = ca.log()
    assert "Traceback" not in log, log
    assert " ERROR " not in log, log
    # Nine refusals of health and reflection from one peer within a minute: one line.
    assert log.count("refused an undecodable request") == 1, log
