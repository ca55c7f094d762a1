"""Istio's own agent (pilot-agent, built from istio.io/istio) with the real Envoy, against
`meshca ca` in Kubernetes mode on the real API server: its token is a real pod-bound token from
the TokenRequest API, reviewed by the real TokenReview (issue 23, Done means 4).

- first certificate: over Istio's SDS socket to Envoy (`default`, `ROOTCA`) and into
  OUTPUT_CERTS;
- rotation with a short SECRET_TTL while Envoy stays connected (Istio renews only then), across a
  CA restart;
- an authority prepare/activate: ROOTCA gains the new root first, then the leaf moves to it;
- renewal over mTLS with PROV_CERT, the token useless, Istio's cert-chain.pem (leaf + root)
  presented as its client chain.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509

from ca_server.authority.slots import authority_id
from certs import describe_certificate, load_cert, load_certs
from tests.k8s_real.conftest import Account, RealCaFactory, unique
from tests.support.authority_cli import authority_rows, cluster_target
from tests.support.ca_process import CaProcess
from tests.support.istio_agent import IstioAgent
from tests.support.kube_mode import assert_verifies, audit_lines, spiffe
from tests.support.processes import free_port, wait_for
from tests.support.real_kube import RealControlPlane


def _workload(plane: RealControlPlane) -> tuple[str, str, object, str]:
    namespace = unique("mesh")
    plane.create_namespace(namespace)
    plane.create_service_account(namespace, "cart")
    pod = plane.create_pod(namespace, "cart-1", "cart")
    token = plane.request_token(namespace, "cart", audiences=("istio-ca",), pod=pod)
    return namespace, "cart", pod, token


def _agent(ca: CaProcess, plane: RealControlPlane, **kwargs: object) -> IstioAgent:
    namespace, account, _, token = _workload(plane)
    return IstioAgent(
        ca_addr=ca.addr,
        ca_root=ca.root_cert_path,
        namespace=namespace,
        service_account=account,
        pod_name="cart-1",
        token=token,
        **kwargs,  # type: ignore[arg-type]
    )


def _envoy_leaf_serial(agent: IstioAgent) -> int | None:
    serials = agent.envoy.cert_serials()
    return serials[0] if serials else None


def _issued_count(ca: CaProcess) -> int:
    return sum(1 for line in audit_lines(ca) if line["outcome"] == "issued")


def _signer(cert: x509.Certificate) -> str:
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier is not None
    return aki.key_identifier.hex()


def test_first_certificate_over_sds_and_output_certs(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    ca = real_ca("ca-0", "--no-root-configmaps")
    agent = _agent(ca, control_plane)
    try:
        agent.start()
        wait_for(lambda: (agent.output_certs / "key.pem").exists(), 10, "OUTPUT_CERTS")
        chain_pem = agent.output("cert-chain.pem")
        leaf = load_cert(chain_pem)
        assert describe_certificate(leaf).identity == agent.identity
        # Istio writes the root without the final newline: compare certificates, not bytes.
        assert load_certs(agent.output("root-cert.pem")) == load_certs(
            ca.root_cert_path.read_bytes()
        )
        assert_verifies([chain_pem.decode(), ""], ca.root_cert_path.read_bytes())
        assert _envoy_leaf_serial(agent) == leaf.serial_number
        assert (agent.output_certs / "key.pem").stat().st_mode & 0o077 == 0
        issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
        assert [line["identity"] for line in issued] == [agent.identity]
        assert issued[0]["caller"] == f"system:serviceaccount:{agent.identity.split('/')[4]}:cart"
    finally:
        agent.remove()


def test_rotation_with_a_short_ttl_and_a_ca_restart(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    ca = real_ca("ca-0", "--no-root-configmaps")
    agent = _agent(ca, control_plane, secret_ttl="8s")
    try:
        agent.start()
        seen: set[int] = set()

        def served() -> int:
            """Distinct leaves Envoy has held so far."""
            serial = _envoy_leaf_serial(agent)
            if serial is not None:
                seen.add(serial)
            return len(seen)

        wait_for(lambda: served() >= 3, 30, "two rotations pushed to Envoy", interval=0.2)
        assert load_cert(agent.output("cert-chain.pem")).serial_number in seen

        # The CA restarts (same port, same Secret): the agent's next renewal reaches it.
        ca.stop()
        issued_before = _issued_count(ca)
        ca.start()
        count = served()
        wait_for(lambda: served() > count, 30, "Envoy on a leaf from the restarted CA", 0.2)
        assert _issued_count(ca) > issued_before
        assert agent.running
    finally:
        agent.remove()


def test_authority_prepare_then_activate_reaches_the_agent(
    tmp_path: Path, control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    ca = real_ca("ca-0", "--no-root-configmaps", "--ca-reload-interval", "500ms")
    agent = _agent(ca, control_plane, secret_ttl="10s")
    operator = control_plane.write_kubeconfig(
        tmp_path / "operator.kubeconfig", _operator_token(control_plane, ca_account)
    )
    target = cluster_target(operator, ca_account.namespace)
    try:
        agent.start()
        (active,) = authority_rows(target, "show")
        old = active["id"]
        assert _signer(load_cert(agent.output("cert-chain.pem"))) == old

        prepared = next(
            r["id"] for r in authority_rows(target, "prepare") if r["state"] == "prepared"
        )

        def roots() -> set[str]:
            return {authority_id(c) for c in load_certs(agent.output("root-cert.pem"))}

        # Prepared: the agent's trust gains the new root while it still gets leaves of the old.
        wait_for(lambda: roots() == {old, prepared}, 30, "ROOTCA with both roots", 0.2)
        assert _signer(load_cert(agent.output("cert-chain.pem"))) == old

        authority_rows(target, "activate", prepared)
        wait_for(
            lambda: _signer(load_cert(agent.output("cert-chain.pem"))) == prepared,
            30,
            "a leaf of the activated authority",
            0.2,
        )
        assert prepared in roots()
        wait_for(lambda: _signer_serial_matches(agent, prepared), 10, "Envoy on the new leaf", 0.2)
    finally:
        agent.remove()


def _signer_serial_matches(agent: IstioAgent, authority: str) -> bool:
    leaf = load_cert(agent.output("cert-chain.pem"))
    return _signer(leaf) == authority and _envoy_leaf_serial(agent) == leaf.serial_number


def _operator_token(plane: RealControlPlane, account: Account) -> str:
    """`meshca authority` run as the CA's own account (what `kubectl exec` into a CA pod
    would use): its RBAC in deploy/ is what the command needs."""
    return plane.request_token(account.namespace, account.name, lifetime=3600)


def test_renewal_over_mtls_with_prov_cert_and_a_useless_token(
    control_plane: RealControlPlane, ca_account: Account, real_ca: RealCaFactory
):
    mtls_port = free_port()
    ca = real_ca("ca-0", "--no-root-configmaps", "--mtls-listen", f"127.0.0.1:{mtls_port}")
    first = _agent(ca, control_plane)
    try:
        first.start()
        wait_for(lambda: (first.output_certs / "key.pem").exists(), 10, "OUTPUT_CERTS")
    finally:
        first.stop()
    # Istio's VM flow: PROV_CERT holds the certificate the agent got before (cert-chain.pem is
    # leaf + root, as Istio writes it); the token is no longer valid.
    assert len(load_certs(first.output("cert-chain.pem"))) >= 2
    namespace = first.identity.split("/")[4]
    second = IstioAgent(
        ca_addr=f"127.0.0.1:{mtls_port}",
        ca_root=ca.root_cert_path,
        namespace=namespace,
        service_account="cart",
        pod_name="cart-1",
        token="not-a-valid-token",
        prov_cert=first.output_certs,
    )
    try:
        second.start()
        leaf = load_cert(second.output("cert-chain.pem"))
        assert describe_certificate(leaf).identity == spiffe(namespace, "cart")
        assert leaf.serial_number != load_cert(first.output("cert-chain.pem")).serial_number
        issued = [line for line in audit_lines(ca) if line["outcome"] == "issued"]
        assert issued[-1]["authenticator"] == "client-certificate", issued[-1]
    finally:
        second.remove()
        first.remove()
