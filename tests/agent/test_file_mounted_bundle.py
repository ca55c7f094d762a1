"""File-mounted mode from the kubelet's `podCertificate` credential bundle and a
`clusterTrustBundle` projection (`agent.file_mounted`, `--credential-bundle`).

- Loading: the bundle is served only when the chain verifies to the projected trust bundle (one
  root or several during a rotation), the key matches, the leaf is in its window and carries one
  SPIFFE ID; each refusal says which, without key material.
- Watching: the kubelet's projected volume (`tests/support/kubelet_volume.py`: both files in one
  `..data` swap) reaching the `SecretCache` SDS and the Workload API serve from; a bad bundle
  refused with the previous one kept and `file_reload_failures` counted; a fixed one picked up;
  a root rotation (new root added, then a leaf of the new root) followed.

In-process (no child process); the real Envoy and py-spiffe drive the same mode in
tests/e2e/test_kubelet_bundle.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from agent.config import AgentConfig
from agent.credential_bundle import MAX_CREDENTIAL_BUNDLE_BYTES
from agent.errors import FileSecretError
from agent.file_mounted import FileMountedSource, FileWatcher, load_credential_bundle_secret
from agent.secrets import SecretCache, TlsSecret
from certs import PrivateKey, generate_private_key, load_cert, private_key_to_pem
from meshca.clock import FakeClock
from tests.agent.test_file_mounted import FileMetricsForTest
from tests.support import mangled_certs
from tests.support.agent_wiring import until
from tests.support.kubelet_volume import kubelet_project
from tests.support.pki import Issued, TestCa

NOW = datetime.now(UTC)
BUNDLE = "credential-bundle.pem"
ROOTS = "root-cert.pem"


@pytest.fixture(scope="module")
def ca() -> TestCa:
    return TestCa(NOW)


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="kb-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def load(directory: Path) -> TlsSecret:
    return load_credential_bundle_secret("default", directory / BUNDLE, directory / ROOTS, now=NOW)


def write(directory: Path, bundle: str, roots: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / BUNDLE).write_text(bundle)
    (directory / ROOTS).write_text(roots)


# --- loading ---------------------------------------------------------------------------------


def test_a_bundle_that_verifies_to_the_projected_roots_is_served(ca: TestCa, workdir: Path) -> None:
    issued = ca.child_ca().issue("app")
    write(workdir, issued.credential_bundle, ca.root_pem)
    secret = load(workdir)
    assert secret.cert_chain_pem == issued.cert_pem
    assert secret.private_key_pem == issued.key_pem


@pytest.mark.parametrize("key_type", ["ECDSAP256", "ECDSAP384", "ECDSAP521", "RSA3072"])
def test_the_key_types_envoy_serves_are_loaded(ca: TestCa, workdir: Path, key_type: str) -> None:
    """The PodCertificateRequest key types but Ed25519 (and RSA4096, as RSA3072 but slower to
    make); a P-521 leaf was seen loaded by the real Envoy 1.40 too."""
    curves = {"ECDSAP256": ec.SECP256R1(), "ECDSAP384": ec.SECP384R1(), "ECDSAP521": ec.SECP521R1()}
    key: PrivateKey
    if key_type in curves:
        key = ec.generate_private_key(curves[key_type])
    else:
        key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    issued = ca.issue("app", key=key)
    write(workdir, issued.credential_bundle, ca.root_pem)
    assert load(workdir).private_key_pem == issued.key_pem


def test_during_a_root_rotation_either_root_will_do(ca: TestCa, workdir: Path) -> None:
    """The kubelet merges every selected ClusterTrustBundle: old and new root in one file."""
    new_root = TestCa(NOW)
    for issuer in (ca, new_root):
        issued = issuer.issue("app")
        write(workdir, issued.credential_bundle, ca.root_pem + new_root.root_pem)
        assert load(workdir).cert_chain_pem == issued.cert_pem


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("another key", "different private key"),
        ("expired", "expired"),
        ("not yet valid", "not valid until"),
        ("foreign root", "does not verify"),
        ("no SPIFFE ID", "not one SPIFFE ID"),
        ("no trust bundle", "cannot read trust bundle"),
        ("trust bundle not PEM", "no PEM CERTIFICATE"),
        ("oversized", "the limit is"),
        ("wrong order", "wrong order"),
        ("leaf key of an unknown algorithm", "unsupported or malformed public key"),
        ("root key of an unknown algorithm", "does not lead to any trusted root"),
    ],
)
def test_bad_bundles_are_refused_saying_why(
    ca: TestCa, workdir: Path, case: str, expected: str
) -> None:
    issued = ca.issue("app")
    bundle, roots = issued.credential_bundle, ca.root_pem
    if case == "another key":
        bundle = ca.issue("app").key_pem + issued.cert_pem
    elif case == "expired":
        bundle = ca.issue(
            "app", ttl=timedelta(minutes=1), now=NOW - timedelta(hours=1)
        ).credential_bundle
    elif case == "not yet valid":
        bundle = ca.issue("app", now=NOW + timedelta(hours=1)).credential_bundle
    elif case == "foreign root":
        roots = TestCa(NOW).root_pem
    elif case == "no SPIFFE ID":
        key_pem, cert_pem = ca.write_serving(workdir, NOW)  # DNS SANs only
        bundle = key_pem.decode() + cert_pem.decode()
    elif case == "trust bundle not PEM":
        roots = "not a certificate\n"
    elif case == "oversized":
        bundle += "\n" * MAX_CREDENTIAL_BUNDLE_BYTES
    elif case == "wrong order":
        bundle = issued.cert_pem + issued.key_pem
    elif case == "leaf key of an unknown algorithm":
        bundle = issued.key_pem + mangled_certs.unknown_key_algorithm_pem(issued.cert)
    elif case == "root key of an unknown algorithm":
        roots = mangled_certs.unknown_key_algorithm_pem(ca.root)
    write(workdir, bundle, roots)
    if case == "no trust bundle":
        (workdir / ROOTS).unlink()
    with pytest.raises(FileSecretError, match=expected) as info:
        load(workdir)
    assert str(workdir / BUNDLE) in str(info.value) or case.startswith(("no trust", "trust"))
    assert "PRIVATE KEY-----" not in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_bundle_path_that_is_no_regular_file_is_refused_unread(
    ca: TestCa, workdir: Path, kind: str
) -> None:
    """A FIFO would block open()/read() forever, /dev/zero never ends: neither is read."""
    (workdir / ROOTS).write_text(ca.root_pem)
    bundle = workdir / BUNDLE
    if kind == "fifo":
        os.mkfifo(bundle)
    elif kind == "device":
        bundle.symlink_to("/dev/zero")
    else:
        bundle.mkdir()
    with pytest.raises(FileSecretError, match=r"not a regular file|Is a directory"):
        load(workdir)


def test_the_mode_is_chosen_by_config(ca: TestCa, workdir: Path) -> None:
    """`--credential-bundle` turns FILE_MOUNTED_CERTS's source to the bundle; the root stays
    `root-cert.pem` in `--file-mounted-dir`."""
    from agent.certificate_source import certificate_source_for
    from agent.metrics import AgentMetrics

    issued = ca.issue("app")
    kubelet_project(workdir / "certs", {BUNDLE: issued.credential_bundle, ROOTS: ca.root_pem})
    config = AgentConfig(
        file_mounted_certs=True,
        file_mounted_dir=workdir / "certs",
        credential_bundle=workdir / "certs" / BUNDLE,
    )

    async def main() -> None:
        cache, clock = SecretCache(), FakeClock(NOW)
        source = certificate_source_for(config, cache, clock, AgentMetrics(clock), None)
        assert isinstance(source, FileMountedSource)
        await source.start()
        try:
            assert source.has_valid_certificate(NOW)
            held = cache.get("default")
            assert isinstance(held, TlsSecret) and held.cert_chain_pem == issued.cert_pem
        finally:
            await source.close()

    asyncio.run(main())


# --- watching the kubelet's volume -----------------------------------------------------------


def served_serial(cache: SecretCache) -> int | None:
    secret = cache.get("default")
    if not isinstance(secret, TlsSecret):
        return None
    return int(load_cert(secret.cert_chain_pem).serial_number)


def bad_bundles(ca: TestCa, good: Issued) -> dict[str, str]:
    """What the kubelet never writes (and one thing it might: a leaf the roots don't trust)."""
    fresh = ca.issue("app")
    sec1 = (
        generate_private_key()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        .decode()
    )
    return {
        "key not PKCS#8": sec1 + fresh.cert_pem,
        "blocks in the wrong order": fresh.cert_pem + fresh.key_pem,
        "two keys": fresh.key_pem
        + private_key_to_pem(generate_private_key()).decode()
        + fresh.cert_pem,
        "no chain": fresh.key_pem,
        "key not matching the leaf": good.key_pem + fresh.cert_pem,
        "oversized": fresh.credential_bundle + "\n" * MAX_CREDENTIAL_BUNDLE_BYTES,
        "leaf of another root": TestCa(NOW).issue("app").credential_bundle,
    }


def test_the_kubelets_updates_reach_the_cache_and_bad_ones_are_refused(
    ca: TestCa, workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mount = workdir / "pod-certs"
    metrics = FileMetricsForTest.fresh()

    async def main() -> None:
        first = ca.issue("app")
        kubelet_project(mount, {BUNDLE: first.credential_bundle, ROOTS: ca.root_pem})
        cache = SecretCache()
        source = FileMountedSource(
            cache,
            FileWatcher(clock=FakeClock(NOW), metrics=metrics, debounce=0.02),
            root_path=mount / ROOTS,
            credential_bundle=mount / BUNDLE,
        )
        await source.start()
        try:
            assert served_serial(cache) == first.serial
            assert source.ready and metrics.failures("default") == 0

            # The kubelet refreshes: new key, new leaf, one `..data` swap. Twice, since the
            # second swap is where a watch on a file's inode goes wrong.
            latest = first
            for _ in range(2):
                latest = ca.issue("app")
                kubelet_project(mount, {BUNDLE: latest.credential_bundle, ROOTS: ca.root_pem})
                await until(lambda serial=latest.serial: served_serial(cache) == serial)  # type: ignore[misc]

            for number, (case, text) in enumerate(bad_bundles(ca, latest).items(), start=1):
                kubelet_project(mount, {BUNDLE: text, ROOTS: ca.root_pem})
                await until(lambda n=number: metrics.failures("default") >= n)  # type: ignore[misc]
                assert served_serial(cache) == latest.serial, f"{case}: the previous one stays"
                assert source.last_error, case

            # A fixed bundle is picked up and the error clears.
            fixed = ca.issue("app")
            kubelet_project(mount, {BUNDLE: fixed.credential_bundle, ROOTS: ca.root_pem})
            await until(lambda: served_serial(cache) == fixed.serial)
            assert source.last_error is None

            # A root rotation: the projection gains the new root, then the pod's next leaf
            # comes from it; ROOTCA follows, the leaf is accepted against the merged roots.
            new_root = TestCa(NOW)
            both = ca.root_pem + new_root.root_pem
            kubelet_project(mount, {BUNDLE: fixed.credential_bundle, ROOTS: both})
            await until(lambda: getattr(cache.get("ROOTCA"), "trusted_ca_pem", "") == both)
            moved = new_root.issue("app")
            kubelet_project(mount, {BUNDLE: moved.credential_bundle, ROOTS: both})
            await until(lambda: served_serial(cache) == moved.serial)
            # The old root leaves the projection: the new-root leaf still verifies.
            kubelet_project(mount, {BUNDLE: moved.credential_bundle, ROOTS: new_root.root_pem})
            await until(
                lambda: getattr(cache.get("ROOTCA"), "trusted_ca_pem", "") == new_root.root_pem
            )
            assert source.last_error is None and served_serial(cache) == moved.serial
        finally:
            await source.stop()

    asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refusing")]
    assert len(refusals) >= len(bad_bundles(ca, ca.issue("app")))
    for line in refusals:
        assert "keeping the previous version" in line
        assert "BEGIN" not in line and "MII" not in line
