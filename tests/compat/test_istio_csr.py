"""The first CSR of Istio's agent, as it sends it (`tests/support/istio_wire.py`): RSA-2048 by
default or EC P-256 (`ECC_SIGNATURE_ALGORITHM=ECDSA`), a subject with an empty organization,
one critical SAN holding only the URI, `CertSigner: ""` in the request metadata, `ClusterID`
header, a 24 h `SECRET_TTL`, over the TLS port with its service-account token."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from cryptography import x509

from certs import SpiffeId, describe_certificate, load_certs, verify_chain
from tests.compat.conftest import CompatCa
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.istio_wire import (
    CERT_SIGNER_METADATA,
    CLUSTER_ID_HEADER,
    SECRET_TTL_SECONDS,
    KeyKind,
    istio_csr,
    istio_key,
)

SLEEP = SpiffeId("cluster.local", "default", "sleep")


@pytest.mark.parametrize("compat_ca", ["self-signed", "plugged-2"], indirect=True)
@pytest.mark.parametrize("kind", ["rsa-2048", "ec-p256"])
def test_istios_first_csr_is_signed_as_it_is_sent(compat_ca: CompatCa, kind: KeyKind):
    key = istio_key(kind)
    csr = istio_csr(SLEEP, key)
    assert x509.load_pem_x509_csr(csr.encode()).subject.rfc4514_string() == "O="
    with ca_stub(compat_ca.server.addr, compat_ca.server.root_pem) as stub:
        chain = create_certificate(
            stub,
            csr,
            token=compat_ca.server.issuer.token("default", "sleep"),
            ttl_seconds=SECRET_TTL_SECONDS,
            metadata=CERT_SIGNER_METADATA,
            headers=[CLUSTER_ID_HEADER],
        )
    leaf = load_certs(chain[0].encode())[0]
    assert leaf.public_key() == key.public_key()
    info = describe_certificate(leaf)
    assert info.identity == SLEEP.uri
    # Istio's layout: one certificate per element, then the whole bundle as the last element.
    assert len(chain) == 1 + len(compat_ca.server.authority.ca_chain) + 1
    path = [c for element in chain[:-1] for c in load_certs(element.encode())]
    verify_chain(path, load_certs(chain[-1].encode()), now=datetime.now(UTC))
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert lifetime.total_seconds() >= SECRET_TTL_SECONDS  # 24 h granted (plus the backdating)
    line = compat_ca.server.issued_lines()[-1]
    assert (line["identity"], line["granted_ttl_seconds"]) == (SLEEP.uri, SECRET_TTL_SECONDS)
