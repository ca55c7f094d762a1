"""`PeerLogLimit`: one line per peer per interval, a bounded table, time moved by hand."""

from __future__ import annotations

import logging

import pytest

from meshca.clock import FakeClock
from meshca.peer_log_limit import PeerLogLimit, peer_host

LOGGER = "tests.peer_log_limit"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_one_line_per_peer_per_interval(clock: FakeClock, caplog: pytest.LogCaptureFixture):
    limit = PeerLogLimit(logging.getLogger(LOGGER), interval=60, monotonic=clock.monotonic)
    with caplog.at_level(logging.INFO, LOGGER):
        assert limit.log("ipv4:10.0.0.7:40001", "bad from %s", "a")
        # The same host on new connections (new ports) is the same peer.
        assert not limit.log("ipv4:10.0.0.7:40002", "bad from %s", "a")
        assert not limit.log("ipv4:10.0.0.7:40003", "bad from %s", "a")
        assert limit.log("ipv6:[::1]:40001", "bad from %s", "b")  # another peer: its own line
        clock.advance(59.9)
        assert not limit.log("ipv4:10.0.0.7:40004", "bad from %s", "a")
        clock.advance(0.2)  # a minute after its line
        assert limit.log("ipv4:10.0.0.7:40005", "bad from %s", "a")
    held = "more such lines held back since the last one logged, from any peer: at most one"
    assert lines(caplog) == [
        "bad from a",
        f"bad from b (2 {held} per peer per 60s)",
        f"bad from a (1 {held} per peer per 60s)",
    ]


def test_a_flood_from_many_peers_stays_bounded(clock: FakeClock, caplog: pytest.LogCaptureFixture):
    """10,000 addresses, each sending once: the table never holds more than `max_peers`, the
    log gets `max_peers` lines in the interval, and the rest are counted in the next line."""
    limit = PeerLogLimit(logging.getLogger(LOGGER), max_peers=8, monotonic=clock.monotonic)
    with caplog.at_level(logging.INFO, LOGGER):
        logged = sum(
            limit.log(f"ipv4:10.{n // 65536}.{n // 256 % 256}.{n % 256}:1", "x")
            for n in range(10_000)
        )
        assert logged == 8
        assert limit.peers() == 8
        clock.advance(61)
        assert limit.log("ipv4:192.0.2.1:1", "x")
        assert limit.peers() == 1  # the stale entries went
    assert lines(caplog)[-1].startswith("x (9992 more such lines held back")


def test_peer_host_drops_the_port_only():
    assert peer_host("ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:5555") == "ipv6:[::1]"
    assert peer_host("unix:/run/meshca/ca.sock") == "unix:/run/meshca/ca.sock"
    assert len(peer_host("unix:" + "x" * 500)) == 120
