"""The Pod Certificate signer's pure rules: what is kept of a request, the key and pod checks,
the times (within the API server's bounds), and the pod cache's signer names (also over the
workers' cache socket). The real API server's verdicts on them: tests/k8s_real/
test_pod_certificates.py."""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException

from ca_server.config import TtlPolicy
from ca_server.kube.cache_client import _pod
from ca_server.kube.cache_service import pod_wire
from ca_server.kube.pod_certificates.checks import (
    POD_GRACE,
    WAIT,
    Refusal,
    request_refusal,
    stub_public_key,
)
from ca_server.kube.pod_certificates.requests import ANSWERED, PendingRequest, request_from_json
from ca_server.kube.pod_certificates.signer import PodCertificateSigner, _Signed
from ca_server.kube.pod_certificates.status import refused_status, status_body
from ca_server.kube.pod_certificates.timing import (
    MIN_LIFETIME,
    LifetimeError,
    certificate_times,
    with_not_after,
)
from ca_server.metrics import CaMetrics
from meshca.clock import FakeClock
from meshca.pods import PodInfo, pod_info_from_json
from tests.support.kubelet_pcr import generate_key, pod_body, stub_csr

SIGNER = "meshca.example.com/spiffe"
NOW = datetime(2026, 12, 6, 12, 0, 0, 500_000, tzinfo=UTC)


def raw_request(**spec: Any) -> dict[str, Any]:
    body = {
        "metadata": {
            "namespace": "shop",
            "name": "req-1",
            "uid": "r-1",
            "resourceVersion": "7",
            "creationTimestamp": "2026-12-06T11:59:58Z",
        },
        "spec": {
            "signerName": SIGNER,
            "podName": "cart-1",
            "podUID": "p-1",
            "serviceAccountName": "cart",
            "serviceAccountUID": "sa-1",
            "nodeName": "node-a",
            "nodeUID": "n-1",
            "maxExpirationSeconds": 86400,
            "stubPKCS10Request": base64.b64encode(stub_csr(generate_key("ECDSAP256"))).decode(),
            **spec,
        },
    }
    return body


def pending(**spec: Any) -> PendingRequest:
    value = request_from_json(raw_request(**spec))
    assert isinstance(value, PendingRequest)
    return value


POD = PodInfo("shop", "cart-1", "p-1", "cart", "node-a", "Running", (SIGNER,))


