"""The RPC edge of meshca's own agent report: `meshca.v1.AgentReportService/Report`.

Between renewals a meshca agent tells the CA what it holds — the same facts as the `x-meshca-*`
headers on its CSRs (`ca_server.wire`): its agent id, the digest of the trust bundle it
serves, the authorities of the leaves it serves and the kids of the JWT bundle it holds — so
coverage
(`ca_server.fleet.agent_reports`) stays fresh while nobody renews. The answer lists the tainted
authorities (with how long ago each was tainted), which is how every agent, due a renewal or not,
learns that leaves must be re-signed (`agent.rotation.RotationPolicy.taint_resign_delay` paces
that).

Admission first (`ca_server.admission`, the same per-process policy as CreateCertificate, at
the lowest priority): when the CA already has `max_in_flight_reports` requests in flight, the
report is refused at once with `UNAVAILABLE` and a `grpc-retry-pushback-ms` trailer, before
authentication costs anything (a TokenReview in Kubernetes mode), and counted as
`meshca_ca_agent_reports_total{outcome="overloaded-report"}` and
`meshca_ca_requests_shed_total{kind="report"}`. Not audited: nothing was decided about anyone.
Its authentication is advisory (`AuthnRequest.advisory`): a report whose token needs a
TokenReview gets one only from the spare API budget, else it is shed the same way
(`outcome="tokenreview-budget"`), so reports never queue ahead of CSRs at the API server either.

Authenticated exactly like CreateCertificate (the same authenticator chain: a token, or a
client certificate on the mTLS port); it never signs anything and never touches Istio's wire
(`istio.v1.auth`). Refusals: `UNAUTHENTICATED` (as CreateCertificate), `INVALID_ARGUMENT` for
a missing or malformed agent id, and for a report larger than any an agent sends: more than
`MAX_REPORT_BYTES` on the wire (refused before it is even parsed), or a field or list beyond its
cap (`check_report_size`, before any element is looked at); the message says what to fix.
The report counts for the pod the caller's credential proves, never for its agent id
(`ca_server.fleet.agent_reports`). Concurrency: as
`ca_server.service` (the completion-queue thread, then the event loop if it waits); recording
takes a lock for a dictionary update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import NoReturn

import grpc

from ca_server.admission import Admission
from ca_server.authn import AuthenticatorChain
from ca_server.errors import InvalidRequestError, OverloadedError, RequestError, clip
from ca_server.fleet import (
    MAX_AGENT_ID,
    MAX_AUTHORITY,
    MAX_DIGEST,
    MAX_JWT_KID,
    MAX_REPORTED_AUTHORITIES,
    MAX_REPORTED_JWT_KEYS,
    AgentReports,
    valid_agent_id,
)
from ca_server.metrics import CaMetrics
from ca_server.service import authn_request
from ca_server.wire import REPORT_SERVICE, RETRY_PUSHBACK_TRAILER
from meshca.clock import Clock
from meshca.grpc_services import Undecodable, add_service, lenient_decoder
from meshca_proto import report_pb2, report_pb2_grpc

log = logging.getLogger(__name__)

# An agent's report is well under 2 KiB (an id, a digest, up to 8 authority IDs and 8 JWT
# kids); four times
# that is refused before protobuf parses it.
MAX_REPORT_BYTES = 8 * 1024

TaintedSince = Callable[[], Mapping[str, datetime]]
"""The tainted authorities of the state this process signs under, and when each was tainted
(`AuthorityState.tainted_since`); empty for a plugged-in CA, which has no taint."""


def no_taints() -> Mapping[str, datetime]:
    return {}


class AgentReportService(report_pb2_grpc.AgentReportServiceServicer):
    def __init__(
        self,
        *,
        authenticators: AuthenticatorChain,
        reports: AgentReports,
        tainted_since: TaintedSince,
        metrics: CaMetrics,
        clock: Clock,
        admission: Admission,
    ) -> None:
        self._admission = admission
        self._authenticators = authenticators
        self._reports = reports
        self._tainted_since = tainted_since
        self._metrics = metrics
        self._clock = clock

    async def Report(
        self,
        request: report_pb2.AgentReportRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> report_pb2.AgentReportResponse:
        """Admission control, then the report itself (`_report`)."""
        try:
            ticket = self._admission.admit_report()
        except OverloadedError as exc:
            await self._refuse(context, exc)
        try:
            return await self._report(request, context)
        finally:
            ticket.release()

    async def _report(
        self,
        request: report_pb2.AgentReportRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> report_pb2.AgentReportResponse:
        try:
            # Advisory: refused rather than queued for the API budget CSRs need.
            caller = await self._authenticators.authenticate(
                replace(authn_request(context), advisory=True)
            )
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.reason, request.problem)
            check_report_size(request)
            if valid_agent_id(request.agent_id) is None:
                raise InvalidRequestError(
                    "agent-id-invalid",
                    f"agent_id {clip(request.agent_id)!r} is not a valid agent id: send 1-253 "
                    "letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
                )
            self._reports.record_report(
                caller,
                request.agent_id,
                request.trust_bundle_sha256,
                list(request.leaf_authorities),
                self._clock.now(),
                jwt_keys=list(request.jwt_kids),
            )
        except RequestError as exc:
            await self._refuse(context, exc)
        self._metrics.agent_reports.labels("recorded").inc()
        now = self._clock.now()
        return report_pb2.AgentReportResponse(
            tainted=[
                report_pb2.TaintedAuthority(
                    id=ident, seconds_since_taint=max(0.0, (now - at).total_seconds())
                )
                for ident, at in sorted(self._tainted_since().items())
            ]
        )

    async def _refuse(self, context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
        self._metrics.agent_reports.labels(error.reason).inc()
        if isinstance(error, OverloadedError):  # shed: by admission or for the API budget
            self._metrics.shed.labels("report").inc()
            context.set_trailing_metadata(((RETRY_PUSHBACK_TRAILER, str(error.retry_after_ms)),))
        await context.abort(error.code, error.message)
        raise AssertionError("unreachable: context.abort raises")


def check_report_size(request: report_pb2.AgentReportRequest) -> None:
    """Refuses a report with a field or list longer than any valid one, looking only at
    lengths: nothing of a too-large report is walked or matched."""
    caps = (
        ("agent_id", len(request.agent_id), MAX_AGENT_ID),
        ("trust_bundle_sha256", len(request.trust_bundle_sha256), MAX_DIGEST),
        ("leaf_authorities", len(request.leaf_authorities), MAX_REPORTED_AUTHORITIES),
        ("jwt_kids", len(request.jwt_kids), MAX_REPORTED_JWT_KEYS),
    )
    lists = ("leaf_authorities", "jwt_kids")
    for name, size, cap in caps:
        if size > cap:
            raise InvalidRequestError(
                "report-too-large",
                f"{name} holds {size} {'entries' if name in lists else 'characters'}"
                f", at most {cap} are accepted: send the agent's own report",
            )
    entries = (
        ("leaf_authorities", request.leaf_authorities, MAX_AUTHORITY, "an authority ID in hex"),
        ("jwt_kids", request.jwt_kids, MAX_JWT_KID, "a JWK thumbprint"),
    )
    for name, values, cap, what in entries:
        longest = max((len(v) for v in values), default=0)  # at most 8 lengths
        if longest > cap:
            raise InvalidRequestError(
                "report-too-large",
                f"a {name} entry holds {longest} characters, at most {cap} ({what}) are accepted",
            )


_REPORT_MESSAGE = report_pb2.AgentReportRequest.DESCRIPTOR.full_name
_decode_report: Callable[[bytes], report_pb2.AgentReportRequest | Undecodable] = lenient_decoder(
    report_pb2.AgentReportRequest
)


def decode_report(data: bytes) -> report_pb2.AgentReportRequest | Undecodable:
    """The report, or an `Undecodable` (a string field that is not UTF-8, not protobuf at all,
    or too large to parse): refused with `INVALID_ARGUMENT` after authentication, instead of
    failing inside grpc with a traceback and an `INTERNAL` the client cannot act on."""
    if len(data) > MAX_REPORT_BYTES:  # not parsed at all: a report is small
        return Undecodable(
            _REPORT_MESSAGE,
            len(data),
            f"the report is {len(data)} bytes, at most {MAX_REPORT_BYTES} are accepted: send "
            "the agent's own report (an id, a digest and at most "
            f"{MAX_REPORTED_AUTHORITIES} authority IDs)",
            reason="report-too-large",
        )
    return _decode_report(data)


def add_report_service(service: AgentReportService, server: grpc.aio.Server) -> None:
    """Like the generated `add_AgentReportServiceServicer_to_server`, with `decode_report`."""
    handler = grpc.unary_unary_rpc_method_handler(
        service.Report,
        request_deserializer=decode_report,
        response_serializer=report_pb2.AgentReportResponse.SerializeToString,
    )
    add_service(server, REPORT_SERVICE, {"Report": handler})
