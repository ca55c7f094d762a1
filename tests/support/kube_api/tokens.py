"""TokenReview: a table of known bearer tokens standing in for the API server's authenticator.

meshca's CA authenticates workloads by sending their service-account JWTs to TokenReview, so the
fake must reproduce what that code branches on: ``authenticated``, ``user`` (with the pod-bound
``extra`` keys), the audience intersection, and an ``error`` string on rejection.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError, bad_request

POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
CREDENTIAL_ID_KEY = "authentication.kubernetes.io/credential-id"
# What a real cluster's --api-audiences usually is; used when a review names no audiences.
DEFAULT_API_AUDIENCES = ("https://kubernetes.default.svc.cluster.local",)


@dataclass
class TokenInfo:
    """Who a token authenticates as, and for which audiences."""

    username: str
    uid: str = ""
    groups: list[str] = field(default_factory=list)
    extra: dict[str, list[str]] = field(default_factory=dict)
    audiences: list[str] = field(default_factory=lambda: list(DEFAULT_API_AUDIENCES))
    # Unix time after which the token is rejected as expired; None = never.
    expires_at: float | None = None

    def user(self) -> dict[str, Any]:
        user: dict[str, Any] = {"username": self.username}
        if self.uid:
            user["uid"] = self.uid
        if self.groups:
            user["groups"] = list(self.groups)
        if self.extra:
            user["extra"] = copy.deepcopy(self.extra)
        return user


class TokenAuthority:
    """Thread-safe token table plus the TokenReview decision logic."""

    def __init__(self, api_audiences: Sequence[str] = DEFAULT_API_AUDIENCES) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, TokenInfo] = {}
        self.api_audiences = list(api_audiences)

    def add(
        self,
        token: str,
        username: str,
        *,
        uid: str = "",
        groups: Iterable[str] = (),
        extra: Mapping[str, Iterable[str]] | None = None,
        audiences: Iterable[str] | None = None,
        expires_at: float | None = None,
    ) -> TokenInfo:
        """Register (or replace) a token. ``audiences=None`` means the API server audiences."""
        info = TokenInfo(
            username=username,
            uid=uid,
            groups=list(groups),
            extra={k: list(v) for k, v in (extra or {}).items()},
            audiences=list(audiences) if audiences is not None else list(self.api_audiences),
            expires_at=expires_at,
        )
        with self._lock:
            self._tokens[token] = info
        return info

    def add_service_account(
        self,
        token: str,
        namespace: str,
        service_account: str,
        *,
        audiences: Iterable[str] | None = None,
        pod_name: str | None = None,
        pod_uid: str | None = None,
        sa_uid: str | None = None,
        expires_at: float | None = None,
    ) -> TokenInfo:
        """Register a (pod-bound, if ``pod_name`` is given) service-account token.

        The user info matches what kube-apiserver returns for a projected SA token.
        """
        extra: dict[str, list[str]] = {CREDENTIAL_ID_KEY: [f"JTI={uuid.uuid4()}"]}
        if pod_name is not None:
            extra[POD_NAME_KEY] = [pod_name]
            extra[POD_UID_KEY] = [pod_uid or str(uuid.uuid4())]
        return self.add(
            token,
            f"system:serviceaccount:{namespace}:{service_account}",
            uid=sa_uid or str(uuid.uuid4()),
            groups=[
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
            extra=extra,
            audiences=audiences,
            expires_at=expires_at,
        )

    def remove(self, token: str) -> None:
        """Revoke a token (e.g. its pod was deleted)."""
        with self._lock:
            self._tokens.pop(token, None)

    def get(self, token: str) -> TokenInfo | None:
        with self._lock:
            return self._tokens.get(token)

    def review(self, body: Any) -> dict[str, Any]:
        """Answer a TokenReview create request with the request echoed back plus ``status``."""
        if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
            raise bad_request("TokenReview body must have a spec")
        spec = body["spec"]
        token = spec.get("token")
        if not token:
            raise ApiError(
                422,
                "Invalid",
                'TokenReview.authentication.k8s.io "" is invalid: spec.token: Required value: '
                "token must not be empty",
                kind="TokenReview",
                group="authentication.k8s.io",
            )
        requested = list(spec.get("audiences") or [])
        wanted = requested or self.api_audiences
        info = self.get(token)
        status: dict[str, Any]
        if info is None:
            status = self._denied("invalid bearer token, token lookup failed")
        elif info.expires_at is not None and time.time() >= info.expires_at:
            status = self._denied("invalid bearer token, service account token has expired")
        else:
            common = [aud for aud in wanted if aud in info.audiences]
            if not common:
                status = self._denied(
                    f"invalid bearer token, token audiences {info.audiences} is invalid for the "
                    f"target audiences {wanted}"
                )
            else:
                status = {"authenticated": True, "user": info.user(), "audiences": common}
        return {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": copy.deepcopy(spec),
            "status": status,
        }

    @staticmethod
    def _denied(message: str) -> dict[str, Any]:
        return {"authenticated": False, "user": {}, "error": f"[{message}]"}
