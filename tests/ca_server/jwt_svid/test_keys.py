"""The JWT-SVID keys' pure rules: RFC 7638 kids, the slots' operator rules, the schedule with
its JWKS-age activation rule, and the one token's claims and refusals."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from ca_server.authority import AuthorityCommandError, Phase
from ca_server.errors import InvalidRequestError, SigningKeyUnavailableError
from ca_server.fleet import AgentCoverage
from ca_server.jwt_svid.keys import JwtKey, JwtKeyPolicy, JwtKeyState, scheduled_step
from ca_server.jwt_svid.minting import (
    MAX_AUDIENCE_BYTES,
    MAX_AUDIENCES,
    checked_audiences,
    mint_jwt_svid,
)
from ca_server.jwt_svid.store import JwtKeyFactory, decode_jwt_state, encode_jwt_state
from certs import SpiffeId
from certs.jwk import jwk_thumbprint, public_jwk

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LIFE = timedelta(hours=6)
TTL = timedelta(minutes=5)
POLICY = JwtKeyPolicy(lifetime=LIFE, max_token_ttl=TTL)
ID = SpiffeId.parse("spiffe://td/ns/n/sa/a")
FACTORY = JwtKeyFactory("ES256", LIFE)


def no_key() -> JwtKey:
    raise AssertionError("no new key is due")


def b64int(text: str) -> int:
    import base64

    return int.from_bytes(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)), "big")


def test_kid_is_the_rfc7638_thumbprint_of_its_example_key():
    """RFC 7638 section 3.1's RSA key and the thumbprint the RFC prints for it."""
    n = (
        "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJE"
        "CPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2"
        "QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh"
        "6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw"
    )
    public = rsa.RSAPublicNumbers(65537, b64int(n)).public_key()
    assert jwk_thumbprint(public) == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"


@pytest.mark.parametrize("algorithm", ["ES256", "ES384", "RS256"])
def test_each_algorithm_publishes_a_jwk_pyjwt_verifies_with(algorithm: str):
    key = JwtKeyFactory(algorithm, LIFE).new(T0, Phase.ACTIVE)
    jwk = public_jwk(key.key)
    assert (jwk["alg"], jwk["use"], jwk["kid"]) == (algorithm, "jwt-svid", key.kid)
    minted = mint_jwt_svid(key, ID, ("x",), TTL, T0)
    verifier = jwt.PyJWK(jwk)
    claims = jwt.decode(
        minted.token, verifier.key, algorithms=[algorithm], audience="x",
        options={"verify_exp": False},
    )  # fmt: skip
    assert claims["sub"] == "spiffe://td/ns/n/sa/a"
    assert jwt.get_unverified_header(minted.token)["kid"] == key.kid


def first_state() -> JwtKeyState:
    return JwtKeyFactory("ES256", LIFE).first_state(T0)


def test_the_schedule_prepares_at_half_and_activates_at_five_sixths_once_published_long_enough():
    factory = JwtKeyFactory("ES256", LIFE)
    state = first_state()

    def new() -> JwtKey:
        return factory.new(now, Phase.PREPARED)

    now = T0 + LIFE / 2 - timedelta(seconds=1)
    assert scheduled_step(state, POLICY, now, new) is None
    now = T0 + LIFE / 2
    prepared = scheduled_step(state, POLICY, now, new)
    assert prepared is not None and prepared.prepared is not None
    assert len(prepared.published()) == 2  # in the JWKS at prepare time
    now = T0 + LIFE * 5 / 6
    active = scheduled_step(prepared, POLICY, now, new)
    assert active is not None and active.active.kid == prepared.prepared.kid
    assert [k.phase for k in active.ranked()] == [Phase.ACTIVE, Phase.OLD]


HOLDING = AgentCoverage(trusting=3, reporting=3)
LACKING = AgentCoverage(trusting=2, reporting=3)


