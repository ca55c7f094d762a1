"""The ClusterTrustBundle publisher's rules, pure (`ca_server.kube.trust_bundles`), and the
phases a plugged-in CA's roots get (`DriverCore.root_phases`). The publisher against an API
server: tests/k8s/test_trust_bundles.py (fake), tests/k8s_real/test_trust_bundles.py (real)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from ca_server.authority.driver_core import DriverCore, DriverSettings
from ca_server.authority.slots import Phase, authority_id
from ca_server.fleet import DirectoryLedgerSink
from ca_server.kube.trust_bundles import (
    ISTIO_BUNDLE_NAME,
    ISTIO_SIGNER,
    Bundle,
    Root,
    plan,
    root_bundle_name,
    wanted_bundles,
)
from ca_server.metrics import CaMetrics
from certs import make_authority
from meshca.clock import SystemClock
from tests.support.pki import TestCa

SIGNER = "meshca.example.com/spiffe"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_one_bundle_per_root_named_by_signer_and_fingerprint_labelled_with_its_phase():
    a, b = TestCa(NOW), TestCa(NOW)
    roots = [
        Root(a.cert, authority_id(a.cert), "old", tainted=True),
        Root(b.cert, authority_id(b.cert), "active"),
    ]
    wanted = wanted_bundles(SIGNER, roots, "BUNDLE")
    name_a = root_bundle_name(SIGNER, a.cert)
    assert name_a.startswith("meshca.example.com:spiffe:") and len(name_a.rsplit(":", 1)[1]) == 16
    assert set(wanted) == {name_a, root_bundle_name(SIGNER, b.cert), ISTIO_BUNDLE_NAME}
    assert wanted[name_a].trust_bundle == a.root_pem
    assert wanted[name_a].labels == {
        "app.kubernetes.io/managed-by": "meshca",
        "meshca.io/trust": "true",
        "meshca.io/phase": "old",
        "meshca.io/tainted": "true",
        "meshca.io/authority": authority_id(a.cert),
    }
    istio = wanted[ISTIO_BUNDLE_NAME]
    assert (istio.signer, istio.trust_bundle) == (ISTIO_SIGNER, "BUNDLE")
    assert "meshca.io/trust" not in istio.labels
    assert set(wanted_bundles(None, roots, "BUNDLE")) == {ISTIO_BUNDLE_NAME}
    assert ISTIO_BUNDLE_NAME not in wanted_bundles(SIGNER, roots, None)


def test_the_plan_creates_restores_and_deletes_keeping_others_labels():
    a, b = TestCa(NOW), TestCa(NOW)
    wanted = wanted_bundles(SIGNER, [Root(a.cert, authority_id(a.cert), "active")], None)
    (name,) = wanted
    good = wanted[name]
    assert plan({}, wanted).create == (good,)
    kept_label = Bundle(name, SIGNER, good.trust_bundle, {**good.labels, "team": "x"})
    assert plan({name: kept_label}, wanted).empty
    unlabelled = Bundle(name, SIGNER, good.trust_bundle, {"team": "x"})
    swapped = Bundle(name, SIGNER, b.root_pem, good.labels)
    for edited in (unlabelled, swapped):
        assert plan({name: edited}, wanted).update == ((edited, good),)
    planted = Bundle(f"{SIGNER.replace('/', ':')}:planted", SIGNER, b.root_pem, good.labels)
    todo = plan({name: good, planted.name: planted}, wanted)
    assert todo.delete == (planted,) and not todo.create and not todo.update


def test_a_plugged_in_ca_s_roots_get_their_phase_from_the_signing_chain(tmp_path: Path):
    """Root A signs; B, newer, is in the bundle (the operator's A+B step): A active, B
    prepared. Then B signs with A still there: B active, A old."""
    older = TestCa(NOW - timedelta(days=10))
    newer = TestCa(NOW)
    core = DriverCore(
        DriverSettings(tmp_path, "ca-0", 1.0, DirectoryLedgerSink(tmp_path, "ca-0")),
        SystemClock(),
        CaMetrics(),
    )
    both = [older.cert, newer.cert]
    core.adopt(make_authority(older.cert, older.key, [], both), None, tuple(both), {})
    ids = authority_id(older.cert), authority_id(newer.cert)
    assert core.root_phases() == {ids[0]: Phase.ACTIVE, ids[1]: Phase.PREPARED}
    core.adopt(make_authority(newer.cert, newer.key, [], both), None, tuple(both), {})
    assert core.root_phases() == {ids[0]: Phase.OLD, ids[1]: Phase.ACTIVE}
