"""The RPC edge: `istio.v1.auth.IstioCertificateService/CreateCertificate`.

This is the only place where internal errors become gRPC statuses, metrics and audit lines.
Concurrency: `async def`, run by `ca_server.serving.cq_server` inline on its completion-queue
thread until it awaits something that is not ready or is about to start I/O (the authenticators
then move it with `loop_handoff.to_the_loop`), then on the CA's event loop (or entirely on the loop
with `--rpc-server aio`); every step is CPU-light (one ECDSA/RSA signature), and
blocking I/O (JWKS URL fetch) is pushed to threads by the authenticators.
Admission control (`ca_server.admission`) runs first: a request beyond the in-flight limit is
refused with `UNAVAILABLE` and a `grpc-retry-pushback-ms` trailer before any work is done.
"""

from __future__ import annotations

import logging
from datetime import datetime

import grpc
from cryptography import x509
from google.protobuf import struct_pb2

from ca_server.admission import Admission, is_renewal
from ca_server.authn import AuthenticatorChain, AuthnRequest, Caller
from ca_server.authority import Signer
from ca_server.authz import authorize_csr
from ca_server.config import AdmissionPolicy, TtlPolicy
from ca_server.errors import (
    AuthenticationError,
    CacheSyncingError,
    CaUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestError,
)
from ca_server.fleet import MAX_AGENT_ID, REPORT_HEADERS, AgentReports, IssuedLeaf
from ca_server.impersonation import ImpersonationPolicy
from ca_server.metrics import CaMetrics
from ca_server.ttl import grant_validity
from ca_server.wire import IMPERSONATED_IDENTITY, RETRY_PUSHBACK_TRAILER
from certs import CertsError, SpiffeId, load_certs, load_verified_csr
from meshca.clock import Clock
from meshca.grpc_services import Undecodable
from meshca.logs import audit
from meshca_proto import ca_pb2, ca_pb2_grpc

log = logging.getLogger(__name__)

# The request's headers as gRPC hands them over: (key, value) pairs, binary values as bytes.
Metadata = tuple[tuple[str, str | bytes], ...]
MAX_REPORT_HEADER = MAX_AGENT_ID  # the longest valid report header value (an agent id)


class CertificateService(ca_pb2_grpc.IstioCertificateServiceServicer):
    def __init__(
        self,
        *,
        authenticators: AuthenticatorChain,
        impersonation: ImpersonationPolicy,
        signer: Signer,
        ttl_policy: TtlPolicy,
        metrics: CaMetrics,
        clock: Clock,
        admission: Admission | None = None,
        agent_reports: AgentReports | None = None,
    ) -> None:
        self._agent_reports = agent_reports
        self._admission = admission or Admission(AdmissionPolicy(), clock.monotonic)
        self._authenticators = authenticators
        self._impersonation = impersonation
        self._signer = signer
        self._ttl_policy = ttl_policy
        self._metrics = metrics
        self._clock = clock

    @property
    def authenticators(self) -> AuthenticatorChain:
        """Shared with the agent report (`ca_server.report_service`): same callers, same rules."""
        return self._authenticators

    async def CreateCertificate(
        self,
        request: ca_pb2.IstioCertificateRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> ca_pb2.IstioCertificateResponse:
        """Admission control, then the request itself (`_create_certificate`)."""
        # Read once: each `invocation_metadata()` call converts gRPC's metadata anew.
        metadata: Metadata = tuple(context.invocation_metadata() or ())
        renewal = is_renewal(metadata)
        try:
            ticket = self._admission.admit(renewal=renewal)
        except OverloadedError as exc:
            self._metrics.csr_requests.inc()
            self._metrics.shed.labels("renewal" if renewal else "first").inc()
            await self._refuse(context, exc, None, context.peer())
            raise AssertionError("unreachable: context.abort raises") from exc
        in_flight = self._metrics.in_flight
        in_flight.inc()
        try:
            return await self._create_certificate(request, context, metadata)
        finally:
            in_flight.dec()
            ticket.release()

    async def _create_certificate(
        self,
        request: ca_pb2.IstioCertificateRequest | Undecodable,
        context: grpc.aio.ServicerContext,
        metadata: Metadata,
    ) -> ca_pb2.IstioCertificateResponse:
        started = self._clock.monotonic()
        self._metrics.csr_requests.inc()
        caller: Caller | None = None
        peer = context.peer()
        try:
            caller = await self._authenticators.authenticate(authn_request(context, metadata))
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.reason, request.problem)
            identity = await self._identity_for(caller, request.metadata)
            csr, csr_key = load_verified_csr(request.csr)
            public_key = authorize_csr(csr, identity, public_key=csr_key)
            now = self._clock.now()
            validity = grant_validity(
                request.validity_duration,
                self._ttl_policy,
                ca_not_after=self._signer.authority.not_after,
                now=now,
            )
            issued = self._signer.sign(public_key, identity, validity, csr=csr)
        except CertsError as exc:
            await self._refuse(context, InvalidRequestError("csr-invalid", str(exc)), caller, peer)
            raise AssertionError("unreachable: context.abort raises") from exc
        except RequestError as exc:
            await self._refuse(context, exc, caller, peer)
            raise AssertionError("unreachable: context.abort raises") from exc
        except Exception as exc:
            log.exception("signing failed")
            error = CaUnavailableError("internal", f"the CA failed to sign: {type(exc).__name__}")
            await self._refuse(context, error, caller, peer)
            raise AssertionError("unreachable: context.abort raises") from exc
        self._metrics.issued.inc()
        self._metrics.issuance_latency.observe(self._clock.monotonic() - started)
        self._metrics.granted_ttl.observe(validity.granted.total_seconds())
        serial = format(issued.serial, "x")
        not_after = issued.not_after
        self._record_report(metadata, caller, identity, issued.issuer_key_id, now)
        self._metrics.leaves.record(IssuedLeaf(identity.uri, serial, now, not_after))
        audit(
            "issued",
            outcome="issued",
            identity=identity.uri,
            caller=caller.subject,
            authenticator=caller.authenticator,
            serial=serial,
            requested_ttl_seconds=validity.requested.total_seconds()
            if validity.requested
            else None,
            granted_ttl_seconds=int(validity.granted.total_seconds()),
            not_after=not_after.isoformat(),
            clamped_by=validity.clamped_by,
            peer=peer,
        )
        return ca_pb2.IstioCertificateResponse(cert_chain=issued.cert_chain)

    def _record_report(
        self,
        metadata: Metadata,
        caller: Caller,
        identity: SpiffeId,
        leaf_authority: str | None,
        now: datetime,
    ) -> None:
        """Notes what an agent says it trusts (`ca_server.fleet.agent_reports`), only once its
        request was authenticated, authorized and signed: a refused request records nothing,
        and the entry is the caller's own pod whatever its headers say; `leaf_authority` is the
        new leaf's `issuer_key_id`. Never refuses; a value
        longer than any valid one is dropped before it is looked at."""
        if self._agent_reports is None:
            return
        headers = {
            key.lower(): value
            for key, value in metadata
            if isinstance(value, str)
            and len(value) <= MAX_REPORT_HEADER
            and key.lower() in REPORT_HEADERS
        }
        issued_by = leaf_authority if headers else None
        self._agent_reports.record_csr(
            caller,
            headers,
            issued_by or "",
            sole_leaf=identity == caller.identity,  # not a node agent impersonating a pod
            now=now,
        )

    async def _identity_for(self, caller: Caller, metadata: struct_pb2.Struct) -> SpiffeId:
        """The caller's own identity, or the one a trusted node agent impersonates."""
        fields = metadata.fields if metadata is not None else {}
        if IMPERSONATED_IDENTITY not in fields:
            return caller.identity
        requested = fields[IMPERSONATED_IDENTITY].string_value
        try:
            target = SpiffeId.parse(requested)
        except CertsError as exc:
            raise AuthenticationError(
                "impersonation-invalid", f"{IMPERSONATED_IDENTITY} metadata: {exc}"
            ) from exc
        await self._impersonation.authorize(caller, target)
        return target

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        error: RequestError,
        caller: Caller | None,
        peer: str,
    ) -> None:
        if isinstance(error, AuthenticationError):
            self._metrics.authn_failures.labels(error.reason).inc()
        elif isinstance(error, OverloadedError):  # shedding load is not a signing error
            context.set_trailing_metadata(((RETRY_PUSHBACK_TRAILER, str(error.retry_after_ms)),))
        else:
            self._metrics.sign_errors.labels(error.reason).inc()
            if isinstance(error, CacheSyncingError):
                hint = str(error.retry_after_ms)
                context.set_trailing_metadata(((RETRY_PUSHBACK_TRAILER, hint),))
        self._metrics.denials.labels(error.reason, error.code.name).inc()
        audit_refusal("denied", error, caller, peer)
        await context.abort(error.code, error.message)


