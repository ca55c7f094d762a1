"""Issue #9 forced rotation end to end (Done means 3 without Envoy, and the CSR count of Done
means 6): a real `meshca ca` process and several real `meshca agent` processes.

`meshca authority prepare`, `activate`, `taint <old>`: each agent learns the taint from its
periodic report (`meshca.v1.AgentReportService/Report`), re-signs its leaf at its own point of
`--taint-resign-window`, and the CA's CreateCertificate arrivals (its `issued` audit lines) are
spread over the window, not all at once. Over the whole cycle each agent sent exactly two CSRs —
its first certificate and the re-sign the taint asked for: prepare and activate (bundle changes)
cost none. `revoke` then removes the old authority from every agent's root file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.propagation import leaf_authority
from ca_server.authority.slots import authority_id
from certs import load_certs
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import authority_rows, data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.csr_audit import issued_lines
from tests.support.processes import wait_for

pytestmark = pytest.mark.process  # runs a CA

AGENTS = 6
WINDOW = 8.0  # --taint-resign-window, seconds
REPORT = 1.0  # --report-interval, seconds (jittered ± 20 %)
SLACK = 6.0  # process scheduling on a shared 2-core machine


def _issued(ca: CaProcess) -> list[tuple[float, str]]:
    """(unix time, identity) of every `issued` audit line in the CA's log."""
    return [(line.at.timestamp(), line.identity) for line in issued_lines(ca.log())]


def _serving_authority(agent: AgentProcess) -> str | None:
    leaf = agent.file_leaf()
    return leaf_authority(leaf) if leaf is not None else None


def _root_ids(path: Path) -> set[str]:
    try:
        return {authority_id(c) for c in load_certs(path.read_bytes())}
    except (FileNotFoundError, ValueError):
        return set()


def _authority(verb: str, ca: CaProcess, *args: str) -> None:
    result = meshca_authority(data_dir_target(ca.data_dir), verb, *args)
    assert result.returncode == 0, result.stderr


def test_taint_makes_every_agent_resign_paced_over_the_window(short_dir: Path) -> None:
    ca = CaProcess(short_dir / "data", "--ca-reload-interval", "200ms")
    ca.start()
    # No renewal is due during the test (1 h leaves): every CSR after the first is the taint's.
    flags = ("--report-interval", f"{REPORT}s", "--taint-resign-window", f"{WINDOW}s")
    agents = [
        AgentProcess(short_dir, ca, f"sa{n}", secret_ttl="1h", extra_args=flags)
        for n in range(AGENTS)
    ]
    try:
        for agent in agents:
            agent.launch()
        for agent in agents:
            agent.wait_ready()
        old = authority_id(load_certs(ca.root_cert_path.read_bytes())[0])
        wait_for(lambda: all(_serving_authority(a) == old for a in agents), 10, "first leaves")

        _authority("prepare", ca)
        wait_for(lambda: len(_root_ids(ca.root_cert_path)) == 2, 10, "the bundle {old, new}")
        new = next(iter(_root_ids(ca.root_cert_path) - {old}))
        # Every agent serves the new bundle (from the root file it watches) before activation.
        wait_for(
            lambda: all(_root_ids(a.output_dir / "root-cert.pem") == {old, new} for a in agents),
            15,
            "every agent to serve {old, new}",
        )
        _authority("activate", ca, new)
        time.sleep(1.0)  # the CA process follows within one poll (200 ms)
        assert all(_serving_authority(a) == old for a in agents)  # activation re-signs nothing
        before_taint = len(_issued(ca))
        assert before_taint == AGENTS

        _authority("taint", ca, old)
        tainted_at = time.time()
        wait_for(
            lambda: all(_serving_authority(a) == new for a in agents),
            WINDOW + REPORT * 1.2 + SLACK,
            "every agent to re-sign under the new authority",
        )
        replaced_within = time.time() - tainted_at

        resigns = _issued(ca)[before_taint:]
        assert sorted(identity for _t, identity in resigns) == sorted(a.identity for a in agents)
        arrivals = sorted(t - tainted_at for t, _identity in resigns)
        # Spread over the window, not one burst: uniform points in 8 s for 6 agents span more
        # than 1.5 s except with probability ~0.1 %; a storm would land within a few hundred ms.
        assert arrivals[-1] - arrivals[0] > 1.5, arrivals
        assert arrivals[-1] <= WINDOW + REPORT * 1.2 + SLACK, arrivals

        # Done means 6: CSRs over the whole cycle, per agent — the first certificate and the
        # one re-sign the taint asked for; the bundle changes cost none.
        per_agent = {a.identity: 0 for a in agents}
        for _t, identity in _issued(ca):
            per_agent[identity] += 1
        assert set(per_agent.values()) == {2}, per_agent
        print(
            f"\n{AGENTS} agents: {sum(per_agent.values())} CSRs over prepare+activate+taint "
            f"(2 per agent: first + taint re-sign); all replaced {replaced_within:.1f}s after "
            f"the taint (window {WINDOW}s); arrivals at {[round(a, 1) for a in arrivals]} s"
        )
        for agent in agents:
            assert "re-signing in" in agent.log()  # said why it renewed early

        # Revoke is refused while the agents' reports (published each CA poll) still show a
        # leaf of the old one served: the runbook's cue is SERVING 0.
        def nobody_serves_old() -> bool:
            rows = authority_rows(data_dir_target(ca.data_dir))
            return next(r for r in rows if r["id"] == old)["agents_serving"] == 0

        wait_for(nobody_serves_old, 10, "show to count no agent serving a leaf of the old one")
        _authority("revoke", ca, old)
        wait_for(
            lambda: all(_root_ids(a.output_dir / "root-cert.pem") == {new} for a in agents),
            15,
            "the revoked authority to leave every agent's root file",
        )
        assert len(_issued(ca)) == 2 * AGENTS  # revoke re-signs nothing either
    finally:
        for agent in agents:
            agent.stop()
        ca.stop()
