"""Restoring the certificate a previous run of the agent left in its output directory.

Why: an agent restarted while the CA is unreachable (a crash, an OOM kill, a node reboot during a
CA outage) would otherwise have nothing to serve until the CA came back, although the files it
wrote a moment ago (`--output-dir`, see `agent.file_output`) still hold a perfectly good
certificate. `load_previous_certificate()` decides whether they may be served again; the
`SecretManager` calls it once, before its first CA call.

The files are adopted only if all of these hold, checked in this order (the first failure is
the reason given):

1. `cert-chain.pem`, `key.pem` and `root-cert.pem` can be read (through `..data`, resolved once,
   so the three come from one generation) and parse;
2. the leaf is valid now and has at least `MIN_REMAINING_FRACTION` of its lifetime left;
3. the leaf names exactly the identity this agent is configured for, certifies the key, and the
   chain verifies to the bundle in `root-cert.pem`: the same rule as for a CA's answer
   (`agent.ca_client.check_certificate`).

The directory itself is trusted as the agent's own (it is created 0700 and only the agent writes
it); the checks guard against stale or foreign content, not against an attacker who can write it.

Rotation: the restored certificate is treated as if it had been received at its NotBefore plus
the CA's clock-skew backdate (`certs.CLOCK_SKEW_BACKDATE`, two minutes), i.e. when the CA issued
it, so the normal rotation rule applies; one already past its rotation point is renewed at once,
and served meanwhile.

Pure apart from reading the three files; the caller supplies `now`. File reads and key parsing
are blocking: the SecretManager runs this in a worker thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from agent.ca_client import CertificateCheckError, SignedCertificate, check_certificate
from agent.file_output import CERT_CHAIN_FILE, DATA_LINK, KEY_FILE, ROOT_CERT_FILE
from certs import (
    CLOCK_SKEW_BACKDATE,
    CertsError,
    SpiffeId,
    certs_to_pem,
    format_duration,
    load_certs,
    load_private_key,
)

MIN_REMAINING_FRACTION = 0.05
"""A certificate with less than this fraction of its lifetime left is not worth restoring."""


class CertificateNotRestored(Exception):
    """Why the files of a previous run are not served; names files and checks, never content."""


class NoPreviousCertificate(CertificateNotRestored):
    """The directory holds none of the three files: a first start, nothing to restore."""


@dataclass(frozen=True)
class RestoredCertificate:
    """A previous run's certificate that passed every check, ready to publish."""

    signed: SignedCertificate  # `received_at`: when the CA issued it (see the module docstring)
    key_pem: str = field(repr=False)
    source: Path  # the generation directory the files were read from


def load_previous_certificate(
    directory: Path, identity: SpiffeId, now: datetime
) -> RestoredCertificate:
    """The certificate, key and root bundle in `directory` (an `--output-dir`), if this agent
    may serve them for `identity` at `now`; else raises `CertificateNotRestored` with the reason
    (`NoPreviousCertificate` when there are no files at all)."""
    source = _generation(directory)
    paths = [source / name for name in (CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE)]
    if not any(path.exists() for path in paths):
        raise NoPreviousCertificate(f"no {CERT_CHAIN_FILE}, {KEY_FILE} or {ROOT_CERT_FILE}")
    chain_text, key_text, root_text = (_read_pem(path) for path in paths)
    try:
        chain = load_certs(chain_text, what=CERT_CHAIN_FILE)
        roots = load_certs(root_text, what=ROOT_CERT_FILE)
        key = load_private_key(key_text)
    except CertsError as exc:
        raise CertificateNotRestored(f"the files do not parse: {exc}") from None
    leaf = chain[0]
    not_before, not_after = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    if now >= not_after:
        raise CertificateNotRestored(f"the certificate expired at {not_after.isoformat()}")
    if now < not_before:
        raise CertificateNotRestored(f"the certificate is not valid until {not_before.isoformat()}")
    lifetime, remaining = not_after - not_before, not_after - now
    if remaining < lifetime * MIN_REMAINING_FRACTION:
        raise CertificateNotRestored(
            f"the certificate has only {format_duration(remaining)} of its "
            f"{format_duration(lifetime)} lifetime left"
        )
    try:
        check_certificate(chain, roots, identity, key, now=now)
    except CertificateCheckError as exc:
        raise CertificateNotRestored(str(exc)) from None
    signed = SignedCertificate(
        chain_pem=certs_to_pem(chain),
        root_bundle_pem=certs_to_pem(roots),
        leaf=leaf,
        received_at=min(not_before + CLOCK_SKEW_BACKDATE, now),
    )
    return RestoredCertificate(signed=signed, key_pem=key_text, source=source)


def _generation(directory: Path) -> Path:
    """The directory `..data` points to (one consistent set), else `directory` itself."""
    data = directory / DATA_LINK
    if data.is_symlink():
        return Path(os.path.realpath(data))
    return directory


def _read_pem(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CertificateNotRestored(
            f"cannot read {path.name}: {exc.strerror or type(exc).__name__}"
        ) from None
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise CertificateNotRestored(f"{path.name} is not a PEM text file") from None