def test_a_request_keeps_its_claims_and_an_answered_one_is_one_shared_value() -> None:
    request = pending()
    assert (request.key, request.pod_uid, request.node_name) == (("shop", "req-1"), "p-1", "node-a")
    assert request.created == datetime(2026, 12, 6, 11, 59, 58, tzinfo=UTC)
    answered = raw_request()
    answered["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    assert request_from_json(answered) is ANSWERED
    assert pending(stubPKCS10Request="not base64!").stub_csr == b""


@pytest.mark.parametrize("key_type", ["RSA3072", "RSA4096", "ECDSAP256", "ECDSAP384"])
def test_signed_key_types_give_their_key(key_type: str) -> None:
    key = generate_key(key_type)
    found = stub_public_key(stub_csr(key))
    assert not isinstance(found, Refusal)
    assert found[0] == key.public_key()


@pytest.mark.parametrize(
    ("key_type", "named"),
    [("ECDSAP521", "secp521r1"), ("ED25519", "Ed25519"), ("RSA2048", "RSA-2048")],
)
def test_other_key_types_are_denied_naming_one_that_works(key_type: str, named: str) -> None:
    refusal = stub_public_key(stub_csr(generate_key(key_type)))
    assert isinstance(refusal, Refusal)
    assert (refusal.condition, refusal.reason) == ("Denied", "UnsupportedKeyType")
    assert named in refusal.message and "ECDSAP256" in refusal.message


def test_an_unreadable_stub_fails() -> None:
    refusal = stub_public_key(b"\x30\x00")
    assert isinstance(refusal, Refusal) and refusal.reason == "StubCSRUnreadable"


def check(request: PendingRequest, pod: PodInfo | None, account_uid: str | None = None) -> Any:
    return request_refusal(request, SIGNER, pod, account_uid, NOW)


def test_a_request_matching_its_pod_passes() -> None:
    assert check(pending(), POD) is None
    assert check(pending(), POD, account_uid="sa-1") is None


@pytest.mark.parametrize(
    ("pod", "spec", "account_uid", "reason", "says"),
    [
        (replace(POD, phase="Succeeded"), {}, None, "PodNotRunning", "has ended"),
        (POD, {"serviceAccountName": "admin"}, None, "ServiceAccountMismatch", "runs as"),
        (POD, {}, "sa-other", "ServiceAccountMismatch", "has UID sa-other"),
        (POD, {"nodeName": "node-b"}, None, "NodeMismatch", "bound to node node-a"),
        (replace(POD, pod_certificate_signers=()), {}, None, "NoPodCertificateVolume", SIGNER),
        (POD, {"signerName": "other.example/x"}, None, "WrongSigner", "other.example/x"),
    ],
)
def test_each_mismatch_fails_saying_what_differs(
    pod: PodInfo, spec: dict[str, Any], account_uid: str | None, reason: str, says: str
) -> None:
    refusal = check(pending(**spec), pod, account_uid)
    assert isinstance(refusal, Refusal)
    assert (refusal.condition, refusal.reason) == ("Failed", reason)
    assert says in refusal.message


def test_a_pod_the_cache_has_not_seen_is_waited_for_then_failed() -> None:
    young = pending()  # created 2.5 s before NOW
    assert check(young, None) is WAIT
    assert check(young, replace(POD, uid="p-0")) is WAIT  # the old pod of that name
    old = replace(young, created=NOW - POD_GRACE - timedelta(seconds=1))
    assert check(old, None).reason == "PodNotFound"
    assert check(old, replace(POD, uid="p-0")).reason == "PodUIDMismatch"


POLICY = TtlPolicy()  # 24 h default, 90 d maximum
AUTHORITY_END = NOW + timedelta(days=365)


def test_times_are_within_the_api_bounds_and_whole_seconds() -> None:
    times = certificate_times(NOW, 86400, POLICY, AUTHORITY_END, None)
    assert times.not_before.microsecond == 0 and times.not_after.microsecond == 0
    assert abs(times.not_before - NOW) <= timedelta(minutes=5)
    assert times.lifetime == timedelta(hours=24)  # the backdate counts inside the lifetime
    assert times.begin_refresh_at == times.not_before + timedelta(hours=12)
    short = certificate_times(NOW, 3600, POLICY, AUTHORITY_END, None)
    assert short.lifetime == MIN_LIFETIME
    assert short.begin_refresh_at == short.not_before + timedelta(minutes=30)


def test_refresh_comes_no_later_than_the_planned_handover() -> None:
    handover = NOW + timedelta(hours=2)
    times = certificate_times(NOW, 86400, POLICY, AUTHORITY_END, handover)
    assert times.begin_refresh_at == handover.replace(microsecond=0)
    soon = certificate_times(NOW, 86400, POLICY, AUTHORITY_END, NOW + timedelta(minutes=1))
    assert soon.begin_refresh_at == soon.not_before + timedelta(minutes=10)  # the API's floor
    past = certificate_times(NOW, 86400, POLICY, AUTHORITY_END, NOW - timedelta(hours=1))
    assert past.begin_refresh_at == past.not_before + timedelta(hours=12)  # no plan ahead


def test_no_time_fits_a_policy_or_authority_that_cannot_give_an_hour() -> None:
    tight = TtlPolicy(default=timedelta(minutes=30), maximum=timedelta(minutes=30))
    with pytest.raises(LifetimeError, match="--max-workload-cert-ttl"):
        certificate_times(NOW, 86400, tight, AUTHORITY_END, None)
    with pytest.raises(LifetimeError, match="rotate the CA"):
        certificate_times(NOW, 86400, POLICY, NOW + timedelta(minutes=30), None)
    capped = certificate_times(NOW, 86400, POLICY, NOW + timedelta(hours=3), None)
    assert capped.not_after == (NOW + timedelta(hours=3)).replace(microsecond=0)


def test_the_status_body_is_one_condition_on_the_request_as_read() -> None:
    request = pending()
    refusal = Refusal("Failed", "NodeMismatch", "pod shop/cart-1 is bound to node node-a")
    body = status_body(request, refused_status(refusal, NOW))
    assert body["metadata"]["resourceVersion"] == "7"
    assert base64.b64decode(body["spec"]["stubPKCS10Request"]) == request.stub_csr
    assert body["status"] == {
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "NodeMismatch",
                "message": refusal.message,
                "lastTransitionTime": "2026-12-06T12:00:00Z",
            }
        ]
    }


