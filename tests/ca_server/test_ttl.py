"""The TTL policy applied to `validity_duration`, without a CA process.

The policy: docs/reference.md#lifetimes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ca_server.config import TtlPolicy
from ca_server.errors import CaUnavailableError
from ca_server.ttl import grant_validity

NOW = datetime(2030, 1, 1, tzinfo=UTC)
CA_NOT_AFTER = NOW + timedelta(days=3650)
POLICY = TtlPolicy()


@pytest.mark.parametrize(
    ("requested", "granted", "clamped_by"),
    [
        (0, timedelta(hours=24), None),
        (-5, timedelta(hours=24), None),
        (3600, timedelta(hours=1), None),
        (60, timedelta(minutes=10), "minimum"),
        (200 * 86400, timedelta(days=90), "maximum"),
        (2**63 - 1, timedelta(days=90), "maximum"),  # int64 max: beyond what timedelta holds
    ],
)
def test_requests_are_clamped_into_the_policy(
    requested: int, granted: timedelta, clamped_by: str | None
):
    validity = grant_validity(requested, POLICY, ca_not_after=CA_NOT_AFTER, now=NOW)
    assert validity.not_before == NOW - timedelta(minutes=2)
    assert validity.not_after == NOW + granted
    assert validity.granted == granted
    assert validity.clamped_by == clamped_by


def test_never_past_the_ca_expiry_and_refused_once_it_has_passed():
    soon = NOW + timedelta(hours=1)
    validity = grant_validity(86400, POLICY, ca_not_after=soon, now=NOW)
    assert (validity.not_after, validity.clamped_by) == (soon, "ca-expiry")
    with pytest.raises(CaUnavailableError):
        grant_validity(86400, POLICY, ca_not_after=NOW, now=NOW)
