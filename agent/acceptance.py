"""The one rule for "may the agent serve this certificate?", wherever it came from.

Three producers hand the agent a certificate chain: the CA's answer (`agent.ca_client`), the
files a previous run left in `--output-dir` (`agent.cert_state`) and mounted files
(`FILE_MOUNTED_CERTS`, `agent.file_mounted`). All three go through `accept_certificate()`, in
this order (the first failing check is the reason given):

1. validity window: the leaf is valid at `now` (NotBefore ≤ now < NotAfter);
2. identity: the leaf's URI SANs are exactly the identity asked for, when one is (file-mounted
   mode serves whatever the operator mounted, so it passes none);
3. key: the leaf certifies the private key the agent holds;
4. roots: the chain verifies to one of the trusted roots at `now`, when roots come with it
   (the CA's answer and restored files do; mounted files carry the root as a separate secret).

Pure: no I/O, the caller supplies `now`. Raises `CertificateRefused` naming the failed check,
never key material.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cryptography import x509

from agent.errors import CertificateRefused
from certs import (
    CertsError,
    PrivateKey,
    SpiffeId,
    describe_certificate,
    key_matches_certificate,
    verify_chain,
)


def accept_certificate(
    chain: Sequence[x509.Certificate],
    key: PrivateKey,
    *,
    now: datetime,
    identity: SpiffeId | None = None,
    roots: Sequence[x509.Certificate] | None = None,
) -> None:
    """Returns if the agent may serve `chain` (leaf first) with `key` at `now`; else raises
    `CertificateRefused` saying which check failed (see the module docstring)."""
    if not chain:
        raise CertificateRefused("the certificate chain is empty")
    leaf = chain[0]
    not_before, not_after = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    if now >= not_after:
        raise CertificateRefused(f"the certificate expired at {not_after.isoformat()}")
    if now < not_before:
        raise CertificateRefused(f"the certificate is not valid until {not_before.isoformat()}")
    if identity is not None:
        try:
            uris = describe_certificate(leaf).uri_sans
        except CertsError as exc:
            raise CertificateRefused(str(exc)) from None
        if uris != (identity.uri,):
            raise CertificateRefused(
                f"the certificate is for {list(uris)}, but this agent is {identity.uri}"
            )
    try:
        matches = key_matches_certificate(key, leaf)
    except CertsError as exc:  # e.g. a leaf key of a kind meshca does not use
        raise CertificateRefused(str(exc)) from None
    if not matches:
        raise CertificateRefused(
            "the certificate is for a different private key (the key does not match it)"
        )
    if roots is not None:
        try:
            verify_chain(chain, roots, now=now)
        except CertsError as exc:
            raise CertificateRefused(f"the certificate chain does not verify: {exc}") from None