def test_the_pod_cache_keeps_the_signers_of_pod_certificate_volumes_shared() -> None:
    body = pod_body("shop", "cart-1", "cart", "node-a", SIGNER)
    body["metadata"]["uid"] = "p-1"
    body["spec"]["volumes"].append(
        {"name": "other", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
    )
    first, second = pod_info_from_json(body), pod_info_from_json(body)
    assert first.pod_certificate_signers == (SIGNER,)
    assert first.pod_certificate_signers is second.pod_certificate_signers
    assert sys.intern(SIGNER) is first.pod_certificate_signers[0]
    bare = pod_info_from_json(pod_body("shop", "cart-2", "cart", "node-a", None))
    assert bare.pod_certificate_signers == ()
    assert (
        bare.pod_certificate_signers
        is PodInfo("a", "b", "", "c", None, None).pod_certificate_signers
    )


def test_the_workers_cache_socket_carries_the_signers() -> None:
    wire = pod_wire(POD)
    assert wire is not None
    again = _pod("shop", "cart-1", wire)
    assert again == POD


# -- the status write's outcomes, with the API server's own answers --------------------------


class _StatusApi:
    """Stands in for `CertificatesV1Api` at the one call the write makes: answers each update
    with the next of `answers` (an `ApiException` is raised) and keeps the bodies sent."""

    def __init__(self, *answers: ApiException | None) -> None:
        self.answers = list(answers)
        self.sent: list[dict[str, Any]] = []

    def replace_namespaced_pod_certificate_request_status(
        self, name: str, namespace: str, body: dict[str, Any], **_: Any
    ) -> None:
        self.sent.append(body)
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer


def _refused(status: int, message: str) -> ApiException:
    body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return ApiException(status=status, reason="refused", body=body)


STALE = _refused(
    409,
    'Operation cannot be fulfilled on podcertificaterequests "req-1": the object has been modified',
)
TERMINAL = _refused(
    422,
    'PodCertificateRequest "req-1" is invalid: status: Invalid value: '
    + "x" * 400
    + ": immutable after PodCertificateRequest is issued, denied, or failed",
)
NOT_SIGNER = _refused(
    422,
    'PodCertificateRequest "req-1" is invalid: spec.signerName: Forbidden: User "meshca" is '
    f'not permitted to "sign" for signer "{SIGNER}"',
)
BAD_STATUS = _refused(422, 'PodCertificateRequest "req-1" is invalid: status.beginRefreshAt: ...')


def _signer(api: _StatusApi) -> tuple[PodCertificateSigner, CaMetrics]:
    metrics = CaMetrics()
    signer = PodCertificateSigner(
        kubernetes.client.ApiClient(),
        SIGNER,
        is_leader=lambda: True,
        pods=cast(Any, None),
        accounts=None,
        trust_domain="cluster.local",
        metrics=metrics,
        clock=FakeClock(NOW),
    )
    signer._api = api
    return signer, metrics


def _count(metrics: CaMetrics, outcome: str, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "meshca_ca_pod_certificate_requests_total", {"outcome": outcome, "reason": reason}
    )
    return value or 0.0


ISSUED = {"conditions": [{"type": "Issued"}]}


@pytest.mark.parametrize("answer", [STALE, TERMINAL], ids=["409", "422-terminal"])
def test_a_write_another_writer_won_is_a_conflict_not_an_error(answer: ApiException) -> None:
    signer, metrics = _signer(_StatusApi(answer))
    assert signer._write(pending(), ISSUED, "issued", "Issued", "spiffe://x")
    assert _count(metrics, "conflict", "Issued") == 1
    assert _count(metrics, "error", "Issued") == 0


def test_a_write_refused_for_rbac_is_an_error_retried_later_with_the_same_status() -> None:
    api = _StatusApi(NOT_SIGNER)
    signer, metrics = _signer(api)
    assert not signer._write(pending(), ISSUED, "issued", "Issued", "spiffe://x")
    assert _count(metrics, "error", "Issued") == 1
    assert len(api.sent) == 1  # no Failed written in its place: it would be refused as well


def test_a_status_the_api_server_refuses_is_replaced_by_failed() -> None:
    api = _StatusApi(BAD_STATUS, None)
    signer, metrics = _signer(api)
    assert signer._write(pending(), ISSUED, "issued", "Issued", "spiffe://x")
    assert _count(metrics, "error", "Issued") == 1
    assert _count(metrics, "failed", "SignerError") == 1
    (condition,) = api.sent[1]["status"]["conditions"]
    assert (condition["type"], condition["reason"]) == ("Failed", "SignerError")
    assert "beginRefreshAt" in condition["message"]


def test_a_written_status_is_not_answered_again_until_the_watch_shows_it() -> None:
    signer, metrics = _signer(_StatusApi(None))
    request = pending()
    assert signer._write(request, ISSUED, "issued", "Issued", "spiffe://x")
    assert (request.key, request.resource_version) in signer._written
    assert _count(metrics, "issued", "Issued") == 1
    signer._forget_answered([])  # the watch now shows it answered
    assert signer._written == set()


def test_a_leaf_cut_short_by_its_authority_gets_its_own_times() -> None:
    times = certificate_times(NOW, 86400, POLICY, AUTHORITY_END, None)
    end = times.not_before + timedelta(hours=4)
    cut = with_not_after(times, end, None)
    assert (cut.not_before, cut.not_after) == (times.not_before, end)
    assert cut.begin_refresh_at == times.not_before + timedelta(hours=2)


def test_a_failed_write_is_retried_with_the_leaf_already_signed() -> None:
    """A status whose write failed (the API server unreachable, a 5xx) is sent again as it was
    at the next pass: no second leaf for the request."""
    api = _StatusApi(_refused(503, "the server is currently unable to handle the request"), None)
    signer, metrics = _signer(api)
    request = pending()
    times = certificate_times(NOW, 86400, POLICY, AUTHORITY_END, None)
    signed = _Signed(NOW, ISSUED, "spiffe://cluster.local/ns/shop/sa/cart", "abc", times)
    signer._issue(request, signed)
    assert signer._unsent[(request.key, request.resource_version)] is signed
    assert signer._answer(request) is None  # the next pass: the same status, written now
    assert api.sent[0] == api.sent[1]
    assert signer._unsent == {}
    assert _count(metrics, "error", "Issued") == 1 and _count(metrics, "issued", "Issued") == 1
    assert [leaf.serial_hex for leaf in metrics.leaves.latest()] == ["abc"]
