"""Done means 2: replicas started at the same instant share one root through Secret
`istio-ca-secret`, both issue chains that verify against it, and a changed Secret is picked up
by every replica and reaches the root ConfigMaps. They share one JWT-SVID key too, through Secret
`meshca-jwt-keys` (issue 32: one JWKS for the trust domain, never one per replica)."""

from __future__ import annotations

import base64
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import jwt

from ca_server.authority.slots import AuthorityState, Phase
from ca_server.authority.state_store import SlotFactory
from ca_server.jwt_svid.kube_store import JWT_SECRET_NAME
from ca_server.kube.root_publisher import CONFIGMAP_NAME
from ca_server.kube.secret_root import (
    SECRET_NAME,
    SECRET_TYPE,
    KubeAuthorityStateStore,
)
from certs import (
    KeySpec,
    SigningAuthority,
    build_root_certificate,
    cert_to_pem,
    generate_private_key,
    private_key_to_pem,
)
from meshca.clock import FakeClock
from meshca_proto import jwt_svid_pb2, jwt_svid_pb2_grpc
from tests.support.ca_process import CaProcess
from tests.support.kube_api import KubeApiServer
from tests.support.kube_api_calls import CA_NAMESPACE
from tests.support.kube_mode import CaFactory, assert_verifies, issue, spiffe
from tests.support.processes import wait_for


def _secret_root(kube_api: KubeApiServer) -> bytes:
    secret = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    assert secret["type"] == SECRET_TYPE
    assert set(secret["data"]) == {
        "ca-cert.pem",
        "ca-key.pem",
        "root-cert.pem",
        "cert-chain.pem",
        "key.pem",
        "meshca-authorities.json",
    }
    return base64.b64decode(secret["data"]["root-cert.pem"])


def _jwt_kid(ca: CaProcess, token: str) -> str:
    """The `kid` of a JWT-SVID `ca` signs for the caller of `token`."""
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.root_cert_path.read_bytes())
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(ca.addr, credentials, options=options) as channel:
        answer = jwt_svid_pb2_grpc.JwtSvidServiceStub(channel).MintJwtSvid(
            jwt_svid_pb2.MintJwtSvidRequest(audience=["x"]),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=10,
        )
    return str(jwt.get_unverified_header(answer.token)["kid"])


def test_replicas_started_together_share_one_root(kube_api: KubeApiServer, kube_ca: CaFactory):
    kube_api.add_service_account_token("cart-token", "default", "cart", audiences=["istio-ca"])
    # --no-istiod-tls: the only Secret (and Secret create) counted below is the root's.
    replicas = [
        kube_ca(f"ca-{i}", "--ca-reload-interval", "200ms", "--no-istiod-tls", start=False)
        for i in range(2)
    ]
    for ca in replicas:
        ca.launch()
    for ca in replicas:
        ca.wait_ready()

    root = _secret_root(kube_api)
    assert 2 <= kube_api.count("create", "secrets") <= 4  # the root's and the JWT keys'
    secrets = kube_api.list("secrets", namespace=CA_NAMESPACE)
    assert sorted(s["metadata"]["name"] for s in secrets) == sorted([JWT_SECRET_NAME, SECRET_NAME])
    kids = set()
    for ca in replicas:
        assert ca.root_cert_path.read_bytes() == root
        chain = issue(ca, "cart-token", spiffe("default", "cart"))
        assert chain[-1].encode() == root
        assert_verifies(chain, root)
        kids.add(_jwt_kid(ca, "cart-token"))
    assert len(kids) == 1

    # An operator replaces the root the Istio way (ca-cert.pem, ca-key.pem, root-cert.pem): every
    # replica adopts it and the ConfigMaps follow.
    key = generate_private_key()
    cert = build_root_certificate(
        key, "cluster.local", now=datetime.now(UTC), lifetime=timedelta(days=365)
    )
    authority = SigningAuthority(cert=cert, key=key, intermediates=(), roots=(cert,))
    secret = kube_api.get("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    replaced = {
        "ca-cert.pem": cert_to_pem(cert),
        "ca-key.pem": private_key_to_pem(key).decode(),
        "root-cert.pem": authority.root_bundle_pem,
    }
    for name, pem in replaced.items():
        secret["data"][name] = base64.b64encode(pem.encode()).decode()
    kube_api.update("secrets", secret)
    new_root = authority.root_bundle_pem.encode()

    def everywhere() -> bool:
        configmaps = [  # the root ConfigMaps (each replica also keeps a report ConfigMap)
            cm for cm in kube_api.list("configmaps") if cm["metadata"]["name"] == CONFIGMAP_NAME
        ]
        return (
            all(ca.root_cert_path.read_bytes() == new_root for ca in replicas)
            and len(configmaps) == 3
            and all(cm["data"]["root-cert.pem"].encode() == new_root for cm in configmaps)
        )

    wait_for(everywhere, 15, "the new root in every replica and every ConfigMap")
    for ca in replicas:
        # The CA's own TLS certificate is still from the old root until it restarts (known gap).
        chain = issue(ca, "cart-token", spiffe("default", "cart"), tls_roots=root + new_root)
        assert_verifies(chain, new_root)


