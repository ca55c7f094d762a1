from __future__ import annotations

import pytest

from certs import DEFAULT_TRUST_DOMAIN, SpiffeId, SpiffeIdError


def test_default_trust_domain() -> None:
    assert DEFAULT_TRUST_DOMAIN == "cluster.local"


@pytest.mark.parametrize(
    "uri",
    [
        "spiffe://cluster.local/ns/default/sa/httpbin",
        "spiffe://example.org/ns/istio-system/sa/ztunnel",
        "spiffe://td_1.example-2/ns/a/sa/b.c-d",
        "spiffe://x/ns/" + "n" * 63 + "/sa/" + "s" * 253,
    ],
)
def test_parse_format_round_trip(uri: str) -> None:
    identity = SpiffeId.parse(uri)
    assert identity.uri == uri
    assert str(identity) == uri
    assert SpiffeId.parse(identity.uri) == identity


def test_parse_splits_the_parts() -> None:
    identity = SpiffeId.parse("spiffe://cluster.local/ns/bookinfo/sa/reviews")
    assert identity == SpiffeId("cluster.local", "bookinfo", "reviews")
    assert identity.trust_domain == "cluster.local"
    assert identity.namespace == "bookinfo"
    assert identity.service_account == "reviews"


def test_in_trust_domain() -> None:
    identity = SpiffeId("cluster.local", "default", "sleep")
    moved = identity.in_trust_domain("example.org")
    assert moved.uri == "spiffe://example.org/ns/default/sa/sleep"
    with pytest.raises(SpiffeIdError):
        identity.in_trust_domain("Example.org")


def test_ids_are_hashable_and_ordered() -> None:
    a = SpiffeId("td", "a", "x")
    b = SpiffeId("td", "b", "x")
    assert sorted([b, a]) == [a, b]
    assert len({a, SpiffeId("td", "a", "x")}) == 1


@pytest.mark.parametrize(
    "uri",
    [
        # scheme
        "https://cluster.local/ns/default/sa/foo",
        "SPIFFE://cluster.local/ns/default/sa/foo",
        "spiffe:/cluster.local/ns/default/sa/foo",
        "cluster.local/ns/default/sa/foo",
        # path shape
        "spiffe://cluster.local",
        "spiffe://cluster.local/",
        "spiffe://cluster.local/ns/default",
        "spiffe://cluster.local/ns/default/sa",
        "spiffe://cluster.local/ns/default/sa/foo/",
        "spiffe://cluster.local/ns/default/sa/foo/extra",
        "spiffe://cluster.local/namespace/default/sa/foo",
        "spiffe://cluster.local/ns/default/serviceaccount/foo",
        "spiffe://cluster.local/sa/foo/ns/default",
        "spiffe://cluster.local//ns/default/sa/foo",
        # uppercase
        "spiffe://Cluster.local/ns/default/sa/foo",
        "spiffe://cluster.local/ns/Default/sa/foo",
        "spiffe://cluster.local/ns/default/sa/Foo",
        # empty parts
        "spiffe:///ns/default/sa/foo",
        "spiffe://cluster.local/ns//sa/foo",
        "spiffe://cluster.local/ns/default/sa/",
        "",
        # too long
        "spiffe://" + "t" * 256 + "/ns/default/sa/foo",
        "spiffe://cluster.local/ns/" + "n" * 64 + "/sa/foo",
        "spiffe://cluster.local/ns/default/sa/" + "s" * 254,
        # characters outside the grammar
        "spiffe://cluster.local:443/ns/default/sa/foo",
        "spiffe://user@cluster.local/ns/default/sa/foo",
        "spiffe://cluster.local/ns/de_fault/sa/foo",
        "spiffe://cluster.local/ns/default/sa/foo?x=1",
        "spiffe://cluster.local/ns/default/sa/foo#frag",
        "spiffe://cluster.local/ns/-default/sa/foo",
        "spiffe://cluster.local/ns/default-/sa/foo",
        "spiffe://cluster.local/ns/default/sa/foo.",
        "spiffe://cluster.local/ns/default/sa/foo%2Fbar",
        # trailing newlines must not slip through a `$` anchor
        "spiffe://cluster.local/ns/default/sa/foo\n",
        "spiffe://cluster.local\n/ns/default/sa/foo",
        "spiffe://cluster.local/ns/default\n/sa/foo",
    ],
)
def test_parse_rejects(uri: str) -> None:
    with pytest.raises(SpiffeIdError):
        SpiffeId.parse(uri)


@pytest.mark.parametrize(
    ("trust_domain", "namespace", "service_account", "field"),
    [
        ("", "ns", "sa", "trust domain"),
        ("TD", "ns", "sa", "trust domain"),
        ("td/x", "ns", "sa", "trust domain"),
        ("td", "", "sa", "namespace"),
        ("td", "a.b", "sa", "namespace"),
        ("td", "ns", "", "service account"),
        ("td", "ns", "sa/x", "service account"),
        ("td", "ns", "sa\n", "service account"),
    ],
)
def test_constructor_validates_each_part(
    trust_domain: str, namespace: str, service_account: str, field: str
) -> None:
    with pytest.raises(SpiffeIdError, match=field):
        SpiffeId(trust_domain, namespace, service_account)