def test_activation_waits_for_the_jwks_cache_lifetime_and_for_coverage():
    factory = JwtKeyFactory("ES256", LIFE)
    state = first_state()
    late = T0 + LIFE * 5 / 6  # prepared late (an operator), activation already due
    prepared = state.prepare(lambda: factory.new(late, Phase.PREPARED), late, "operator")
    assert prepared.prepared is not None
    soon = late + POLICY.jwks_max_age
    assert scheduled_step(prepared, POLICY, soon, no_key, lambda kid: HOLDING) is None
    after = soon + POLICY.convergence
    asked: list[str] = []

    def lacking(kid: str) -> AgentCoverage:
        asked.append(kid)
        return LACKING

    # Not covered: one `activation-gated` event saying why and until when, then nothing.
    gated = scheduled_step(prepared, POLICY, after, no_key, lacking)
    assert gated is not None and gated.prepared is not None
    assert asked == [prepared.prepared.kid]
    waiting = gated.gate_waiting()
    assert waiting is not None and "2/3 reporting agents hold it" in waiting.reason
    assert scheduled_step(gated, POLICY, after, no_key, lacking) is None
    done = scheduled_step(gated, POLICY, after, no_key, lambda kid: HOLDING)
    assert done is not None and done.active.kid == prepared.prepared.kid
    assert "3/3 reporting agents hold it" in done.history[-2].reason


def test_the_coverage_gate_gives_way_at_its_deadline_with_a_reason():
    factory = JwtKeyFactory("ES256", LIFE)
    early = T0 + LIFE / 2
    state = first_state().prepare(lambda: factory.new(early, Phase.PREPARED), early, "s")
    five_sixths = T0 + LIFE * 5 / 6
    # The X.509 gate's deadline: half the time from the 5/6 point to the active key's expiry.
    deadline = five_sixths + (LIFE / 6) * POLICY.activate_deadline
    assert POLICY.coverage_deadline(state.active) == deadline
    before = scheduled_step(state, POLICY, deadline - timedelta(seconds=1), no_key,
                            lambda kid: LACKING)  # fmt: skip
    assert before is not None and before.gate_waiting() is not None
    forced = scheduled_step(before, POLICY, deadline, no_key, lambda kid: LACKING)
    assert forced is not None and forced.active.kid != state.active.kid
    assert forced.history[-2].reason.startswith("gate deadline passed: only 2/3")
    # Never later than two tokens' lives before the active key expires.
    short = JwtKeyPolicy(lifetime=LIFE, max_token_ttl=timedelta(minutes=50))
    assert short.coverage_deadline(state.active) == T0 + LIFE - timedelta(minutes=100)


def test_unseen_and_unreadable_reports_hold_the_gate_and_no_reports_pass_it():
    assert not AgentCoverage(3, 3, unseen=1).reaches(1.0)
    assert not AgentCoverage(3, 3, unreadable=1).reaches(0.5)
    assert AgentCoverage(0, 0).reaches(1.0)
    assert AgentCoverage(19, 20).reaches(0.95) and not AgentCoverage(18, 20).reaches(0.95)


def test_an_active_key_that_can_no_longer_sign_is_replaced_at_once():
    """After downtime past the whole rotation: no waiting for the JWKS cache or coverage
    (nothing can be signed meanwhile); a prepared key that expired too is dropped first."""
    factory = JwtKeyFactory("ES256", LIFE)
    state = first_state()
    back = T0 + LIFE + timedelta(hours=1)
    new: list[JwtKey] = []

    def make() -> JwtKey:
        new.append(factory.new(back, Phase.PREPARED))
        return new[-1]

    prepared = scheduled_step(state, POLICY, back, make, lambda kid: LACKING)
    assert prepared is not None and prepared.prepared is not None
    assert prepared.history[-1].reason.startswith(f"the active key {state.active.kid} expired")
    active = scheduled_step(prepared, POLICY, back, no_key, lambda kid: LACKING)
    assert active is not None and active.active.kid == new[0].kid
    assert "activated at once" in active.history[-2].reason
    gone = scheduled_step(active, POLICY, back, no_key)
    assert gone is not None and [k.kid for k in gone.keys] == [new[0].kid]
    # A prepared key as old as the active one is no use either.
    stale = state.prepare(lambda: factory.new(T0, Phase.PREPARED), T0, "operator")
    dropped = scheduled_step(stale, POLICY, back, no_key)
    assert dropped is not None and dropped.prepared is None and dropped.active == state.active
    # Only under automatic rotation: an operator's CA waits for the operator.
    manual = JwtKeyPolicy(lifetime=LIFE, max_token_ttl=TTL, automatic=False)
    assert scheduled_step(state, manual, back, no_key) is None


