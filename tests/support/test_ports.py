"""tests/support/processes.py's ports: each pytest-xdist worker picks from its own slice."""

from __future__ import annotations

import pytest

from tests.support import processes


@pytest.mark.parametrize("count", [2, 3, 8])
def test_workers_get_disjoint_slices_of_the_range(
    monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    slices = []
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        slices.append(processes._worker_port_range())
    low, high = processes._PORT_RANGE
    assert all(low <= start < end <= high for start, end in slices)
    taken = [port for start, end in slices for port in range(start, end)]
    assert len(taken) == len(set(taken)), "two workers share ports"
    assert len(taken) > (high - low) * 0.99


def test_a_port_handed_out_is_in_the_workers_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    start, end = processes._worker_port_range()
    assert (start, end) != processes._PORT_RANGE
    for _ in range(20):
        assert start <= processes.free_port() < end


def test_outside_xdist_the_whole_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert processes._worker_port_range() == processes._PORT_RANGE
