"""Real bound tokens: the API server's TokenReview, a CA reviewing tokens (`--token-validation
tokenreview`) and a CA validating them offline (`offline`: issuer keys from /openid/v1/jwks, pod
and ServiceAccount informers) must give the same verdict on every token case (issue 23, Done
means 3).

Tokens come from the TokenRequest API, bound to real pods, as kubelet asks for them. Cases the
TokenRequest API cannot produce (a token issued an hour ago, or not valid before an hour from
now) are the server's own token with those claims changed and signed again with the issuer's
key under its key id — the API server is the judge of them too. The API server's own verdict is
asserted first, so a case that does not test what it says fails instead of passing vacuously.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.k8s_real.conftest import make_account, unique
from tests.support.ca_process import CaProcess
from tests.support.kube_mode import issue, spiffe
from tests.support.processes import wait_for
from tests.support.real_kube import RealControlPlane

AUDIENCE = "istio-ca"
NAMESPACE = "tokens"


@dataclass
class Cas:
    tokenreview: CaProcess
    offline: CaProcess


@pytest.fixture(scope="module")
def cas(control_plane: RealControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cas]:
    """Two CAs as one ServiceAccount with deploy/'s RBAC: one per validation mode."""
    directory = tmp_path_factory.mktemp("tokens")
    account = make_account(control_plane, directory)
    control_plane.create_namespace(NAMESPACE)
    common = (
        "--kubeconfig",
        str(account.kubeconfig),
        "--namespace",
        account.namespace,
        "--no-root-configmaps",
    )
    review = CaProcess(directory / "review", *common, "--instance-id", "review")
    offline = CaProcess(
        directory / "offline", *common, "--instance-id", "offline", "--token-validation", "offline"
    )
    try:
        review.start()
        offline.start()
        yield Cas(review, offline)
    finally:
        review.stop()
        offline.stop()
        account.rbac.delete(control_plane)


@dataclass(frozen=True)
class Presented:
    token: str
    identity: str
    # True when the case changed cluster state after issuing the token: the offline CA learns
    # of it from its watch, a moment later.
    state_changed: bool = False


def _account_and_pod(plane: RealControlPlane) -> tuple[str, object]:
    account = unique("sa")
    plane.create_service_account(NAMESPACE, account)
    pod = plane.create_pod(NAMESPACE, unique("pod"), account)
    return account, pod


def _pod_token(plane: RealControlPlane, audiences: tuple[str, ...] = (AUDIENCE,)) -> Presented:
    account, pod = _account_and_pod(plane)
    token = plane.request_token(NAMESPACE, account, audiences=audiences, pod=pod)
    return Presented(token, spiffe(NAMESPACE, account))


def valid(plane: RealControlPlane) -> Presented:
    return _pod_token(plane)


def valid_among_audiences(plane: RealControlPlane) -> Presented:
    return _pod_token(plane, ("https://vault.example", AUDIENCE))


def wrong_audience(plane: RealControlPlane) -> Presented:
    return _pod_token(plane, ("https://vault.example",))


def expired(plane: RealControlPlane) -> Presented:
    presented = _pod_token(plane)
    now = plane.now()
    changes = {"iat": now - 7200, "nbf": now - 7200, "exp": now - 3600}
    return Presented(plane.resign(presented.token, changes), presented.identity)


def not_yet_valid(plane: RealControlPlane) -> Presented:
    presented = _pod_token(plane)
    now = plane.now()
    changes = {"iat": now + 3600, "nbf": now + 3600, "exp": now + 7200}
    return Presented(plane.resign(presented.token, changes), presented.identity)


def other_issuers_key(plane: RealControlPlane) -> Presented:
    presented = _pod_token(plane)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Presented(plane.resign(presented.token, {}, key_pem=pem), presented.identity)


def other_issuer_claim(plane: RealControlPlane) -> Presented:
    presented = _pod_token(plane)
    changed = plane.resign(presented.token, {"iss": "https://oidc.other-cluster.example"})
    return Presented(changed, presented.identity)


def tampered_payload(plane: RealControlPlane) -> Presented:
    """Another account's name put into a genuine token, the signature left as it was."""
    presented = _pod_token(plane)
    header, payload, signature = presented.token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["sub"] = f"system:serviceaccount:{NAMESPACE}:admin"
    claims["kubernetes.io"]["serviceaccount"]["name"] = "admin"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return Presented(f"{header}.{forged}.{signature}", spiffe(NAMESPACE, "admin"))


def unsigned(plane: RealControlPlane) -> Presented:
    presented = _pod_token(plane)
    _, payload, _ = presented.token.split(".")
    header = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').rstrip(b"=").decode()
    return Presented(f"{header}.{payload}.", presented.identity)


PROBE_AUDIENCE = "meshca-test-probe"