def test_operator_rules_match_the_x509_authoritys():
    factory = JwtKeyFactory("ES256", LIFE)
    state = first_state()
    first = state.active.kid
    with pytest.raises(AuthorityCommandError, match="only an old key"):
        state.taint(first, T0)
    with pytest.raises(AuthorityCommandError, match="not tainted"):
        state.revoke(first, T0)
    state = state.prepare(lambda: factory.new(T0, Phase.PREPARED), T0, "operator")
    state = state.activate(None, T0, "operator")
    with pytest.raises(AuthorityCommandError, match="not prepared"):
        state.activate(first, T0, "operator")
    state = state.taint(first[:10], T0)
    assert state.tainted_kids() == (first,)
    assert first in [k["kid"] for k in state.published()]  # still published until revoked
    state = state.revoke(first, T0)
    assert [k["kid"] for k in state.published()] == [state.active.kid]


def test_an_old_key_stays_published_until_revoked_or_expired():
    """The issue's rule: tokens it signed live on; no token outlives the key, so its expiry
    is the latest it can matter."""
    factory = JwtKeyFactory("ES256", LIFE)
    hour = T0 + timedelta(hours=1)
    state = first_state().prepare(lambda: factory.new(hour, Phase.PREPARED), hour, "operator")
    state = state.activate(None, hour, "operator")  # early: the old key has most of its life
    old = state.old[0]
    manual = JwtKeyPolicy(lifetime=LIFE, max_token_ttl=TTL, automatic=False)  # no other step
    long_after = T0 + LIFE - timedelta(seconds=1)
    assert scheduled_step(state, manual, long_after, no_key) is None
    assert old.kid in [k["kid"] for k in state.published()]
    gone = scheduled_step(state, manual, old.not_after, no_key)
    assert gone is not None and [k.kid for k in gone.keys] == [state.active.kid]
    assert gone.history[-1].event == "dropped"


def test_the_encoding_round_trips_and_refuses_a_key_under_another_kid():
    factory = JwtKeyFactory("ES384", LIFE)
    state = first_state().prepare(lambda: factory.new(T0, Phase.PREPARED), T0, "operator")
    text = encode_jwt_state(state)
    again = decode_jwt_state(text, "test")
    assert [k.kid for k in again.keys] == [k.kid for k in state.keys]
    forged = text.replace(state.active.kid, "A" * 43)
    with pytest.raises(Exception, match="does not match its thumbprint"):
        decode_jwt_state(forged, "test")


@pytest.mark.parametrize(
    ("audiences", "reason"),
    [
        ([], "audience-missing"),
        ([""], "audience-invalid"),
        (["a" * (MAX_AUDIENCE_BYTES + 1)], "audience-invalid"),
        (["a" * 1024 * 1024], "audience-invalid"),
        ([f"a{i}" for i in range(MAX_AUDIENCES + 1)], "audience-too-many"),
    ],
)
def test_bad_audience_lists_are_invalid_arguments(audiences: list[str], reason: str):
    with pytest.raises(InvalidRequestError) as refused:
        checked_audiences(audiences)
    assert refused.value.reason == reason


def test_a_token_never_outlives_its_key_and_a_dying_key_signs_nothing():
    key = first_state().active
    near = key.not_after - timedelta(minutes=2)
    minted = mint_jwt_svid(key, ID, ("x",), TTL, near)
    assert minted.expires_at <= key.not_after
    with pytest.raises(SigningKeyUnavailableError) as refused:
        mint_jwt_svid(key, ID, ("x",), TTL, key.not_after + timedelta(hours=3))
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    assert "meshca authority prepare --jwt" in refused.value.message
    assert key.kid in refused.value.message
