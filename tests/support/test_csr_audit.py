"""The CSR tally the rotation tests rely on tells a due renewal from an early one."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from tests.support.csr_audit import issued_lines, tally

T0 = datetime(2026, 1, 1, tzinfo=UTC)
APP = "spiffe://cluster.local/ns/default/sa/app"
WEB = "spiffe://cluster.local/ns/default/sa/web"


def line(seconds: float, identity: str, ttl: int = 8, msg: str = "issued") -> str:
    at = (T0 + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")
    return json.dumps(
        {"ts": at, "msg": msg, "identity": identity, "serial": "1", "granted_ttl_seconds": ttl}
    )


def test_renewals_at_half_life_are_due_and_a_young_leaf_replaced_is_early() -> None:
    log = "\n".join(
        [
            "2026-01-01 00:00:00,000 INFO ca_server: serving",  # not an audit line
            line(0, APP),
            line(0.5, WEB),
            line(4, APP),  # half of 8 s: due
            line(5, APP),  # 1 s after a new 8 s leaf: early (a re-sign for another reason)
            line(9, APP),
            line(9.5, WEB, msg="denied"),  # not a CSR that was signed
        ]
    )
    issued = issued_lines(log)
    assert [i.identity for i in issued] == [APP, WEB, APP, APP, APP]
    tallies = tally(issued)
    app, web = tallies[APP], tallies[WEB]
    assert (app.total, app.due, [e.at for e in app.early]) == (4, 2, [T0 + timedelta(seconds=5)])
    assert (web.total, web.due, web.early) == (1, 0, [])


def test_a_stretch_judges_its_first_csr_against_the_leaf_held_when_it_began() -> None:
    issued = issued_lines("\n".join([line(0, APP), line(4, APP), line(4.5, APP)]))
    since = T0 + timedelta(seconds=2)
    app = tally(issued, since)[APP]
    assert app.held is not None and app.held.at == T0
    # Both are in the stretch; neither is the first certificate; the second came too soon.
    assert (app.total, app.due, len(app.early)) == (2, 1, 1)
