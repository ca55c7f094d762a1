"""`authorize_csr`'s shortcut for the usual CSR (one SAN extension, one URI) decides exactly as
the full checks do: whatever it accepts, `describe_csr` shows to ask for the identity alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ca_server.authz import _asks_for_exactly, authorize_csr
from ca_server.errors import RequestError
from certs import SpiffeId, describe_csr, generate_private_key, load_csr
from certs.keys import signature_hash_for

SLEEP = SpiffeId("cluster.local", "default", "sleep")
KEY = generate_private_key()


def _csr(
    names: Sequence[x509.GeneralName], *more: x509.ExtensionType, critical: bool = True
) -> x509.CertificateSigningRequest:
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=critical)
    for extension in more:
        builder = builder.add_extension(extension, critical=False)
    pem = builder.sign(KEY, signature_hash_for(KEY)).public_bytes(Encoding.PEM)
    return load_csr(pem)


URI = x509.UniformResourceIdentifier(SLEEP.uri)
USAGE = x509.KeyUsage(True, False, True, False, False, False, False, False, False)
CASES: dict[str, tuple[list[x509.GeneralName], tuple[x509.ExtensionType, ...], str | None]] = {
    "the usual": ([URI], (), None),
    "not critical": ([URI], (), None),
    "with keyUsage": ([URI], (USAGE,), None),
    "another URI": ([x509.UniformResourceIdentifier(SLEEP.uri + "x")], (), "csr-identity-mismatch"),
    "two URIs": ([URI, URI], (), "csr-multiple-identities"),
    "a DNS SAN too": ([URI, x509.DNSName("sleep")], (), "csr-extra-sans"),
    "the URI as DNS": ([x509.DNSName(SLEEP.uri)], (), "csr-extra-sans"),
    "no SAN": ([], (), "csr-no-identity"),
    "CA:true": ([URI], (x509.BasicConstraints(ca=True, path_length=None),), "csr-asks-ca"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_shortcut_and_the_full_checks_agree(case: str) -> None:
    names, more, refusal = CASES[case]
    csr = _csr(names, *more, critical=case != "not critical")
    if _asks_for_exactly(csr, SLEEP):
        contents = describe_csr(csr)
        assert contents.uri_sans == (SLEEP.uri,)
        assert contents.extension_names == ("subjectAltName",)
        assert not (contents.dns_sans or contents.ip_sans or contents.email_sans)
        assert not (contents.other_san_count or contents.asks_for_ca)
    if refusal is None:
        assert authorize_csr(csr, SLEEP) == csr.public_key()
    else:
        with pytest.raises(RequestError) as refused:
            authorize_csr(csr, SLEEP)
        assert refused.value.reason == refusal


def test_the_usual_csr_takes_the_shortcut() -> None:
    assert _asks_for_exactly(_csr([URI]), SLEEP)
    assert not _asks_for_exactly(_csr([URI]), SpiffeId("cluster.local", "default", "other"))
