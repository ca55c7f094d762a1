"""A real meshca CA served in-process: the production `CertificateService`, authenticators and
signer on the CA's RPC server with TLS on a free loopback port — the suite's one in-process CA.

Hostile cases need hundreds of requests and the CA's own view of each one (metrics, audit
lines); a child process per case would cost seconds, this costs milliseconds. Two ways to run
it, one harness:

- `with InProcessCa(tmp) as ca:` serves on a background loop; requests go over real gRPC + TLS
  with the plain synchronous client (`ca.call(...)`), as an attacker's would;
- `async with InProcessCa(...) as ca:` serves on the test's own loop, for tests that hold
  requests inside the CA and watch its state from that loop (admission control).

A test hands in what it varies (authenticators, impersonation policy, authority, admission, a
plaintext port, grpc.aio's server, more services on the same port) and reads `ca.metrics` and
the audit lines. `refused` is the one check every refusal case ends with: the exact status,
nothing issued (metric and audit), the refusal audited and counted, and the CA still serving a
valid request afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from ca_server.admission import Admission
from ca_server.authn import AuthenticatorChain
from ca_server.authority.signer import LocalSigner
from ca_server.config import CaConfig, JwtIssuerConfig
from ca_server.impersonation import DenyImpersonation, ImpersonationPolicy
from ca_server.metrics import CaMetrics
from ca_server.request_decoding import add_certificate_service
from ca_server.server import build_authenticators
from ca_server.service import CertificateService
from ca_server.serving.cq_server import rpc_server_for
from ca_server.serving.tls import ServingTls
from certs import (
    SigningAuthority,
    SpiffeId,
    build_csr,
    generate_private_key,
    new_self_signed_authority,
)
from meshca.clock import SystemClock
from meshca.logs import AUDIT_LOGGER
from meshca_proto import ca_pb2, ca_pb2_grpc
from tests.support.ca_process import RPC_SERVER_ENV
from tests.support.loop import LoopThread
from tests.support.token_issuer import K8S_ISSUER, make_rsa_issuer

SLEEP = SpiffeId("cluster.local", "default", "sleep")
KID = "k8s-key-1"


class AuditCapture(logging.Handler):
    """Collects the `meshca.audit` records' fields (the JSON line's content) in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(getattr(record, "audit", {}) or {})
        # Serialised as the real formatter does: a field that cannot be written is a bug.
        json.dumps(fields, default=str)
        self.lines.append({"msg": record.getMessage(), **fields})


