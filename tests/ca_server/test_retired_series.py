"""`WithoutRetiredSeries`: the supervisor's view leaves out gauge series marked gone (NaN), and
only those. The multiprocess half (a worker's file keeping a removed series) is shown with real
workers in `tests/ca_server/serving/test_workers.py`."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from ca_server.metrics import WithoutRetiredSeries, retire_series
from tests.support.metrics import sample_value


def test_nan_gauge_series_are_left_out_and_the_rest_kept() -> None:
    workers = CollectorRegistry()
    phase = Gauge("phase", "a gauge", ["authority"], registry=workers)
    phase.labels("live").set(0)
    phase.labels("gone").set(math.nan)
    view = CollectorRegistry()
    view.register(WithoutRetiredSeries(workers))

    text = generate_latest(view).decode()
    assert 'phase{authority="live"} 0.0' in text
    assert "gone" not in text
    assert sample_value(text, "phase", {"authority": "live"}) == 0


def test_retire_series_outside_multiprocess_mode_removes_the_series(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    registry = CollectorRegistry()
    tainted = Gauge("tainted", "a gauge", ["authority"], registry=registry)
    tainted.labels("old").set(1)
    tainted.labels("new").set(0)
    retire_series(tainted, "old")
    retire_series(tainted, "never-seen")  # removing what is not there is no error
    text = generate_latest(registry).decode()
    assert "old" not in text and "never-seen" not in text
    assert 'tainted{authority="new"} 0.0' in text