def test_losing_the_create_race_adopts_the_winners_root(kube_api: KubeApiServer):
    """Deterministic version of the race: a store that decided to create after another
    replica already did gets 409, re-reads, and uses the existing root (never overwrites)."""
    now = datetime.now(UTC)
    factory = SlotFactory(KeySpec(), "cluster.local", timedelta(days=30))

    def store() -> KubeAuthorityStateStore:
        return KubeAuthorityStateStore(kube_api.api_client(), CA_NAMESPACE, factory, FakeClock(now))

    winner = store().read()
    loser = store()
    assert not loser._write(None, factory.first_state(now)), "the second create must lose"
    assert loser.read().active.id == winner.active.id
    assert kube_api.count("create", "secrets") == 2
    assert kube_api.count("update", "secrets") == 0

    # Many stores at once, in threads: still one root.
    kube_api.delete("secrets", SECRET_NAME, namespace=CA_NAMESPACE)
    barrier = threading.Barrier(6)
    roots: list[str] = []

    def load() -> None:
        candidate = store()
        barrier.wait()
        roots.append(candidate.read().active.id)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(roots) == 6 and len(set(roots)) == 1

    # Concurrent changes are serialised by resourceVersion: each of six "prepare if none"
    # transactions sees the others (a loser retries on the winner's state), so exactly one
    # authority is prepared and none is lost or duplicated.

    def prepare_if_none() -> None:
        candidate = store()
        barrier.wait()

        def change(state: AuthorityState) -> AuthorityState | None:
            if state.prepared is not None:
                return None
            return state.prepare(lambda: factory.new(now, Phase.PREPARED), now, "test")

        candidate.transact(change)

    threads = [threading.Thread(target=prepare_if_none) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    final = store().read()
    assert final.prepared is not None and len(final.slots) == 2
    assert kube_api.count("update", "secrets") >= 1


def test_a_starting_ca_sweeps_what_a_killed_writer_left_in_its_data_dir(
    tmp_path: Path, kube_ca: CaFactory
):
    """Kubernetes mode keeps its root bundle, taint notice and ledgers in `--data-dir` too, but
    its state is the Secret, so the local state store's first-write sweep never ran there: a
    `.root-cert.pem.*.tmp` a killed replica left stayed for good. Now every start sweeps, and
    only `atomic_write`'s own temporary names."""
    data_dir = tmp_path / "ca-0"
    data_dir.mkdir(mode=0o700)
    leftover = data_dir / ".root-cert.pem.k1lled0x.tmp"
    leftover.write_bytes(b"half a bundle")
    kept = data_dir / ".root-cert.pem.notes"
    kept.write_bytes(b"not a temporary of meshca's")
    ca = kube_ca("ca-0")
    assert not leftover.exists()
    assert kept.read_bytes() == b"not a temporary of meshca's"
    assert "removed 1 temporary file(s) a killed meshca process left" in ca.log()
