"""Restoring the certificate a previous run of the agent left in its output directory.

Why: an agent restarted while the CA is unreachable (a crash, an OOM kill, a node reboot during a
CA outage) would otherwise have nothing to serve until the CA came back, although the files it
wrote a moment ago (`--output-dir`, see `agent.file_output`) still hold a perfectly good
certificate. `load_previous_certificate()` decides whether they may be served again; the
scheduler (`agent.scheduler`) calls it once per identity, as that identity's start hook, before
its first CA call. So the pod agent (`OUTPUT/`) and the node agent (`OUTPUT/<ns>/<sa>/`) both
restore.

The files are adopted only if all of these hold, checked in this order (the first failure is
the reason given):

1. `cert-chain.pem`, `key.pem` and `root-cert.pem` of the current generation can be read
   (`agent.output_dir.read_current`) and parse;
2. `agent.acceptance.accept_certificate` accepts them for exactly this identity, key and root
   bundle now: the same rule as for a CA's answer;
3. the leaf has at least `MIN_REMAINING_FRACTION` of its lifetime left.

The directory itself is trusted as the agent's own (it is created 0700 and only the agent writes
it); the checks guard against stale or foreign content, not against an attacker who can write it.

Rotation: the restored certificate is treated as if it had been received at its NotBefore plus
the CA's clock-skew backdate (`certs.CLOCK_SKEW_BACKDATE`, two minutes), i.e. when the CA issued
it, so the normal rotation rule applies; one already past its rotation point is renewed at once,
and served meanwhile.

Pure apart from reading the three files; the caller supplies `now`. File reads and key parsing
are blocking: the scheduler runs this in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from agent.acceptance import accept_certificate
from agent.errors import CertificateNotRestored, CertificateRefused, NoPreviousCertificate
from agent.output_dir import (
    CERT_CHAIN_FILE,
    ROOT_CERT_FILE,
    read_current,
)
from agent.signing import SignedCertificate
from certs import (
    CLOCK_SKEW_BACKDATE,
    CertsError,
    SpiffeId,
    certs_to_pem,
    format_duration,
    load_certs,
    load_private_key,
)

__all__ = [
    "MIN_REMAINING_FRACTION",
    "CertificateNotRestored",
    "NoPreviousCertificate",
    "RestoredCertificate",
    "load_previous_certificate",
]

MIN_REMAINING_FRACTION = 0.05
"""A certificate with less than this fraction of its lifetime left is not worth restoring."""


@dataclass(frozen=True)
class RestoredCertificate:
    """A previous run's certificate that passed every check, ready to publish."""

    signed: SignedCertificate  # `received_at`: when the CA issued it (see the module docstring)
    key_pem: str = field(repr=False)
    source: Path  # the generation directory the files were read from


def load_previous_certificate(
    directory: Path, identity: SpiffeId, now: datetime
) -> RestoredCertificate:
    """The certificate, key and root bundle in `directory` (an output directory), if this agent
    may serve them for `identity` at `now`; else raises `CertificateNotRestored` with the reason
    (`NoPreviousCertificate` when there are no files at all)."""
    files, source = read_current(directory)
    try:
        chain = load_certs(files.chain_pem, what=CERT_CHAIN_FILE)
        roots = load_certs(files.root_pem, what=ROOT_CERT_FILE)
        key = load_private_key(files.key_pem)
    except CertsError as exc:
        raise CertificateNotRestored(f"the files do not parse: {exc}") from None
    try:
        accept_certificate(chain, key, now=now, identity=identity, roots=roots)
    except CertificateRefused as exc:
        raise CertificateNotRestored(str(exc)) from None
    leaf = chain[0]
    not_before, not_after = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    lifetime, remaining = not_after - not_before, not_after - now
    if remaining < lifetime * MIN_REMAINING_FRACTION:
        raise CertificateNotRestored(
            f"the certificate has only {format_duration(remaining)} of its "
            f"{format_duration(lifetime)} lifetime left"
        )
    signed = SignedCertificate(
        chain_pem=certs_to_pem(chain),
        root_bundle_pem=certs_to_pem(roots),
        leaf=leaf,
        received_at=min(not_before + CLOCK_SKEW_BACKDATE, now),
    )
    return RestoredCertificate(signed=signed, key_pem=files.key_pem, source=source)
