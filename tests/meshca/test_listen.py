"""`meshca.listen.parse_listen`: a listening flag's `HOST:PORT`, refused naming the flag."""

from __future__ import annotations

import pytest

from meshca.listen import parse_listen


def test_a_listen_address_without_a_host_is_the_loopback() -> None:
    assert parse_listen("--listen", ":15012") == ("127.0.0.1", 15012)
    assert parse_listen("--listen", "[::1]:0") == ("::1", 0)
    assert parse_listen("--listen", "0.0.0.0:15012") == ("0.0.0.0", 15012)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1:99999", "expected HOST:PORT with a port 0-65535, e.g. 127.0.0.1:15014"),
        ("::1:15020", "expected an IPv6 host in one pair of brackets, e.g. [::1]:15014"),
    ],
)
def test_a_refused_listen_address_names_the_flag_and_the_form(address: str, reason: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_listen("--status-listen", address)
    assert str(refused.value) == f"--status-listen {address!r}: {reason}"