def _changed_state(plane: RealControlPlane, change: Callable[[str, Any], None]) -> Presented:
    """A pod-bound token, then `change(account, pod)` made to the objects it names.

    The API server judges a bound token against its informer caches (the ServiceAccount and
    Pod listers first, a live read only on a miss) and remembers a successful review for 10 s
    (kube-apiserver's token success cache), so a DELETE that has returned is not yet what
    TokenReview sees. A second token bound to the same objects, never shown to anyone else,
    is reviewed until the API server refuses it: from then on its caches hold the change, and
    the presented token, reviewed by nobody so far, gets a verdict on the state the case
    names. Reviewing the presented token itself while waiting would put a stale success in
    that 10 s cache."""
    account, pod = _account_and_pod(plane)
    token = plane.request_token(NAMESPACE, account, audiences=(AUDIENCE,), pod=pod)
    probe = plane.request_token(NAMESPACE, account, audiences=(PROBE_AUDIENCE,), pod=pod)
    # The probe is good before the change (else the wait below proves nothing), asked with an
    # audience list of its own: the success cache is keyed by token and audiences.
    assert plane.token_review(probe, [PROBE_AUDIENCE, "unused"]).authenticated
    change(account, pod)
    wait_for(
        lambda: not plane.token_review(probe, [PROBE_AUDIENCE]).authenticated,
        30,
        "the API server's TokenReview to see the change",
    )
    return Presented(token, spiffe(NAMESPACE, account), state_changed=True)


def deleted_pod(plane: RealControlPlane) -> Presented:
    return _changed_state(
        plane, lambda account, pod: plane.delete_pod(NAMESPACE, pod.metadata.name)
    )


def recreated_pod(plane: RealControlPlane) -> Presented:
    """The pod deleted and created again under its name: the token names the old uid."""

    def recreate(account: str, pod: Any) -> None:
        plane.delete_pod(NAMESPACE, pod.metadata.name)
        plane.create_pod(NAMESPACE, pod.metadata.name, account)

    return _changed_state(plane, recreate)


def deleted_service_account(plane: RealControlPlane) -> Presented:
    """The account deleted while its pod keeps running."""
    return _changed_state(
        plane, lambda account, pod: plane.delete_service_account(NAMESPACE, account)
    )


def recreated_service_account(plane: RealControlPlane) -> Presented:
    """The account deleted and created again under its name (a new uid)."""

    def recreate(account: str, pod: Any) -> None:
        plane.delete_service_account(NAMESPACE, account)
        plane.create_service_account(NAMESPACE, account)

    return _changed_state(plane, recreate)


# (case, token maker, accepted). Every case: the API server, the TokenReview CA and the
# offline CA all give this verdict.
AGREED: list[tuple[str, Callable[[RealControlPlane], Presented], bool]] = [
    ("valid", valid, True),
    ("valid-among-audiences", valid_among_audiences, True),
    ("wrong-audience", wrong_audience, False),
    ("expired", expired, False),
    ("not-yet-valid", not_yet_valid, False),
    ("other-issuers-key", other_issuers_key, False),
    ("other-issuer-claim", other_issuer_claim, False),
    ("tampered-payload", tampered_payload, False),
    ("unsigned", unsigned, False),
    ("deleted-pod", deleted_pod, False),
    ("recreated-pod", recreated_pod, False),
    ("deleted-service-account", deleted_service_account, False),
    ("recreated-service-account", recreated_service_account, False),
]


def _issued(ca: CaProcess, presented: Presented) -> tuple[bool, str]:
    try:
        chain = issue(ca, presented.token, presented.identity)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (error.code(), error.details())
        return False, str(error.details())
    assert len(chain) == 2
    return True, ""


@pytest.mark.parametrize(("case", "make", "accepted"), AGREED, ids=[c[0] for c in AGREED])
def test_offline_and_tokenreview_agree(
    control_plane: RealControlPlane,
    cas: Cas,
    case: str,
    make: Callable[[RealControlPlane], Presented],
    accepted: bool,
):
    presented = make(control_plane)

    verdict = control_plane.token_review(presented.token, [AUDIENCE])
    assert bool(verdict.authenticated) is accepted, (case, verdict.error)

    reviewed, review_detail = _issued(cas.tokenreview, presented)
    assert reviewed is accepted, (case, review_detail)

    if presented.state_changed and not accepted:
        # The offline CA's informer hears of the deletion through its watch.
        wait_for(lambda: not _issued(cas.offline, presented)[0], 10, f"offline CA to refuse {case}")
    offline, offline_detail = _issued(cas.offline, presented)
    assert offline is accepted, (case, offline_detail)


def test_a_token_bound_to_no_pod_is_accepted_only_by_tokenreview(
    control_plane: RealControlPlane, cas: Cas
):
    """The documented difference (ca_server/kube/bound_tokens.py, docs/kubernetes.md): offline
    validation accepts only pod-bound tokens; TokenReview accepts a pod-less one too."""
    account = unique("sa")
    control_plane.create_service_account(NAMESPACE, account)
    presented = Presented(
        control_plane.request_token(NAMESPACE, account, audiences=(AUDIENCE,)),
        spiffe(NAMESPACE, account),
    )
    assert control_plane.token_review(presented.token, [AUDIENCE]).authenticated
    assert _issued(cas.tokenreview, presented) == (True, "")
    offline, detail = _issued(cas.offline, presented)
    assert not offline
    assert "not bound to a pod" in detail


def test_issuer_keys_come_from_the_servers_jwks(control_plane: RealControlPlane, cas: Cas):
    """The offline CA verified with the key the API server publishes (not a configured one):
    its kid is the one in /openid/v1/jwks, and the CA read that document from the server."""
    request = urllib.request.Request(f"{control_plane.url}/openid/v1/jwks")
    with urllib.request.urlopen(request, context=control_plane.ssl_context(), timeout=5) as r:
        jwks = json.loads(r.read())
    presented = _pod_token(control_plane)
    assert jwt.get_unverified_header(presented.token)["kid"] in {k["kid"] for k in jwks["keys"]}
    assert _issued(cas.offline, presented) == (True, "")
