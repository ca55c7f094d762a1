"""The Workload API's JWT profile on a real `meshca agent` (sidecar mode) against a real
`meshca ca`, driven by the real PyPI `spiffe` client (py-spiffe's `WorkloadApiClient`) and by
go-spiffe v2 (a tiny program built from the Go module proxy, tests/realbin/gospiffe), and a
relying party outside the mesh (pyjwt) that knows only the CA's OIDC discovery URL.

Hostile cases go through the same socket: another SPIFFE ID, no or a 1 MB audience, and tokens a
validator must refuse — replayed after `exp`, `alg: none`, HS256 keyed with the public key, a
`kid` swapped for another published key's, a `sub` forged under the real `kid`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import jwt
import pytest
from spiffe import JwtBundleSet, JwtSvid, TrustDomain, WorkloadApiClient
from spiffe._proto import workload_pb2, workload_pb2_grpc

from ca_server.authority import Phase
from ca_server.jwt_svid import JwtKeyFactory, LocalJwtKeyStore
from meshca.clock import SystemClock
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.processes import free_port, wait_for
from tests.support.real_binaries import binary

pytestmark = pytest.mark.process

HEADER = (("workload.spiffe.io", "true"),)
TRUST_DOMAIN_ID = "spiffe://cluster.local"


class Mesh:
    def __init__(self, workdir: Path) -> None:
        self.oidc_port = free_port()
        self.ca = CaProcess(
            workdir / "ca",
            "--oidc-listen", f"127.0.0.1:{self.oidc_port}",
            "--jwks-max-age", "30s",
            "--ca-reload-interval", "200ms",
        )  # fmt: skip
        self.socket = workdir / "spiffe" / "agent.sock"
        self.workdir = workdir

    @property
    def discovery(self) -> str:
        return f"http://127.0.0.1:{self.oidc_port}/.well-known/openid-configuration"

    def client(self) -> WorkloadApiClient:
        return WorkloadApiClient(f"unix:{self.socket}")

    def store(self) -> LocalJwtKeyStore:
        return LocalJwtKeyStore(
            self.ca.data_dir, JwtKeyFactory("ES256", timedelta(days=1)), SystemClock()
        )


@pytest.fixture(scope="module")
def mesh(starts_processes: None) -> Iterator[tuple[Mesh, AgentProcess]]:
    workdir = Path(tempfile.mkdtemp(dir="/tmp", prefix="wjwt-"))
    mesh = Mesh(workdir)
    mesh.ca.start()
    agent = AgentProcess(
        workdir, mesh.ca, "app", extra_args=("--workload-api-socket", f"unix://{mesh.socket}")
    )
    try:
        agent.start()
        yield mesh, agent
    finally:
        agent.stop()
        mesh.ca.stop()
        if not os.environ.get("MESHCA_KEEP_TEST_DIRS"):
            shutil.rmtree(workdir, ignore_errors=True)


def relying_party_claims(mesh: Mesh, token: str, audience: str) -> dict[str, object]:
    """What a relying party outside the mesh does: discovery document, JWKS, verify."""
    document = json.loads(urllib_get(mesh.discovery))
    key = jwt.PyJWKClient(document["jwks_uri"]).get_signing_key_from_jwt(token)
    return jwt.decode(
        token,
        key.key,
        algorithms=document["id_token_signing_alg_values_supported"],
        audience=audience,
        issuer=document["issuer"],
    )


def urllib_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def test_py_spiffe_fetches_validates_and_a_relying_party_agrees(
    mesh: tuple[Mesh, AgentProcess],
):
    m, agent = mesh
    with m.client() as client:
        svid = client.fetch_jwt_svid({"billing", "audit"})
        assert str(svid.spiffe_id) == agent.identity
        assert set(svid.audience) == {"billing", "audit"}
        again = client.fetch_jwt_svid({"audit", "billing"})
        assert again.token == svid.token  # cached until half its life
        checked = client.validate_jwt_svid(svid.token, "billing")
        assert str(checked.spiffe_id) == agent.identity
        bundles = client.fetch_jwt_bundles()
        bundle = bundles.get_bundle_for_trust_domain(svid.spiffe_id.trust_domain)
        assert bundle is not None
        kid = jwt.get_unverified_header(svid.token)["kid"]
        assert bundle.get_jwt_authority(kid) is not None
        # py-spiffe's own offline validation against the bundle it fetched.
        parsed = JwtSvid.parse_and_validate(svid.token, bundle, {"billing"})
        assert str(parsed.spiffe_id) == agent.identity
    claims = relying_party_claims(m, svid.token, "audit")
    assert claims["sub"] == agent.identity


def test_the_jwt_bundle_stream_pushes_a_prepared_key(mesh: tuple[Mesh, AgentProcess]):
    m, _agent = mesh
    seen: list[set[str]] = []
    errors: list[Exception] = []
    with m.client() as client:
        handle = client.stream_jwt_bundles(
            lambda bundles: seen.append(_kids(bundles)), errors.append, retry_connect=False
        )
        try:
            wait_for(lambda: bool(seen), 10, "the first JWT bundle")
            before = seen[-1]
            store = m.store()
            now = datetime.now(UTC)
            store.transact(
                lambda s: s.prepare(lambda: store_factory().new(now, Phase.PREPARED), now, "test")
            )
            wait_for(lambda: len(seen[-1]) == len(before) + 1, 45, "the prepared key pushed")
            assert seen[-1] > before
        finally:
            handle.cancel()
    assert not errors


def store_factory() -> JwtKeyFactory:
    return JwtKeyFactory("ES256", timedelta(days=1))


def _kids(bundles: JwtBundleSet) -> set[str]:
    bundle = bundles.get_bundle_for_trust_domain(TrustDomain("cluster.local"))
    return set(bundle.jwt_authorities) if bundle is not None else set()


def raw_stub(m: Mesh) -> tuple[grpc.Channel, workload_pb2_grpc.SpiffeWorkloadAPIStub]:
    channel = grpc.insecure_channel(f"unix:{m.socket}")
    return channel, workload_pb2_grpc.SpiffeWorkloadAPIStub(channel)


@pytest.mark.parametrize(
    ("audience", "spiffe_id", "code"),
    [
        (["x"], "spiffe://cluster.local/ns/default/sa/admin", grpc.StatusCode.PERMISSION_DENIED),
        ([], "", grpc.StatusCode.INVALID_ARGUMENT),
        (["a" * 1024 * 1024], "", grpc.StatusCode.INVALID_ARGUMENT),
        ([f"a{i}" for i in range(1000)], "", grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["another-identity", "no-audience", "1MB-audience", "1000-audiences"],
)
def test_hostile_fetches_are_refused(
    mesh: tuple[Mesh, AgentProcess], audience: list[str], spiffe_id: str, code: grpc.StatusCode
):
    m, _agent = mesh
    channel, stub = raw_stub(m)
    request = workload_pb2.JWTSVIDRequest(audience=audience, spiffe_id=spiffe_id)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.FetchJWTSVID(request, metadata=HEADER, timeout=10)
    assert refused.value.code() == code
    assert refused.value.details()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _forged(m: Mesh, agent: AgentProcess) -> dict[str, str]:
    """Tokens a validator must refuse, built from a real one and the CA's own key file."""
    with m.client() as client:
        real = client.fetch_jwt_svid({"billing"}).token
    header = jwt.get_unverified_header(real)
    claims = jwt.decode(real, options={"verify_signature": False})
    state = m.store().read()
    active = state.active
    other = next(k for k in state.keys if k.kid != active.kid)  # the prepared one
    public_pem = active.jwk()  # the published key, as an attacker has it
    body = _b64(json.dumps(claims).encode())
    now = int(time.time())
    return {
        "expired": jwt.encode(
            {**claims, "iat": now - 600, "exp": now - 300}, active.key, "ES256",
            headers={"kid": active.kid},
        ),
        "alg-none": f"{_b64(json.dumps({'alg': 'none', 'kid': active.kid}).encode())}.{body}.",
        "hs256-public-key": _hs256(json.dumps(public_pem).encode(), claims, active.kid),
        "kid-swap": ".".join(
            [_b64(json.dumps({**header, "kid": other.kid}).encode()), *real.split(".")[1:]]
        ),
        "forged-sub": ".".join(
            [
                real.split(".")[0],
                _b64(json.dumps({**claims, "sub": "spiffe://cluster.local/ns/x/sa/admin"}).encode()),
                real.split(".")[2],
            ]
        ),
        "wrong-audience": real,
    }  # fmt: skip


