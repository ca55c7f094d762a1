"""The Workload API's JWT profile: `FetchJWTSVID`, `FetchJWTBundles`, `ValidateJWTSVID`.

Served by `agent.workload.api` when the agent gets its certificates from a CA (a
`agent.jwt_svids.JwtSvidSource`); an agent serving file-mounted certificates has no CA to sign
tokens and answers FAILED_PRECONDITION, saying what to configure (`api.JWT_NOT_SERVED`).

- `FetchJWTSVID`: the caller's own identity only — the pod agent's, or in node mode the attested
  pod's (the resource the caller was resolved to, which the CA's node authorizer checks again).
  A request naming another `spiffe_id` is PERMISSION_DENIED before anything is asked of the CA;
  no audience, or a list the CA refuses, is INVALID_ARGUMENT.
- `FetchJWTBundles`: the trust domain's JWKS keyed by `spiffe://<td>`, at once and on change.
- `ValidateJWTSVID`: against the bundles the caller has (the trust domain's); a token that fails
  any check is INVALID_ARGUMENT with the check named.

The bounds of the request (`MAX_AUDIENCES`, `MAX_AUDIENCE_BYTES`, `MAX_TOKEN_BYTES`) are checked
here first, so a hostile list costs neither a CA call nor a cache entry.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import struct_pb2

from agent.errors import CaClientError, CaRequestError
from agent.jwt_svids import InvalidJwtSvid, JwtSvidSource
from certs import CertsError, SpiffeId
from meshca_proto import workload_pb2

MAX_AUDIENCES = 32
MAX_AUDIENCE_BYTES = 512
MAX_TOKEN_BYTES = 16 * 1024
# CA statuses a workload may see as they are (its own request was at fault); anything else is
# the agent's or the CA's trouble: UNAVAILABLE, try again.
_PASSED_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)


class JwtRefusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _audiences(audiences: list[str]) -> list[str]:
    if not audiences:
        raise JwtRefusal(grpc.StatusCode.INVALID_ARGUMENT, "audience must be specified")
    if len(audiences) > MAX_AUDIENCES:
        raise JwtRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(audiences)} audiences; a JWT-SVID may name at most {MAX_AUDIENCES}",
        )
    if any(not a or len(a.encode()) > MAX_AUDIENCE_BYTES for a in audiences):
        raise JwtRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"each audience must be 1 to {MAX_AUDIENCE_BYTES} bytes",
        )
    return audiences


def _attested_pod(resource: str) -> SpiffeId | None:
    """Node mode: the pod the caller was attested as (its resource is a SPIFFE URI); pod mode
    (the `default` resource): None, the agent's own identity."""
    try:
        return SpiffeId.parse(resource)
    except CertsError:
        return None


async def fetch_jwt_svid(
    source: JwtSvidSource,
    request: workload_pb2.JWTSVIDRequest,
    resource: str,
    own: SpiffeId | None,
) -> workload_pb2.JWTSVIDResponse:
    audiences = _audiences(list(request.audience))
    pod = _attested_pod(resource)
    identity = pod or own
    if request.spiffe_id and (identity is None or request.spiffe_id != identity.uri):
        raise JwtRefusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{request.spiffe_id} is not the caller's identity; a workload gets a JWT-SVID for "
            "its own identity only (leave spiffe_id empty)",
        )
    try:
        token = await source.fetch(pod, audiences)
    except CaRequestError as exc:
        code = exc.code if exc.code in _PASSED_THROUGH else grpc.StatusCode.UNAVAILABLE
        raise JwtRefusal(code, f"the CA did not sign the JWT-SVID: {exc.details}") from None
    except CaClientError as exc:
        raise JwtRefusal(grpc.StatusCode.UNAVAILABLE, f"the CA is not reachable: {exc}") from None
    return workload_pb2.JWTSVIDResponse(
        svids=[workload_pb2.JWTSVID(spiffe_id=token.spiffe_id, svid=token.token)]
    )


async def validate_jwt_svid(
    source: JwtSvidSource, request: workload_pb2.ValidateJWTSVIDRequest
) -> workload_pb2.ValidateJWTSVIDResponse:
    if not request.audience:
        raise JwtRefusal(grpc.StatusCode.INVALID_ARGUMENT, "audience must be specified")
    if not request.svid:
        raise JwtRefusal(grpc.StatusCode.INVALID_ARGUMENT, "svid must be specified")
    if len(request.svid) > MAX_TOKEN_BYTES:
        raise JwtRefusal(
            grpc.StatusCode.INVALID_ARGUMENT, f"svid is longer than {MAX_TOKEN_BYTES} bytes"
        )
    try:
        spiffe_id, claims = await source.validate(request.svid, request.audience)
    except InvalidJwtSvid as exc:
        raise JwtRefusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    struct = struct_pb2.Struct()
    struct.update(_json_safe(claims))
    return workload_pb2.ValidateJWTSVIDResponse(spiffe_id=spiffe_id, claims=struct)


def _json_safe(claims: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in claims.items() if isinstance(v, str | int | float | bool | list)}


def bundles_response(source_bundle: Any) -> workload_pb2.JWTBundlesResponse:
    return workload_pb2.JWTBundlesResponse(
        bundles={source_bundle.trust_domain_id: source_bundle.jwks}
    )
