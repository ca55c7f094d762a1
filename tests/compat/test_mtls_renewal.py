"""Renewal over mTLS as Istio's agent does it (`PROV_CERT`, the CA's `--mtls-listen` port): the
agent connects with the key and `cert-chain.pem` of its current certificate and sends a CSR,
under each kind of CA an Istio mesh may bring (`tests/support/ca_kinds.py`, served by
`tests/compat/conftest.py`).

Each case names the Istio behaviour it reproduces. The token sent along is one the CA does not
trust (signed by a foreign key), so only the client certificate can authenticate the renewal;
the audit line must say so.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import grpc
import pytest

from certs import (
    SpiffeId,
    build_workload_certificate,
    cert_to_pem,
    describe_certificate,
    load_certs,
    verify_chain,
)
from tests.compat.conftest import CompatCa
from tests.support.ca_client import ca_stub, create_certificate
from tests.support.ca_kinds import new_intermediate, new_root
from tests.support.inprocess_ca import refused
from tests.support.istio_wire import (
    CERT_SIGNER_METADATA,
    CLUSTER_ID_HEADER,
    SECRET_TTL_SECONDS,
    istio_cert_chain_pem,
    istio_csr,
    istio_key,
    key_pem,
)
from tests.support.token_issuer import RsaIssuer

SLEEP = SpiffeId("cluster.local", "default", "sleep")
HTTPBIN = SpiffeId("cluster.local", "default", "httpbin")


def first_certificate(ca: CompatCa, identity: SpiffeId = SLEEP) -> tuple[bytes, list[str]]:
    """What the agent holds after its first CSR (token over the TLS port): key.pem and the
    CA's `cert_chain`."""
    key = istio_key("ec-p256")
    with ca_stub(ca.server.addr, ca.server.root_pem) as stub:
        chain = create_certificate(
            stub,
            istio_csr(identity, key),
            token=ca.server.issuer.token(identity.namespace, identity.service_account),
            ttl_seconds=SECRET_TTL_SECONDS,
            metadata=CERT_SIGNER_METADATA,
            headers=[CLUSTER_ID_HEADER],
        )
    return key_pem(key), chain


def renew(
    ca: CompatCa,
    client_key: bytes,
    presented: bytes,
    *,
    token: str | None = None,
    identity: SpiffeId = SLEEP,
) -> list[str]:
    """One renewal over the mTLS port presenting `presented` (a `cert-chain.pem`)."""
    with ca_stub(
        ca.server.mtls_addr,
        ca.server.root_pem,
        client_key_pem=client_key,
        client_chain_pem=presented,
    ) as stub:
        return create_certificate(
            stub,
            istio_csr(identity, istio_key("ec-p256")),
            token=token,
            ttl_seconds=SECRET_TTL_SECONDS,
            metadata=CERT_SIGNER_METADATA,
            headers=[CLUSTER_ID_HEADER],
        )


def _pem(*elements: str) -> bytes:
    return istio_cert_chain_pem(list(elements))


# What the client presents, from the CA's answer to its previous CSR.
Presentation = Callable[[list[str]], bytes]
LEAF_ONLY: Presentation = lambda chain: _pem(chain[0])  # noqa: E731
ISTIO_FILE: Presentation = istio_cert_chain_pem  # leaf, intermediates, the whole bundle
MESHCA_FILE: Presentation = lambda chain: _pem(*chain[:-1])  # noqa: E731  leaf, intermediates

