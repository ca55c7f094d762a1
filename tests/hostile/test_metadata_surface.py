"""Headers and metadata: credential smuggling and impersonation (issue #11 item 1: two
`authorization` headers, a forged one and a valid one, were authenticated with the last)."""

from __future__ import annotations

import grpc
import pytest

from tests.support.inprocess_ca import InProcessCa, good_csr, refused

UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def _forged(hostile_ca: InProcessCa) -> str:
    return hostile_ca.issuer.token("kube-system", "admin")[:-8] + "AAAAAAAA"


@pytest.mark.parametrize("order", ["forged first", "valid first"])
def test_two_authorization_headers_are_refused(hostile_ca: InProcessCa, order: str) -> None:
    valid = f"Bearer {hostile_ca.issuer.token('default', 'sleep')}"
    forged = f"Bearer {_forged(hostile_ca)}"
    pair = [forged, valid] if order == "forged first" else [valid, forged]
    headers = [("authorization", value) for value in pair]
    refused(
        hostile_ca,
        lambda: hostile_ca.call(good_csr(), headers=headers),
        UNAUTH,
        "more than one 'authorization' header",
        reason="ambiguous-credentials",
    )


def test_the_same_valid_token_twice_is_still_ambiguous(hostile_ca: InProcessCa) -> None:
    token = hostile_ca.issuer.token("default", "sleep")
    headers = [("authorization", f"Bearer {token}")] * 2
    refused(
        hostile_ca, lambda: hostile_ca.call(good_csr(), headers=headers), UNAUTH, "more than one"
    )


def test_two_clusterid_headers_are_refused(hostile_ca: InProcessCa) -> None:
    headers = [("clusterid", "Kubernetes"), ("clusterid", "other")]
    refused(
        hostile_ca,
        lambda: hostile_ca.call(
            good_csr(), token=hostile_ca.issuer.token("default", "sleep"), headers=headers
        ),
        UNAUTH,
        "more than one 'clusterid'",
    )


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("Basic dXNlcjpwYXNz", "no credential"),
        ("Bearer", "no credential"),
        ("Bearer    ", "no credential"),
        ("Token abc", "no credential"),
        ("bearer not.a.jwt", "not a well-formed"),
        ("Bearer a.b.c.d.e", "not a well-formed"),
    ],
    ids=["basic", "bare scheme", "blank token", "other scheme", "lower-case garbage", "5 parts"],
)
def test_malformed_authorization_values(hostile_ca: InProcessCa, value: str, fragment: str) -> None:
    refused(
        hostile_ca,
        lambda: hostile_ca.call(good_csr(), headers=[("authorization", value)]),
        UNAUTH,
        fragment,
    )


def test_token_in_a_binary_header_is_not_a_credential(hostile_ca: InProcessCa) -> None:
    headers = [
        ("authorization-bin", f"Bearer {hostile_ca.issuer.token('default', 'sleep')}".encode())
    ]
    refused(
        hostile_ca, lambda: hostile_ca.call(good_csr(), headers=headers), UNAUTH, "no credential"
    )


@pytest.mark.parametrize(
    "target",
    [
        "spiffe://cluster.local/ns/kube-system/sa/admin",
        "spiffe://cluster.local/ns/default/sa/sleep",
        "not a spiffe id",
        "spiffe://cluster.local/ns/" + "x" * 20_000 + "/sa/a",
    ],
    ids=["another identity", "own identity", "not an id", "20 KB id"],
)
def test_impersonation_without_a_node_authorizer_is_refused(
    hostile_ca: InProcessCa, target: str
) -> None:
    refused(
        hostile_ca,
        lambda: hostile_ca.call(
            good_csr(),
            token=hostile_ca.issuer.token("default", "sleep"),
            metadata={"ImpersonatedIdentity": target},
        ),
        UNAUTH,
        "impersonat",
    )


def test_impersonated_identity_of_the_wrong_type_is_refused(hostile_ca: InProcessCa) -> None:
    refused(
        hostile_ca,
        lambda: hostile_ca.call(
            good_csr(),
            token=hostile_ca.issuer.token("default", "sleep"),
            metadata={"ImpersonatedIdentity": 42},
        ),
        UNAUTH,
        "impersonat",
    )
