"""The one parser of `ns/sa,…` lists and the one of `system:serviceaccount:NS:SA` usernames."""

from __future__ import annotations

import pytest

from meshca.accounts import account_from_username, parse_account_list


def test_account_list_is_trimmed_deduplicated_and_ordered():
    assert parse_account_list(" istio-system/ztunnel, kube-system/agent,") == (
        ("istio-system", "ztunnel"),
        ("kube-system", "agent"),
    )
    assert parse_account_list("shop/cart, web/front,shop/cart") == (
        ("shop", "cart"),
        ("web", "front"),
    )
    assert parse_account_list("") == ()


@pytest.mark.parametrize("bad", ["ztunnel", "/sa", "ns/", "a/b/c"])
def test_account_list_names_the_malformed_entry(bad: str):
    with pytest.raises(ValueError, match=f"{bad!r} is not NAMESPACE/SERVICE_ACCOUNT"):
        parse_account_list(f"shop/cart,{bad}")


def test_comments_only_when_asked():
    text = "# node pods\nshop/cart # the cart\nweb/front,web/api\n"
    assert parse_account_list(text, comments=True) == (
        ("shop", "cart"),
        ("web", "front"),
        ("web", "api"),
    )
    with pytest.raises(ValueError, match="NAMESPACE/SERVICE_ACCOUNT"):
        parse_account_list(text)


def test_service_account_usernames():
    assert account_from_username("system:serviceaccount:shop:cart") == ("shop", "cart")
    for other in (
        "alice",
        "system:serviceaccount:shop",
        "system:serviceaccount:a:b:c",
        "system:serviceaccount::cart",
        "system:serviceaccount:shop:",
        "system:serviceaccounts:shop",
        "",
    ):
        assert account_from_username(other) is None, other
