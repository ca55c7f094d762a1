"""The committed stubs must be exactly what `proto/generate.sh` produces from `ca.proto`, and the
descriptor must carry Istio's wire names and numbers (docs/reference.md#ca-api)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from meshca_proto import ca_pb2

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
STUBS = [
    "ca_pb2.py",
    "ca_pb2_grpc.py",
    "ca_pb2.pyi",
    "report_pb2.py",
    "report_pb2_grpc.py",
    "report_pb2.pyi",
    "jwt_svid_pb2.py",
    "jwt_svid_pb2_grpc.py",
    "jwt_svid_pb2.pyi",
    "workload_pb2.py",
    "workload_pb2.pyi",
]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory, starts_processes: None) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(PROTO_DIR / "generate.sh"), str(out)],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out / "meshca_proto"


@pytest.mark.parametrize("name", STUBS)
def test_committed_stub_is_up_to_date(regenerated: Path, name: str) -> None:
    fresh = (regenerated / name).read_bytes()
    committed = (PROTO_DIR / "meshca_proto" / name).read_bytes()
    assert committed == fresh, (
        f"proto/meshca_proto/{name} is stale: run proto/generate.sh and commit the result"
    )


def test_service_and_method_names() -> None:
    file = ca_pb2.DESCRIPTOR
    assert file.package == "istio.v1.auth"
    service = file.services_by_name["IstioCertificateService"]
    assert service.full_name == "istio.v1.auth.IstioCertificateService"
    assert [m.name for m in service.methods] == ["CreateCertificate"]
    method = service.methods_by_name["CreateCertificate"]
    assert method.input_type.full_name == "istio.v1.auth.IstioCertificateRequest"
    assert method.output_type.full_name == "istio.v1.auth.IstioCertificateResponse"
    assert not method.client_streaming and not method.server_streaming


def test_request_field_numbers_and_types() -> None:
    fields = ca_pb2.IstioCertificateRequest.DESCRIPTOR.fields_by_name
    assert set(fields) == {"csr", "validity_duration", "metadata"}
    assert fields["csr"].number == 1
    assert fields["csr"].type == FieldDescriptor.TYPE_STRING
    assert fields["validity_duration"].number == 3
    assert fields["validity_duration"].type == FieldDescriptor.TYPE_INT64
    assert fields["metadata"].number == 4
    assert fields["metadata"].message_type.full_name == "google.protobuf.Struct"
    assert 2 not in ca_pb2.IstioCertificateRequest.DESCRIPTOR.fields_by_number


def test_response_field() -> None:
    fields = ca_pb2.IstioCertificateResponse.DESCRIPTOR.fields_by_name
    assert set(fields) == {"cert_chain"}
    cert_chain = fields["cert_chain"]
    assert cert_chain.number == 1
    assert cert_chain.type == FieldDescriptor.TYPE_STRING
    assert cert_chain.is_repeated


def test_workload_api_messages_match_the_spiffe_specification() -> None:
    """Field names, numbers and types of the SPIFFE Workload API, as py-spiffe's own stubs
    (the real client's) carry them: a mismatch would make every SPIFFE client misread."""
    from spiffe._proto import workload_pb2 as spiffe_pb2

    from meshca_proto import workload_pb2

    ours, theirs = workload_pb2.DESCRIPTOR, spiffe_pb2.DESCRIPTOR
    assert set(ours.message_types_by_name) == set(theirs.message_types_by_name)
    for name, message in theirs.message_types_by_name.items():
        fields = {f.name: (f.number, f.type, f.is_repeated) for f in message.fields}
        mine = ours.message_types_by_name[name]
        assert {f.name: (f.number, f.type, f.is_repeated) for f in mine.fields} == fields, name
    (service,) = theirs.services_by_name.values()
    mine_service = ours.services_by_name[service.name]
    assert service.full_name == "SpiffeWorkloadAPI"  # unpackaged: it is the gRPC path
    for method in service.methods:
        other = mine_service.methods_by_name[method.name]
        assert (other.input_type.name, other.output_type.name, other.server_streaming) == (
            method.input_type.name,
            method.output_type.name,
            method.server_streaming,
        )


def test_wire_encoding_round_trip() -> None:
    request = ca_pb2.IstioCertificateRequest(csr="pem", validity_duration=3600)
    request.metadata.update({"ImpersonatedIdentity": "spiffe://cluster.local/ns/a/sa/b"})
    data = request.SerializeToString()
    assert data.startswith(b"\x0a\x03pem")  # field 1, length-delimited
    assert b"\x18\x90\x1c" in data  # field 3, varint 3600
    parsed = ca_pb2.IstioCertificateRequest.FromString(data)
    assert parsed == request