def _hs256(secret: bytes, claims: dict[str, object], kid: str) -> str:
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    body = _b64(json.dumps(claims).encode())
    mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(mac)}"


WHY = {  # the check each forged token fails, as the agent names it
    "expired": "expired",
    "alg-none": "algorithm 'none' is not allowed",
    "hs256-public-key": "algorithm 'HS256' is not allowed",
    "kid-swap": "Signature verification failed",
    "forged-sub": "Signature verification failed",
    "wrong-audience": "Audience doesn't match",
}


def test_hostile_tokens_are_refused_by_validate(mesh: tuple[Mesh, AgentProcess]):
    m, agent = mesh
    if m.store().read().prepared is None:  # run alone: the stream test prepared one
        assert jwt_cli(m, "prepare").returncode == 0
    published = {k.kid for k in m.store().read().keys}

    def agent_holds_them() -> bool:
        with m.client() as client:
            return _kids(client.fetch_jwt_bundles()) == published

    wait_for(agent_holds_them, 45, "the agent's bundle to hold the prepared key")
    forged = _forged(m, agent)
    channel, stub = raw_stub(m)
    with channel:
        for name, token in forged.items():
            audience = "someone-else" if name == "wrong-audience" else "billing"
            with pytest.raises(grpc.RpcError) as refused:
                stub.ValidateJWTSVID(
                    workload_pb2.ValidateJWTSVIDRequest(audience=audience, svid=token),
                    metadata=HEADER,
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert WHY[name] in (refused.value.details() or ""), (name, refused.value.details())
            with pytest.raises(jwt.PyJWTError):
                relying_party_claims(m, token, audience)


def test_without_the_security_header_nothing_is_served(mesh: tuple[Mesh, AgentProcess]):
    m, _agent = mesh
    channel, stub = raw_stub(m)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.FetchJWTSVID(workload_pb2.JWTSVIDRequest(audience=["x"]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def validate(m: Mesh, token: str, audience: str) -> grpc.StatusCode:
    channel, stub = raw_stub(m)
    request = workload_pb2.ValidateJWTSVIDRequest(audience=audience, svid=token)
    with channel:
        try:
            stub.ValidateJWTSVID(request, metadata=HEADER, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def jwt_cli(m: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    return meshca_authority(data_dir_target(m.ca.data_dir), *args, "--jwt", "--jwks-max-age", "30s")


def test_an_operator_rotation_activate_taint_revoke(mesh: tuple[Mesh, AgentProcess]):
    """Through `meshca authority … --jwt`: an early activation is refused (relying parties may
    not have the key yet), a forced one switches signing; a token of the old key still validates
    until its key is revoked; a taint makes the agent drop its cached token at once."""
    m, _agent = mesh
    if m.store().read().prepared is None:
        assert jwt_cli(m, "prepare").returncode == 0
    with m.client() as client:
        old = client.fetch_jwt_svid({"rotation"}).token
    old_kid = jwt.get_unverified_header(old)["kid"]
    early = jwt_cli(m, "activate")
    assert early.returncode == 3 and "--jwks-max-age" in early.stderr, early.stderr
    assert jwt_cli(m, "activate", "--force").returncode == 0
    new_kid = m.store().read().active.kid
    assert new_kid != old_kid
    with m.client() as client:
        assert client.fetch_jwt_svid({"rotation"}).token == old  # not tainted: still cached
    assert validate(m, old, "rotation") == grpc.StatusCode.OK

    tainted = jwt_cli(m, "taint", old_kid)
    assert tainted.returncode == 0, tainted.stderr

    def fetched_kid() -> str:
        with m.client() as client:
            return str(jwt.get_unverified_header(client.fetch_jwt_svid({"rotation"}).token)["kid"])

    wait_for(lambda: fetched_kid() == new_kid, 45, "the agent dropping the tainted key's token")
    assert validate(m, old, "rotation") == grpc.StatusCode.OK  # tainted, still published
    assert jwt_cli(m, "revoke", old_kid).returncode == 0
    wait_for(
        lambda: validate(m, old, "rotation") == grpc.StatusCode.INVALID_ARGUMENT,
        45,
        "the revoked key leaving the agent's bundle",
    )
    with pytest.raises(jwt.PyJWTError):
        relying_party_claims(m, old, "rotation")
    shown = json.loads(jwt_cli(m, "show", "-o", "json").stdout)["jwt_keys"]
    assert [(k["kid"], k["phase"]) for k in shown] == [(new_kid, "active")]


def test_go_spiffe_fetches_and_validates_its_own_jwt_svid(mesh: tuple[Mesh, AgentProcess]):
    """go-spiffe v2 (tests/realbin/gospiffe): FetchJWTSVID, FetchJWTBundles, its own offline
    jwtsvid.ParseAndValidate and the Workload API's ValidateJWTSVID; then a relying party."""
    m, agent = mesh
    result = subprocess.run(
        [str(binary("go-spiffe-jwt")), str(m.socket), "go-audience"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["spiffe_id"] == seen["offline_id"] == seen["validated_id"] == agent.identity
    assert seen["audience"] == ["go-audience"] and seen["bundles"] == 1
    assert relying_party_claims(m, seen["token"], "go-audience")["sub"] == agent.identity