ACCEPTED = [
    pytest.param(
        "self-signed",
        LEAF_ONLY,
        "a PROV_CERT cert-chain.pem holding the leaf alone (made by hand or by a tool)",
        id="self-signed:leaf",
    ),
    pytest.param(
        "self-signed",
        ISTIO_FILE,
        "Istio's cert-chain.pem under istiod's self-signed root: the leaf, then the root",
        id="self-signed:leaf+root",
    ),
    pytest.param(
        "self-signed-overlap",
        ISTIO_FILE,
        "Istio's cert-chain.pem during a root overlap: the leaf, then both roots of the bundle",
        id="overlap:leaf+two-roots",
    ),
    pytest.param(
        "plugged-1",
        MESHCA_FILE,
        "a cert-chain.pem of leaf + intermediate (meshca's agent, cert-manager's istio-csr)",
        id="plugged-1:leaf+intermediate",
    ),
    pytest.param(
        "plugged-1",
        ISTIO_FILE,
        "Istio's cert-chain.pem under a plugged-in cacerts: leaf, intermediate, root",
        id="plugged-1:leaf+intermediate+root",
    ),
    pytest.param(
        "plugged-2",
        MESHCA_FILE,
        "leaf + two intermediates (cacerts under an organisation's intermediate)",
        id="plugged-2:leaf+intermediates",
    ),
    pytest.param(
        "plugged-2",
        ISTIO_FILE,
        "Istio's cert-chain.pem under a two-level cacerts: leaf, both intermediates, root",
        id="plugged-2:leaf+intermediates+root",
    ),
    pytest.param(
        "plugged-overlap",
        ISTIO_FILE,
        "Istio's cert-chain.pem while a plugged-in CA moves to a new root: leaf, "
        "intermediate, both roots",
        id="plugged-overlap:leaf+intermediate+two-roots",
    ),
]


@pytest.mark.parametrize(("compat_ca", "present", "behaviour"), ACCEPTED, indirect=["compat_ca"])
def test_renewal_over_mtls_authenticates_the_leaf(
    compat_ca: CompatCa, present: Presentation, behaviour: str, untrusted_issuer: RsaIssuer
):
    client_key, chain = first_certificate(compat_ca)
    untrusted_token = untrusted_issuer.token("default", "sleep")
    renewed = renew(compat_ca, client_key, present(chain), token=untrusted_token)

    leaf = load_certs(renewed[0].encode())[0]
    assert describe_certificate(leaf).identity == SLEEP.uri, behaviour
    assert leaf.serial_number != load_certs(chain[0].encode())[0].serial_number
    path = [c for element in renewed[:-1] for c in load_certs(element.encode())]
    verify_chain(path, compat_ca.server.authority.roots, now=datetime.now(UTC))
    line = compat_ca.server.issued_lines()[-1]
    assert line["authenticator"] == "client-certificate", (behaviour, line)
    assert line["caller"] == f"x509:{SLEEP.uri}"
    assert line["serial"] == format(leaf.serial_number, "x")


@pytest.mark.parametrize("compat_ca", ["self-signed-overlap"], indirect=True)
def test_a_leaf_of_the_old_root_renews_during_the_overlap(
    compat_ca: CompatCa, untrusted_issuer: RsaIssuer
):
    """Istio's agent got its certificate before the rotation activated the new root: its leaf
    is signed by the old root, and its cert-chain.pem holds the leaf and both roots."""
    old = compat_ca.parts["old-root"]
    key = istio_key("ec-p256")
    now = datetime.now(UTC)
    leaf = build_workload_certificate(
        key.public_key(),
        SLEEP,
        old.cert,
        old.key,
        not_before=now - timedelta(minutes=2),
        not_after=now + timedelta(hours=1),
    )
    presented = _pem(cert_to_pem(leaf), compat_ca.server.authority.root_bundle_pem)
    renewed = renew(
        compat_ca, key_pem(key), presented, token=untrusted_issuer.token("default", "sleep")
    )
    assert describe_certificate(load_certs(renewed[0].encode())[0]).identity == SLEEP.uri
    assert compat_ca.server.issued_lines()[-1]["authenticator"] == "client-certificate"


@pytest.mark.parametrize("compat_ca", ["self-signed", "plugged-1"], indirect=True)
def test_the_renewal_is_for_the_leafs_identity_only(compat_ca: CompatCa):
    """Istio's agent asks for its own identity; a CSR for another is refused (istiod would
    silently write the caller's identity instead)."""
    client_key, chain = first_certificate(compat_ca)
    with pytest.raises(grpc.RpcError) as info:
        renew(compat_ca, client_key, istio_cert_chain_pem(chain), identity=HTTPBIN)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("compat_ca", ["self-signed", "plugged-1"], indirect=True)
