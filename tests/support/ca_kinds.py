"""The kinds of authority an Istio mesh may bring, built for a CA under test:

- `self-signed`: meshca's own root signs the workloads;
- `self-signed-overlap`: a root rotation in progress (the new root signs, the bundle holds the
  old and the new);
- `plugged-1`, `plugged-2`: a plugged-in intermediate (`--cacerts-dir`, Istio's `cacerts`
  layout, loaded by the production loader) one or two levels below the organisation's root;
- `plugged-overlap`: a plugged-in intermediate under a new root, the bundle holding both.

`authority_for(kind, directory)` builds one; `new_root`, `new_intermediate` and `write_cacerts`
are its parts, for tests that lay out a `cacerts` directory themselves (tests/compat, tests/e2e).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from ca_server.authority.plugged import detect_plugged_ca
from certs import (
    PrivateKey,
    SigningAuthority,
    build_intermediate_certificate,
    build_root_certificate,
    cert_to_pem,
    certs_to_pem,
    generate_private_key,
    private_key_to_pem,
)

TRUST_DOMAIN = "cluster.local"
CA_KINDS = ("self-signed", "self-signed-overlap", "plugged-1", "plugged-2", "plugged-overlap")


@dataclass(frozen=True)
class CaCert:
    cert: x509.Certificate
    key: PrivateKey


def new_root(now: datetime) -> CaCert:
    """A root as meshca makes them: every root of a rotation has the same name, so the path is
    found by key (AKI/SKI and signature), not by name."""
    key = generate_private_key()
    return CaCert(
        build_root_certificate(key, TRUST_DOMAIN, now=now, lifetime=timedelta(days=30)), key
    )


def new_intermediate(parent: CaCert, name: str, now: datetime, *, below: int = 0) -> CaCert:
    """An intermediate CA under `parent` allowing `below` more CA levels under it."""
    key = generate_private_key()
    cert = build_intermediate_certificate(
        key.public_key(),
        parent.cert,
        parent.key,
        TRUST_DOMAIN,
        now=now,
        lifetime=timedelta(days=7),
        common_name=name,
        path_length=below,
    )
    return CaCert(cert, key)


def write_cacerts(
    directory: Path, issuing: CaCert, chain: list[x509.Certificate], roots: list[x509.Certificate]
) -> Path:
    """Writes Istio's `cacerts` layout to `directory`: `ca-cert.pem`, `ca-key.pem`,
    `cert-chain.pem` (the issuing certificate up to the root), `root-cert.pem` (the bundle)."""
    directory.mkdir(parents=True)
    (directory / "ca-cert.pem").write_text(cert_to_pem(issuing.cert))
    (directory / "ca-key.pem").write_bytes(private_key_to_pem(issuing.key))
    (directory / "cert-chain.pem").write_text(certs_to_pem(chain))
    (directory / "root-cert.pem").write_text(certs_to_pem(roots))
    return directory


def plugged_authority(
    directory: Path, issuing: CaCert, chain: list[x509.Certificate], roots: list[x509.Certificate]
) -> SigningAuthority:
    """`write_cacerts`, then loads the directory as `--cacerts-dir` does."""
    write_cacerts(directory, issuing, chain, roots)
    plugged = detect_plugged_ca(directory)
    assert plugged is not None
    return plugged.load(datetime.now(UTC))


def authority_for(kind: str, directory: Path) -> tuple[SigningAuthority, dict[str, CaCert]]:
    """The authority of CA `kind` and its parts by name (`root`, `old-root`, `top`, ...)."""
    now = datetime.now(UTC)
    root = new_root(now)
    parts = {"root": root}
    if kind == "self-signed":
        return SigningAuthority(root.cert, root.key, (), (root.cert,)), parts
    old = new_root(now - timedelta(days=1))
    parts["old-root"] = old
    if kind == "self-signed-overlap":
        return SigningAuthority(root.cert, root.key, (), (old.cert, root.cert)), parts
    if kind in ("plugged-1", "plugged-overlap"):
        mesh = parts["mesh"] = new_intermediate(root, "mesh intermediate", now)
        roots = [old.cert, root.cert] if kind == "plugged-overlap" else [root.cert]
        return plugged_authority(directory, mesh, [mesh.cert, root.cert], roots), parts
    if kind == "plugged-2":
        top = parts["top"] = new_intermediate(root, "org intermediate", now, below=1)
        mesh = parts["mesh"] = new_intermediate(top, "mesh intermediate", now)
        chain = [mesh.cert, top.cert, root.cert]
        return plugged_authority(directory, mesh, chain, [root.cert]), parts
    raise AssertionError(f"unknown CA kind {kind}")
