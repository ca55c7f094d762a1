"""`ca_server.authority` exports what it promises (`__all__`), and only that: the names the
commands and the rest of the CA use are defined there, each belongs to the package, and nothing
public in the facade is missing from `__all__` (like httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import asyncio
import inspect
from datetime import UTC, datetime, timedelta
from pathlib import Path

import ca_server.authority as facade
from ca_server.config import CaConfig
from ca_server.fleet import AgentReports
from ca_server.metrics import CaMetrics
from meshca.clock import SystemClock
from tests.support.pki import TestCa


def test_every_exported_name_exists_and_belongs_to_the_package():
    for name in facade.__all__:
        member = getattr(facade, name)  # AttributeError: promised but missing
        home = getattr(member, "__module__", None) or ""
        if inspect.isclass(member) or inspect.isfunction(member):
            assert home == "ca_server.authority" or home.startswith(
                ("ca_server.authority.", "ca_server.errors")
            ), f"{name} comes from {home}, not from the authority package"


def test_all_lists_every_public_name_defined_in_the_facade_once():
    assert len(facade.__all__) == len(set(facade.__all__))
    defined = {
        name
        for name, member in vars(facade).items()
        if not name.startswith("_") and getattr(member, "__module__", "") == facade.__name__
    }
    assert defined == {
        "AuthorityDriver",
        "ClusterStores",
        "authority_driver_for",
        "SharedState",
        "open_shared_state",
    }
    assert defined <= set(facade.__all__)


def test_the_driver_protocol_is_what_the_server_uses():
    members = {name for name, _ in inspect.getmembers(facade.AuthorityDriver)}
    for used in (
        "signer",
        "ttl_policy",
        "report",
        "tainted_since",
        "start",
        "run",
    ):
        assert used in members
    assert "on_change" in facade.AuthorityDriver.__annotations__
    # The fleet is the server's: built once and handed to the driver, never reached through it.
    assert members.isdisjoint({"agent_reports", "fleet", "ledger"})


def test_both_drivers_have_what_the_protocol_promises(tmp_path: Path):
    """Built as the server builds them (`authority_driver_for`) and started."""
    protocol = {
        name
        for name in (*vars(facade.AuthorityDriver), *facade.AuthorityDriver.__annotations__)
        if not name.startswith("_")
    }
    root = TestCa(datetime.now(UTC) - timedelta(hours=1))
    root.write_cacerts(tmp_path / "cacerts", [root])
    for cacerts_dir, kind in ((None, "SelfSignedDriver"), (tmp_path / "cacerts", "PluggedDriver")):
        config = CaConfig(data_dir=tmp_path / kind, cacerts_dir=cacerts_dir)
        config.data_dir.mkdir()  # as `run_ca` does
        driver = facade.authority_driver_for(config, CaMetrics(), SystemClock(), AgentReports())
        assert type(driver).__name__ == kind
        asyncio.run(driver.start())
        missing = {name for name in protocol if not hasattr(driver, name)}
        assert missing == set(), f"{kind} lacks {missing}"
        assert driver.signer.authority is not None
        assert isinstance(driver.tainted_since(), dict)
