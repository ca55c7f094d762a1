"""Secret `istiod-tls`: the leader issues istiod's serving certificate, restores it, renews it
before half-life, and moves it through prepare (bundle first) and activate (new leaf); off with
`--no-istiod-tls`."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ca_server.authority.slots import authority_id
from ca_server.kube.istiod_tls import SECRET_NAME, istiod_hosts
from certs import CLOCK_SKEW_BACKDATE, load_certs, verify_chain
from tests.support.authority_cli import authority_rows, cluster_target
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory
from tests.support.processes import wait_for


def _secret(kube_api: KubeApiServer) -> dict[str, str] | None:
    found = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE, missing_ok=True)
    if found is None:
        return None
    return {k: base64.b64decode(v).decode() for k, v in found.get("data", {}).items()}


def _leaf(data: dict[str, str]) -> x509.Certificate:
    return load_certs(data["tls.crt"].encode())[0]


def _bundle_ids(data: dict[str, str]) -> set[str]:
    return {authority_id(c) for c in load_certs(data["ca.crt"].encode())}


def _issuer_id(data: dict[str, str]) -> str:
    """The id of the bundle root that signed the leaf."""
    leaf = _leaf(data)
    for root in load_certs(data["ca.crt"].encode()):
        try:
            leaf.verify_directly_issued_by(root)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return authority_id(root)
    raise AssertionError("the leaf verifies against no root in ca.crt")


def test_istiod_tls_is_issued_restored_renewed_and_follows_rotation(
    tmp_path: Path, kube_api: KubeApiServer, kube_ca: CaFactory
):
    ca = kube_ca(
        "ca-0",
        "--ca-reload-interval",
        "1s",
        "--istiod-revisions",
        "canary",
        "--istiod-tls-lifetime",
        "20s",
    )
    wait_for(lambda: _secret(kube_api) is not None, 5, "istiod-tls created")
    data = _secret(kube_api)
    assert data is not None
    assert data["ca.crt"] == ca.root_cert_path.read_text()
    names = _leaf(data).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == set(
        istiod_hosts(CA_NAMESPACE, ["canary"])
    )
    now = datetime.now(UTC)
    verify_chain(load_certs(data["tls.crt"].encode()), load_certs(data["ca.crt"].encode()), now=now)
    raw = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    assert raw["type"] == "kubernetes.io/tls"

    # Renewed at 40% of its 20 s life (8 s), before half-life.
    first_serial = _leaf(data).serial_number
    wait_for(
        lambda: (d := _secret(kube_api)) is not None and _leaf(d).serial_number != first_serial,
        12,
        "renewal",
    )
    renewed = _secret(kube_api)
    assert renewed is not None
    leaf = _leaf(renewed)
    issued = leaf.not_valid_before_utc + CLOCK_SKEW_BACKDATE
    assert leaf.not_valid_after_utc - issued == timedelta(seconds=20)
    assert datetime.now(UTC) < issued + timedelta(seconds=10), "renewed before half-life"

    # Deleted: restored by the next pass (the next renewal here; at most a resync interval).
    kube_api.delete("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    wait_for(lambda: _secret(kube_api) is not None, 12, "istiod-tls restored")

    # prepare: ca.crt gains the new root while the leaf stays with the active one.
    target = cluster_target(tmp_path / "kubeconfig", CA_NAMESPACE)
    (old,) = (row["id"] for row in authority_rows(target))
    prepared = next(r["id"] for r in authority_rows(target, "prepare") if r["state"] == "prepared")
    wait_for(
        lambda: (d := _secret(kube_api)) is not None and _bundle_ids(d) == {old, prepared},
        5,
        "ca.crt to carry the prepared root",
    )
    during = _secret(kube_api)
    assert during is not None and _issuer_id(during) == old

    # activate: a new leaf from the new authority, the bundle keeping both.
    authority_rows(target, "activate", prepared)
    wait_for(
        lambda: (d := _secret(kube_api)) is not None and _issuer_id(d) == prepared,
        5,
        "a leaf from the activated authority",
    )
    after = _secret(kube_api)
    assert after is not None and _bundle_ids(after) == {old, prepared}

    # taint + revoke the old one: ca.crt drops it; the leaf stays with the active one.
    authority_rows(target, "taint", old)
    authority_rows(target, "revoke", old, "--force")
    wait_for(
        lambda: (d := _secret(kube_api)) is not None and _bundle_ids(d) == {prepared},
        5,
        "ca.crt to drop the revoked root",
    )
    final = _secret(kube_api)
    assert final is not None and _issuer_id(final) == prepared
    assert ca.log().count("BEGIN") == 0, "no key material in the log"


def test_no_istiod_tls_writes_nothing(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_ca("ca-0", "--no-istiod-tls")
    wait_for(
        lambda: any(r.resource == "configmaps" and r.verb == "create" for r in kube_api.requests()),
        5,
        "the leader to publish",
    )
    assert _secret(kube_api) is None
    assert not [r for r in kube_api.requests() if r.name == SECRET_NAME]
