"""What Secret `istiod-tls` should hold, decided from the Secret as it is and the authority now:
kept, its bundle refreshed (prepare), or a new certificate (activate, renewal, names, damage)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509

from ca_server.kube.istiod_tls import (
    CA_KEY,
    CERT_KEY,
    KEY_KEY,
    issue,
    istiod_hosts,
    plan,
    renew_at,
)
from certs import KeySpec, load_certs, new_self_signed_authority, verify_chain

NOW = datetime(2030, 1, 1, tzinfo=UTC)
HOUR = timedelta(hours=1)
HOSTS = istiod_hosts("istio-system", ["canary"])


def _authority(now: datetime = NOW):
    return new_self_signed_authority(
        KeySpec(), "cluster.local", now=now, lifetime=timedelta(days=30)
    )


def _leaf(data: dict[str, str]) -> x509.Certificate:
    return load_certs(data[CERT_KEY].encode())[0]


def test_istiods_names_and_revisions():
    assert HOSTS == (
        "istiod.istio-system.svc",
        "istiod-remote.istio-system.svc",
        "istio-pilot.istio-system.svc",
        "istiod-canary.istio-system.svc",
    )


def test_an_issued_secret_is_kept_and_verifies_against_its_bundle():
    authority = _authority()
    assert plan(None, authority, HOSTS, now=NOW).action == "issue"
    data = issue(authority, HOSTS, now=NOW, lifetime=HOUR)
    assert data[CA_KEY] == authority.root_bundle_pem
    leaf = _leaf(data)
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == set(HOSTS)
    assert leaf.not_valid_after_utc - NOW == HOUR
    verify_chain(load_certs(data[CERT_KEY].encode()), load_certs(data[CA_KEY].encode()), now=NOW)
    assert plan(data, authority, HOSTS, now=NOW).action == "keep"


def test_renewed_before_half_life():
    authority = _authority()
    data = issue(authority, HOSTS, now=NOW, lifetime=HOUR)
    due = renew_at(_leaf(data))
    assert NOW < due < NOW + HOUR / 2
    assert plan(data, authority, HOSTS, now=due - timedelta(seconds=1)).action == "keep"
    assert plan(data, authority, HOSTS, now=due).action == "issue"


def test_prepare_refreshes_the_bundle_keeping_the_leaf_and_activate_reissues():
    old = _authority()
    data = issue(old, HOSTS, now=NOW, lifetime=HOUR)
    new = _authority()
    prepared = replace(old, roots=(*old.roots, *new.roots))
    decided = plan(data, prepared, HOSTS, now=NOW)
    assert decided.action == "refresh"
    activated = replace(new, roots=prepared.roots)
    assert plan(data, activated, HOSTS, now=NOW).action == "issue"
    reissued = issue(activated, HOSTS, now=NOW, lifetime=HOUR)
    _leaf(reissued).verify_directly_issued_by(new.cert)
    assert len(load_certs(reissued[CA_KEY].encode())) == 2


@pytest.mark.parametrize(
    "damage",
    [
        {CERT_KEY: "not a certificate"},
        {KEY_KEY: "not a key"},
        {CA_KEY: "edited"},
        "other key",
        "other names",
        "missing key",
    ],
)
def test_a_damaged_or_foreign_secret_is_not_kept(damage: object):
    authority = _authority()
    data = issue(authority, HOSTS, now=NOW, lifetime=HOUR)
    hosts = HOSTS
    if isinstance(damage, dict):
        data.update(damage)
    elif damage == "other key":
        data[KEY_KEY] = issue(authority, HOSTS, now=NOW, lifetime=HOUR)[KEY_KEY]
    elif damage == "other names":
        hosts = istiod_hosts("istio-system")
    else:
        del data[KEY_KEY]
    assert plan(data, authority, hosts, now=NOW).action != "keep"