def audit_refusal(event: str, error: RequestError, caller: Caller | None, peer: str) -> None:
    """The audit line of a refused request (`CreateCertificate`'s `denied`, and the JWT-SVID
    service's): what was refused, why, and who asked, as far as authentication got."""
    audit(
        event,
        outcome="denied",
        code=error.code.name,
        reason=error.reason,
        detail=error.message,
        caller=caller.subject if caller else None,
        identity=caller.identity.uri if caller else None,
        peer=peer,
    )


# Headers that decide who the caller is: one value each, or the request is ambiguous.
_SINGLE_VALUED_HEADERS = ("authorization", "clusterid")


def authn_request(
    context: grpc.aio.ServicerContext, metadata: Metadata | None = None
) -> AuthnRequest:
    """The headers authenticators look at (from `metadata` when the caller has already read the
    context's). Two `authorization` (or `clusterid`) headers are refused: which one a proxy or
    library honours differs (Istio takes the first bearer token, a dict the last), so a forged
    token placed beside a valid one must not be read either way."""
    if metadata is None:
        metadata = tuple(context.invocation_metadata() or ())
    headers: dict[str, str] = {}
    for key, value in metadata:
        if not isinstance(value, str):
            continue
        name = key.lower()
        if name in headers and name in _SINGLE_VALUED_HEADERS:
            raise AuthenticationError(
                "ambiguous-credentials",
                f"request carries more than one {name!r} header; send exactly one",
            )
        headers[name] = value
    return AuthnRequest(headers=headers, peer_chain=_peer_chain(context))


def _peer_chain(context: grpc.aio.ServicerContext) -> tuple[x509.Certificate, ...]:
    """The client's certificate, then what it sent after it, when it connected with one (mTLS
    port). On the server side gRPC's auth context holds the leaf alone in `x509_pem_cert` and
    only the certificates sent *after* it in `x509_pem_cert_chain` (OpenSSL's peer chain
    without the peer's own certificate), so the leaf is always `x509_pem_cert`; a repeat of it
    in the chain is dropped. Which of the rest build the path is `certs.build_path`'s job."""
    auth = context.auth_context()
    leaf_pem = b"".join(auth.get("x509_pem_cert") or [])
    if not leaf_pem:
        return ()
    chain_pem = b"".join(auth.get("x509_pem_cert_chain") or [])
    try:
        leaf = load_certs(leaf_pem, what="client certificate")[0]
        rest = load_certs(chain_pem, what="client certificate chain") if chain_pem else []
    except CertsError:
        return ()
    return (leaf, *(cert for cert in rest if cert != leaf))
