"""`meshca.host_port`: the one `HOST:PORT` parser of the listening flags, the status servers and
the agent's CA address."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshca.host_port import join_host_port, split_host_port


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:15012", ("127.0.0.1", 15012)),
        ("istiod.istio-system.svc:15012", ("istiod.istio-system.svc", 15012)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:15020", ("::1", 15020)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
        (":15014", ("", 15014)),
        ("[127.0.0.1]:80", ("127.0.0.1", 80)),  # brackets round a name are allowed, as in Go
        ("host:0080", ("host", 80)),
    ],
)
def test_an_address_splits_into_host_and_port(address: str, expected: tuple[str, int]) -> None:
    assert split_host_port(address) == expected


@pytest.mark.parametrize(
    "address",
    [
        "",
        "nowhere",
        "host:",
        "host:http",
        "host:-1",
        "host:+80",
        "host: 80",
        "host:65536",
        "host:99999",
        "host:\uff11\uff12",
        "host:\u00b2",
        "[::1]",
        "[::1]:",
        ":",
    ],
)
def test_an_address_without_a_port_0_to_65535_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match=r"^expected HOST:PORT with a port 0-65535, e\.g\. "):
        split_host_port(address)


@pytest.mark.parametrize(
    "address", ["::1:15020", "[::1:15020", "::1]:15020", "[[::1]]:15020", "[::1]x:15020", "a]:1"]
)
def test_an_ipv6_host_outside_one_pair_of_brackets_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match=r"IPv6 host in one pair of brackets, e\.g\. \[::1\]:"):
        split_host_port(address)


def test_a_joined_address_brackets_only_an_ipv6_host() -> None:
    assert join_host_port("127.0.0.1", 15020) == "127.0.0.1:15020"
    assert join_host_port("::1", 0) == "[::1]:0"
    assert join_host_port("", 15014) == ":15014"


@given(
    st.one_of(
        st.ip_addresses().map(str),
        st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,30}[a-z0-9])?", fullmatch=True),
        st.just(""),
    ),
    st.integers(0, 65535),
)
def test_what_is_joined_splits_back(host: str, port: int) -> None:
    assert split_host_port(join_host_port(host, port)) == (host, port)