class InProcessCa:
    """`with InProcessCa(tmp) as ca:` — a serving CA; `ca.call(...)` sends one request."""

    def __init__(
        self,
        directory: Path | None = None,
        *,
        impersonation: ImpersonationPolicy | None = None,
        authenticators: AuthenticatorChain | None = None,
        authority: SigningAuthority | None = None,
        mtls: bool = False,
        admission: Admission | None = None,
        tls: bool = True,
        rpc_server: str | None = None,
        add_services: Callable[[InProcessCa, grpc.aio.Server], None] | None = None,
    ) -> None:
        """`directory`: where its files go (default: a temporary one, removed at the end);
        `authority`: what it signs with (default: a new self-signed root); `mtls`: also serve
        the renewal port where a client certificate is required (`--mtls-listen`), at
        `mtls_addr`; `admission`: its admission control (default: the CA's default policy);
        `tls=False`: a plaintext port instead; `rpc_server`: `--rpc-server`'s choice (default:
        `MESHCA_TEST_RPC_SERVER`, else `auto`); `add_services(ca, server)`: adds more services
        to the same server before it starts."""
        self._owned_directory: tempfile.TemporaryDirectory[str] | None = None
        if directory is None:
            self._owned_directory = tempfile.TemporaryDirectory(prefix="mcca-")
            directory = Path(self._owned_directory.name)
        self.directory = directory
        self.issuer = make_rsa_issuer(directory, KID)
        self.config = CaConfig(
            data_dir=directory / "data",
            listen="127.0.0.1:0",
            jwt_issuers=(JwtIssuerConfig(K8S_ISSUER, str(self.issuer.jwks_path)),),
            trust_dev_issuer=False,
        )
        self.clock = SystemClock()
        self.metrics = CaMetrics()
        self.config.data_dir.mkdir(parents=True)
        self.authority = authority or new_self_signed_authority(
            self.config.root_key,
            self.config.trust_domain,
            now=self.clock.now(),
            lifetime=self.config.root_lifetime,
        )
        self.root_pem = self.authority.root_bundle_pem.encode()
        self.signer = LocalSigner(self.authority)
        self.authenticators = authenticators or build_authenticators(
            self.config, self.signer, self.clock
        )
        self.service = CertificateService(
            authenticators=self.authenticators,
            impersonation=impersonation or DenyImpersonation(),
            signer=self.signer,
            ttl_policy=self.config.ttl,
            metrics=self.metrics,
            clock=self.clock,
            admission=admission,
        )
        self.audit = AuditCapture()
        self._loop: LoopThread | None = None  # with `with`: the background loop it serves on
        self._server: grpc.aio.Server | None = None
        self._mtls = mtls
        self._tls = tls
        # The server `meshca ca` runs (`MESHCA_TEST_RPC_SERVER` picks the other path).
        self._rpc_server = rpc_server or os.environ.get(RPC_SERVER_ENV) or "auto"
        self._add_services = add_services
        self.addr = ""
        self.port = 0
        self.mtls_addr = ""

    def __enter__(self) -> InProcessCa:
        """Serves on a background loop."""
        self._loop = LoopThread().__enter__()
        try:
            self._loop.run(self.__aenter__())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None:
            self._loop.run(self.__aexit__())
            self._loop.stop()
            self._loop = None

    async def __aenter__(self) -> InProcessCa:
        """Serves on the running loop."""
        logging.getLogger(AUDIT_LOGGER).addHandler(self.audit)
        logging.getLogger(AUDIT_LOGGER).setLevel(logging.INFO)
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        logging.getLogger(AUDIT_LOGGER).removeHandler(self.audit)
        if self._owned_directory is not None:
            self._owned_directory.cleanup()

    async def _start(self) -> None:
        server = rpc_server_for(
            self._rpc_server, [("grpc.max_receive_message_length", 1024 * 1024)]
        )
        add_certificate_service(self.service, server)
        if self._add_services is not None:
            self._add_services(self, server)
        if self._tls:
            tls = ServingTls(self.config, self.signer, self.clock, require_client_cert=False)
            port = server.add_secure_port("127.0.0.1:0", tls.credentials())
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        if self._mtls:  # as `ca_server.server` does for `--mtls-listen`
            mtls = ServingTls(self.config, self.signer, self.clock, require_client_cert=True)
            self.mtls_addr = (
                f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', mtls.credentials())}"
            )
        await server.start()
        self._server = server
        self.port = port
        self.addr = f"127.0.0.1:{port}"

    # -- observing ---------------------------------------------------------------------------

    def issued_count(self) -> float:
        value = self.metrics.registry.get_sample_value("meshca_ca_certificates_issued_total")
        return value or 0.0

    def denials(self, reason: str | None = None) -> float:
        total = 0.0
        for metric in self.metrics.registry.collect():
            for sample in metric.samples:
                if sample.name == "meshca_ca_denials_total" and (
                    reason is None or sample.labels.get("reason") == reason
                ):
                    total += sample.value
        return total

    def issued_lines(self) -> list[dict[str, Any]]:
        return [line for line in self.audit.lines if line["msg"] == "issued"]

    def denied_lines(self) -> list[dict[str, Any]]:
        return [line for line in self.audit.lines if line["msg"] == "denied"]

    # -- calling -----------------------------------------------------------------------------

    @contextmanager
    def channel(self) -> Iterator[grpc.Channel]:
        credentials = grpc.ssl_channel_credentials(root_certificates=self.root_pem)
        options = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(self.addr, credentials, options=options) as channel:
            yield channel

    def call(
        self,
        csr: str | None = None,
        *,
        token: str | None = None,
        headers: Sequence[tuple[str, str | bytes]] = (),
        metadata: dict[str, Any] | None = None,
        ttl_seconds: int = 0,
        raw_request: bytes | None = None,
        timeout: float = 10,
    ) -> list[str]:
        """CreateCertificate; returns `cert_chain` or raises `grpc.RpcError`. `raw_request`
        sends those bytes as the request body (for requests the stub could not encode)."""
        call_headers: list[tuple[str, str | bytes]] = list(headers)
        if token is not None:
            call_headers.append(("authorization", f"Bearer {token}"))
        with self.channel() as channel:
            if raw_request is not None:
                method = channel.unary_unary(
                    "/istio.v1.auth.IstioCertificateService/CreateCertificate",
                    request_serializer=None,
                    response_deserializer=ca_pb2.IstioCertificateResponse.FromString,
                )
                response = method(raw_request, metadata=call_headers, timeout=timeout)
            else:
                request = ca_pb2.IstioCertificateRequest(
                    csr=csr if csr is not None else good_csr(), validity_duration=ttl_seconds
                )
                if metadata:
                    struct = struct_pb2.Struct()
                    struct.update(metadata)
                    request.metadata.CopyFrom(struct)
                stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
                response = stub.CreateCertificate(request, metadata=call_headers, timeout=timeout)
        return list(response.cert_chain)

    def valid_request_succeeds(self) -> bool:
        chain = self.call(good_csr(), token=self.issuer.token("default", "sleep"))
        return bool(chain) and "BEGIN CERTIFICATE" in chain[0]


def good_csr(identity: SpiffeId = SLEEP) -> str:
    return build_csr(generate_private_key(), identity)


def utc_now() -> datetime:
    return datetime.now(UTC)


def refused(
    ca: InProcessCa,
    send: Callable[[], object],
    code: grpc.StatusCode,
    fragment: str,
    *,
    reason: str | None = None,
    max_details: int = 1200,
) -> str:
    """Runs `send` and checks it was refused with `code`, a message containing `fragment`, no
    certificate issued, one denial audited (and counted, with `reason` if given), and that the
    CA still issues to a valid request. Returns the status message."""
    issued_before = ca.issued_count()
    issued_lines_before = len(ca.issued_lines())
    denied_before = len(ca.denied_lines())
    denials_before = ca.denials()
    with pytest.raises(grpc.RpcError) as info:
        send()
    error = info.value
    details = error.details() or ""
    assert error.code() == code, f"{error.code()}: {details[:300]}"
    assert fragment.lower() in details.lower(), details[:300]
    assert len(details) <= max_details, f"message of {len(details)} characters"
    assert ca.issued_count() == issued_before
    assert len(ca.issued_lines()) == issued_lines_before
    new_denials = ca.denied_lines()[denied_before:]
    assert len(new_denials) == 1, new_denials
    assert new_denials[0]["code"] == code.name
    assert all(len(str(value)) <= max_details for value in new_denials[0].values())
    assert ca.denials() == denials_before + 1
    if reason is not None:
        assert new_denials[0]["reason"] == reason, new_denials[0]
    assert ca.valid_request_succeeds()
    assert ca.issued_count() == issued_before + 1
    return details
