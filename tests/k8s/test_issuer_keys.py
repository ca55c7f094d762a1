"""The cluster issuer's keys, in process against the fake API server: fetched once, refreshed
on an unknown key id at most once per interval (shared by concurrent misses), refreshed in the
background when old, and kept when a refresh fails. Time is injected."""

from __future__ import annotations

import asyncio

import pytest

from ca_server.errors import AuthenticationError, CaSetupError
from ca_server.kube.issuer_keys import ClusterIssuerKeys
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api.faults import Fault
from tests.support.kube_api.issuer import DISCOVERY_PATH, JWKS_PATH


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_unknown_kid_refreshes_at_most_once_per_interval(kube_api: KubeApiServer) -> None:
    clock = FakeMonotonic()
    keys = ClusterIssuerKeys(
        kube_api.api_client(), monotonic=clock, min_refresh_interval=10, max_age=300
    )
    keys.load()
    assert keys.issuer == kube_api.issuer.issuer
    assert kube_api.count("get", DISCOVERY_PATH) == kube_api.count("get", JWKS_PATH) == 1
    first_kid = kube_api.issuer.current_key_id

    async def scenario() -> None:
        assert (await keys.key_for(first_kid)).key_id == first_kid
        assert kube_api.count("get", JWKS_PATH) == 1, "a known key costs nothing"
        # The issuer rotates: ten concurrent requests with the new kid share one refresh.
        new_kid = kube_api.issuer.rotate()
        found = await asyncio.gather(*(keys.key_for(new_kid) for _ in range(10)))
        assert {key.key_id for key in found} == {new_kid}
        assert kube_api.count("get", JWKS_PATH) == 2
        # Made-up key ids: refused, and no refresh until the interval has passed.
        for _ in range(3):
            with pytest.raises(AuthenticationError) as refused:
                await keys.key_for("made-up")
            assert refused.value.reason == "jwt-unknown-kid"
        assert kube_api.count("get", JWKS_PATH) == 2
        clock.now += 10
        with pytest.raises(AuthenticationError):
            await keys.key_for("made-up")
        assert kube_api.count("get", JWKS_PATH) == 3

    asyncio.run(scenario())


def test_old_keys_are_refreshed_in_the_background_and_kept_on_failure(
    kube_api: KubeApiServer,
) -> None:
    clock = FakeMonotonic()
    keys = ClusterIssuerKeys(
        kube_api.api_client(), monotonic=clock, min_refresh_interval=10, max_age=300
    )
    keys.load()
    old_kid = kube_api.issuer.current_key_id

    async def scenario() -> None:
        # The issuer withdraws its old key; after max_age the CA notices without a kid miss.
        new_kid = kube_api.issuer.rotate()
        kube_api.issuer.retire_all_but_current()
        clock.now += 300
        assert (await keys.key_for(old_kid)).key_id == old_kid  # answered from the current set
        for _ in range(100):  # let the background refresh finish
            await asyncio.sleep(0.01)
            if kube_api.count("get", JWKS_PATH) == 2:
                break
        await asyncio.sleep(0.05)
        with pytest.raises(AuthenticationError):
            await keys.key_for(old_kid)
        assert (await keys.key_for(new_kid)).key_id == new_kid
        # The API server goes away: a refresh fails, the last good keys keep answering.
        kube_api.stop()
        clock.now += 600
        assert (await keys.key_for(new_kid)).key_id == new_kid
        await asyncio.sleep(0.2)
        assert (await keys.key_for(new_kid)).key_id == new_kid

    asyncio.run(scenario())


def test_old_keys_whose_refresh_fails_are_refetched_once_per_interval(
    kube_api: KubeApiServer,
) -> None:
    """Keys past `max_age` while the issuer's JWKS fails: the last good keys keep answering,
    and a request that finds no refresh running starts one only when `min_refresh_interval`
    has passed since the last attempt, not one per request (an API outage must not become a
    flood of JWKS fetches at the CA's request rate)."""
    clock = FakeMonotonic()
    keys = ClusterIssuerKeys(
        kube_api.api_client(), monotonic=clock, min_refresh_interval=10, max_age=300
    )
    keys.load()
    kid = kube_api.issuer.current_key_id
    kube_api.faults.add(Fault("get", JWKS_PATH, status=503))

    async def scenario() -> None:
        clock.now += 300
        for _ in range(20):
            assert (await keys.key_for(kid)).key_id == kid
            await asyncio.sleep(0.05)  # the background refresh fails meanwhile
        assert kube_api.count("get", JWKS_PATH) == 1 + 1  # load, then one failed attempt
        clock.now += 10
        assert (await keys.key_for(kid)).key_id == kid
        for _ in range(100):
            if kube_api.count("get", JWKS_PATH) == 3:
                break
            await asyncio.sleep(0.01)
        assert kube_api.count("get", JWKS_PATH) == 3  # the interval passed: one more

    asyncio.run(scenario())


def test_start_up_fails_with_the_rbac_to_grant(kube_api: KubeApiServer) -> None:
    keys = ClusterIssuerKeys(kube_api.api_client(), monotonic=FakeMonotonic())
    kube_api.stop()
    with pytest.raises(CaSetupError) as failed:
        keys.load()
    assert "/openid/v1/jwks" in str(failed.value)
    assert "--token-validation tokenreview" in str(failed.value)
