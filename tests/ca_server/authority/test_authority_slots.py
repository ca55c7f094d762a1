"""The slot state machine on a fake clock: SPIRE's schedule, the refusals that keep trust, and
a leaf never outliving (or being cut short by) a rotation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ca_server.authority.self_signed import cap_leaf_lifetimes
from ca_server.authority.slots import (
    AuthorityCommandError,
    AuthorityState,
    Phase,
    SlotRotationPolicy,
    next_due,
    scheduled_step,
)
from ca_server.authority.state_store import SlotFactory
from ca_server.config import TtlPolicy
from certs import KeySpec

START = datetime(2030, 1, 1, tzinfo=UTC)
LIFE = timedelta(minutes=60)
POLICY = SlotRotationPolicy(lifetime=LIFE, convergence=timedelta(seconds=15))
FACTORY = SlotFactory(KeySpec(), "cluster.local", LIFE)


def _first() -> AuthorityState:
    return FACTORY.first_state(START)


def _step(state: AuthorityState, at: datetime) -> AuthorityState | None:
    return scheduled_step(state, POLICY, at, lambda: FACTORY.new(at, Phase.PREPARED))


def test_predicates_follow_half_and_five_sixths_of_the_life():
    active = _first().active
    assert not POLICY.should_prepare(active, START + timedelta(minutes=29, seconds=59))
    assert POLICY.should_prepare(active, START + timedelta(minutes=30))
    assert not POLICY.should_activate(active, START + timedelta(minutes=49, seconds=59))
    assert POLICY.should_activate(active, START + timedelta(minutes=50))
    assert POLICY.max_leaf_ttl == timedelta(minutes=10)


def test_leads_are_capped_for_long_lived_authorities():
    policy = SlotRotationPolicy(
        lifetime=timedelta(days=3650),
        prepare_cap=timedelta(days=30),
        activate_cap=timedelta(days=7),
    )
    assert policy.prepare_lead(timedelta(days=3650)) == timedelta(days=30)
    assert policy.activate_lead(timedelta(days=3650)) == timedelta(days=7)
    with pytest.raises(ValueError, match="shorter than the preparation"):
        SlotRotationPolicy(prepare_cap=timedelta(days=1), activate_cap=timedelta(days=2))


def test_a_whole_cycle_prepared_active_old_dropped():
    state = _first()
    first = state.active
    assert _step(state, START + timedelta(minutes=29)) is None
    assert next_due(state, POLICY) == START + timedelta(minutes=30)

    state = _step(state, START + timedelta(minutes=30)) or pytest.fail("not prepared")
    prepared = state.prepared
    assert prepared is not None and prepared.id != first.id
    assert state.active.id == first.id, "preparing does not change who signs"
    assert state.bundle == (first.cert, prepared.cert), "the bundle carries both at once"
    assert state.signing_authority().cert == first.cert
    assert _step(state, START + timedelta(minutes=49)) is None

    at = START + timedelta(minutes=50)
    state = _step(state, at) or pytest.fail("not activated")
    assert state.active.id == prepared.id
    (old,) = state.old
    assert old.id == first.id and old.retired_at == at
    assert set(state.bundle) == {first.cert, prepared.cert}
    assert state.signing_authority().cert == prepared.cert

    # The old root stays while a leaf it signed may be alive (max leaf TTL + convergence), and
    # never past its own expiry.
    assert _step(state, at + timedelta(minutes=9, seconds=59)) is None
    assert next_due(state, POLICY) == old.not_after == START + timedelta(minutes=60)
    state = _step(state, START + timedelta(minutes=60)) or pytest.fail("not dropped")
    assert state.bundle == (prepared.cert,)
    assert [e.event for e in state.history] == [
        "activated",
        "prepared",
        "activated",
        "retired",
        "dropped",
    ]


def test_an_old_authority_goes_once_its_last_leaf_has_expired():
    state = _first()
    state = state.prepare(lambda: FACTORY.new(START, Phase.PREPARED), START, "operator")
    state = state.activate(None, START, "operator")  # forced, early in the old one's life
    drop_at = START + POLICY.max_leaf_ttl + POLICY.convergence
    assert next_due(state, POLICY) == drop_at
    assert _step(state, drop_at - timedelta(seconds=1)) is None
    dropped = _step(state, drop_at) or pytest.fail("not dropped")
    assert len(dropped.bundle) == 1


def test_an_old_authority_with_live_leaves_stays_until_they_expire_or_it_does():
    """The time rule assumes no leaf outlived the maximum TTL; the ledger is the check (a CA
    restarted with a shorter --root-ttl lowers that maximum for leaves already signed)."""
    state = _first()
    state = state.prepare(lambda: FACTORY.new(START, Phase.PREPARED), START, "operator")
    state = state.activate(None, START, "operator")
    (old,) = state.old
    drop_at = START + POLICY.max_leaf_ttl + POLICY.convergence

    def step(at: datetime, live: dict[str, int]) -> AuthorityState | None:
        return scheduled_step(
            state, POLICY, at, lambda: FACTORY.new(at, Phase.PREPARED), lambda: live
        )

    assert step(drop_at, {old.id: 3}) is None, "leaves still live: kept"
    assert step(drop_at, {old.id: 0, "other": 5}) is not None
    assert step(old.not_after, {old.id: 3}) is not None, "never past its own expiry"


def test_operator_refusals_say_why():
    state = _first()
    active = state.active.id
    with pytest.raises(AuthorityCommandError, match="no prepared authority"):
        state.activate(None, START, "operator")
    with pytest.raises(AuthorityCommandError, match="is active, not prepared"):
        state.activate(active, START, "operator")
    with pytest.raises(AuthorityCommandError, match="nothing to sign with"):
        state.taint(active, START)
    with pytest.raises(AuthorityCommandError, match="only allowed after `meshca authority taint`"):
        state.revoke(active, START)
    with pytest.raises(AuthorityCommandError, match="not a known authority"):
        state.taint("deadbeef00", START)

    state = state.prepare(lambda: FACTORY.new(START, Phase.PREPARED), START, "operator")
    with pytest.raises(AuthorityCommandError, match="already prepared"):
        state.prepare(lambda: FACTORY.new(START, Phase.PREPARED), START, "operator")
    with pytest.raises(AuthorityCommandError, match="has signed nothing"):
        state.taint(state.prepared.id if state.prepared else "", START)


def test_forced_rotation_taint_then_revoke():
    state = _first()
    first = state.active.id
    state = state.prepare(lambda: FACTORY.new(START, Phase.PREPARED), START, "operator")
    state = state.activate(None, START, "operator")
    state = state.taint(first[:8], START)  # a unique prefix is enough
    (old,) = state.old
    assert old.tainted and old.cert in state.bundle, "tainted stays in the bundle until revoked"
    assert old.cert not in state.untainted_roots, "but vouches for no client certificate"
    with pytest.raises(AuthorityCommandError, match="already tainted"):
        state.taint(first, START)
    state = state.revoke(first, START)
    assert [s.id for s in state.slots] == [state.active.id]
    assert state.history[-1].event == "revoked"


def test_leaf_ttls_are_capped_at_the_activation_lead():
    capped = cap_leaf_lifetimes(TtlPolicy(), POLICY)
    assert capped.maximum == timedelta(minutes=10)
    assert capped.default == timedelta(minutes=10)
    assert capped.minimum == timedelta(minutes=10)
    long_lived = SlotRotationPolicy(lifetime=timedelta(days=3650))
    assert cap_leaf_lifetimes(TtlPolicy(), long_lived) == TtlPolicy(), "defaults unchanged"