def test_another_workloads_leaf_after_ones_own_is_no_credential(compat_ca: CompatCa):
    """Certificates are public: a client holding the key of its own leaf must not become
    the workload whose leaf it appends (the CA used to take the certificate after the leaf
    for the client's)."""
    client_key, chain = first_certificate(compat_ca)
    _, victim = first_certificate(compat_ca, HTTPBIN)
    presented = _pem(chain[0], victim[0], *chain[1:])
    details = refused(
        compat_ca.server,
        lambda: renew(compat_ca, client_key, presented, identity=HTTPBIN),
        grpc.StatusCode.UNAUTHENTICATED,
        "certificate #2",
        reason="client-cert-foreign-intermediate",
    )
    assert "not a CA certificate" in details


@pytest.mark.parametrize("compat_ca", ["plugged-2"], indirect=True)
def test_intermediates_in_the_wrong_order_are_refused_with_what_to_fix(compat_ca: CompatCa):
    """A cert-chain.pem assembled by hand with the organisation's intermediate first."""
    client_key, chain = first_certificate(compat_ca)
    leaf, mesh, top, bundle = chain
    details = refused(
        compat_ca.server,
        lambda: renew(compat_ca, client_key, _pem(leaf, top, mesh, bundle)),
        grpc.StatusCode.UNAUTHENTICATED,
        "out of order",
        reason="client-cert-chain-order",
    )
    assert "right after the certificate it signed" in details


@pytest.mark.parametrize("compat_ca", ["plugged-1"], indirect=True)
def test_a_root_before_the_intermediate_is_refused_with_what_to_fix(compat_ca: CompatCa):
    client_key, chain = first_certificate(compat_ca)
    leaf, mesh, bundle = chain
    refused(
        compat_ca.server,
        lambda: renew(compat_ca, client_key, _pem(leaf, bundle, mesh)),
        grpc.StatusCode.UNAUTHENTICATED,
        "list the intermediates first, then the roots",
        reason="client-cert-chain-order",
    )


@pytest.mark.parametrize("compat_ca", ["self-signed", "plugged-1"], indirect=True)
def test_a_foreign_intermediate_is_refused_with_what_to_fix(compat_ca: CompatCa):
    """A cert-chain.pem that also carries another mesh's intermediate (a multi-cluster
    cacerts copied into the wrong cluster)."""
    client_key, chain = first_certificate(compat_ca)
    now = datetime.now(UTC)
    foreign = new_intermediate(new_root(now), "other mesh intermediate", now)
    presented = _pem(*chain[:-1], cert_to_pem(foreign.cert), chain[-1])
    details = refused(
        compat_ca.server,
        lambda: renew(compat_ca, client_key, presented),
        grpc.StatusCode.UNAUTHENTICATED,
        "other mesh intermediate",
        reason="client-cert-foreign-intermediate",
    )
    assert "remove it from the chain" in details


@pytest.mark.parametrize("compat_ca", ["plugged-1"], indirect=True)
def test_the_leaf_alone_under_a_plugged_in_intermediate_fails_the_handshake(
    compat_ca: CompatCa,
):
    """Without its intermediate the client certificate cannot be verified during the TLS
    handshake (istiod refuses it the same way): nothing reaches the CA, nothing is issued.
    Istio's and meshca's agents always send their intermediates."""
    client_key, chain = first_certificate(compat_ca)
    issued = compat_ca.server.issued_count()
    with pytest.raises(grpc.RpcError) as info:
        renew(compat_ca, client_key, LEAF_ONLY(chain))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert compat_ca.server.issued_count() == issued


@pytest.mark.parametrize("compat_ca", ["self-signed"], indirect=True)
def test_a_chain_longer_than_any_mesh_needs_is_refused(compat_ca: CompatCa):
    """A client padding its chain (the handshake lets ~100 KiB through) costs the CA no
    signature checks beyond the first few."""
    client_key, chain = first_certificate(compat_ca)
    refused(
        compat_ca.server,
        lambda: renew(compat_ca, client_key, _pem(chain[0], *[chain[-1]] * 17)),
        grpc.StatusCode.UNAUTHENTICATED,
        "17 certificates follow the leaf, at most 16",
        reason="client-cert-invalid",
    )
