"""The RPC edge of JWT-SVIDs: `meshca.v1.JwtSvidService` (`MintJwtSvid`, `FetchJwtBundle`).

Authenticated exactly like `CreateCertificate`: the same authenticator chain (client
certificate, JWKS issuers, the cluster's tokens) and the same impersonation policy (a node agent
may ask for a pod on its node, the node authorizer decides). The token's `sub` is what that
decided — never a value the caller chose; the audience list is the only claim it names, bounded
by `minting.checked_audiences`. Errors become gRPC statuses here only, with an audit line; a
token is never logged (only its `jti`-free facts: identity, kid, expiry).

Concurrency: as `ca_server.service` (handlers may start on the completion-queue thread; the
authenticators move to the loop when they wait); signing is one ECDSA/RSA signature.
"""

from __future__ import annotations

import logging

import grpc

from ca_server.admission import Admission
from ca_server.authn import AuthenticatorChain, Caller
from ca_server.errors import (
    AuthenticationError,
    CaUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestError,
)
from ca_server.impersonation import ImpersonationPolicy
from ca_server.jwt_svid.driver import JwtAuthority
from ca_server.jwt_svid.minting import checked_audiences
from ca_server.service import audit_refusal, authn_request
from ca_server.wire import JWT_SVID_SERVICE, RETRY_PUSHBACK_TRAILER
from certs import CertsError, SpiffeId
from meshca.grpc_services import Undecodable, add_service, lenient_decoder
from meshca.logs import audit
from meshca_proto import jwt_svid_pb2

log = logging.getLogger(__name__)


class JwtSvidService:
    def __init__(
        self,
        *,
        authority: JwtAuthority,
        authenticators: AuthenticatorChain,
        impersonation: ImpersonationPolicy,
        admission: Admission,
        trust_domain: str,
    ) -> None:
        self._authority = authority
        self._authenticators = authenticators
        self._impersonation = impersonation
        self._admission = admission
        self._trust_domain_id = f"spiffe://{trust_domain}"

    async def MintJwtSvid(
        self,
        request: jwt_svid_pb2.MintJwtSvidRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> jwt_svid_pb2.MintJwtSvidResponse:
        caller: Caller | None = None
        try:
            ticket = self._admission.admit(renewal=False)
        except OverloadedError as exc:
            await _refuse(context, exc, None)
            raise AssertionError("unreachable: context.abort raises") from exc
        try:
            caller = await self._authenticators.authenticate(authn_request(context))
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.reason, request.problem)
            audiences = checked_audiences(tuple(request.audience))
            identity = await self._identity_for(caller, request.impersonated_identity)
            minted = self._authority.mint(identity, audiences)
        except RequestError as exc:
            await _refuse(context, exc, caller)
            raise AssertionError("unreachable: context.abort raises") from exc
        except Exception as exc:
            log.exception("JWT-SVID signing failed")
            error = CaUnavailableError("internal", f"the CA failed to sign: {type(exc).__name__}")
            await _refuse(context, error, caller)
            raise AssertionError("unreachable: context.abort raises") from exc
        finally:
            ticket.release()
        audit(
            "jwt-svid-issued",
            outcome="issued",
            identity=minted.spiffe_id,
            caller=caller.subject,
            kid=minted.kid,
            audiences=len(audiences),
            expires_at=minted.expires_at.isoformat(),
        )
        return jwt_svid_pb2.MintJwtSvidResponse(
            token=minted.token,
            spiffe_id=minted.spiffe_id,
            expires_at=int(minted.expires_at.timestamp()),
            issued_at=int(minted.issued_at.timestamp()),
        )

    async def _identity_for(self, caller: Caller, requested: str) -> SpiffeId:
        if not requested:
            return caller.identity
        try:
            target = SpiffeId.parse(requested)
        except CertsError as exc:
            raise AuthenticationError(
                "impersonation-invalid", f"impersonated_identity: {exc}"
            ) from exc
        if target == caller.identity:
            return target
        await self._impersonation.authorize(caller, target)
        return target

    async def FetchJwtBundle(
        self,
        request: jwt_svid_pb2.JwtBundleRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> jwt_svid_pb2.JwtBundleResponse:
        """The bundle is public (the discovery endpoint serves it to anyone), but this RPC
        answers authenticated callers only, like every other on the CA's port."""
        try:
            await self._authenticators.authenticate(authn_request(context))
        except RequestError as exc:
            await _refuse(context, exc, None)
            raise AssertionError("unreachable: context.abort raises") from exc
        state = self._authority.state
        return jwt_svid_pb2.JwtBundleResponse(
            jwks=self._authority.jwks,
            tainted_kids=state.tainted_kids(),
            trust_domain_id=self._trust_domain_id,
        )


async def _refuse(
    context: grpc.aio.ServicerContext, error: RequestError, caller: Caller | None
) -> None:
    if isinstance(error, OverloadedError):
        context.set_trailing_metadata(((RETRY_PUSHBACK_TRAILER, str(error.retry_after_ms)),))
    audit_refusal("jwt-svid-denied", error, caller, context.peer())
    await context.abort(error.code, error.message)


def add_jwt_svid_service(service: JwtSvidService, server: grpc.aio.Server) -> None:
    """Like a generated `add_..._to_server`, with undecodable requests answered clearly."""
    pb = jwt_svid_pb2
    add_service(
        server,
        JWT_SVID_SERVICE,
        {
            "MintJwtSvid": grpc.unary_unary_rpc_method_handler(
                service.MintJwtSvid,
                request_deserializer=lenient_decoder(pb.MintJwtSvidRequest),
                response_serializer=pb.MintJwtSvidResponse.SerializeToString,
            ),
            "FetchJwtBundle": grpc.unary_unary_rpc_method_handler(
                service.FetchJwtBundle,
                request_deserializer=lenient_decoder(pb.JwtBundleRequest),
                response_serializer=pb.JwtBundleResponse.SerializeToString,
            ),
        },
    )
