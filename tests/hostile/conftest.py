"""Fixtures of the hostile-input suite: one in-process CA per module, and the one check every
case ends with (`refused`): the exact status, nothing issued (metric and audit), the refusal
audited and counted, and the CA still serving a valid request afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tests.hostile.inprocess_ca import InProcessCa


@pytest.fixture(scope="module")
def hostile_ca(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessCa]:
    with InProcessCa(Path(tmp_path_factory.mktemp("hostile_ca"))) as server:
        yield server


def refused(
    hostile_ca: InProcessCa,
    send: Callable[[], object],
    code: grpc.StatusCode,
    fragment: str,
    *,
    reason: str | None = None,
    max_details: int = 1200,
) -> str:
    """Runs `send` and checks it was refused with `code`, a message containing `fragment`, no
    certificate issued, one denial audited (and counted, with `reason` if given), and that the
    CA still issues to a valid request. Returns the status message."""
    issued_before = hostile_ca.issued_count()
    issued_lines_before = len(hostile_ca.issued_lines())
    denied_before = len(hostile_ca.denied_lines())
    denials_before = hostile_ca.denials()
    with pytest.raises(grpc.RpcError) as info:
        send()
    error = info.value
    details = error.details() or ""
    assert error.code() == code, f"{error.code()}: {details[:300]}"
    assert fragment.lower() in details.lower(), details[:300]
    assert len(details) <= max_details, f"message of {len(details)} characters"
    assert hostile_ca.issued_count() == issued_before
    assert len(hostile_ca.issued_lines()) == issued_lines_before
    new_denials = hostile_ca.denied_lines()[denied_before:]
    assert len(new_denials) == 1, new_denials
    assert new_denials[0]["code"] == code.name
    assert all(len(str(value)) <= max_details for value in new_denials[0].values())
    assert hostile_ca.denials() == denials_before + 1
    if reason is not None:
        assert new_denials[0]["reason"] == reason, new_denials[0]
    assert hostile_ca.valid_request_succeeds()
    assert hostile_ca.issued_count() == issued_before + 1
    return details
