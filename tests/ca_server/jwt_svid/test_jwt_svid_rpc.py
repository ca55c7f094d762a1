"""`meshca.v1.JwtSvidService` on a real `meshca ca`, and its OIDC discovery endpoint, with real
clients: a gRPC channel over TLS authenticated like CreateCertificate, and a relying party
(pyjwt's `PyJWKClient`) that knows nothing but the discovery document's URL.

Three CA processes on one data directory (replicas, or `--workers`) publish ONE JWKS with one
active key, and each signs with it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest

from meshca_proto import jwt_svid_pb2, jwt_svid_pb2_grpc
from tests.support.ca_process import CaProcess
from tests.support.processes import free_port
from tests.support.status_cli import meshca_status, status_json

pytestmark = pytest.mark.process

IDENTITY = "spiffe://cluster.local/ns/shop/sa/cart"
OIDC: dict[str, str] = {}  # CA address -> its discovery URL


def oidc_url(ca: CaProcess) -> str:
    return OIDC[ca.addr]


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, starts_processes: None
) -> Iterator[list[CaProcess]]:
    data = tmp_path_factory.mktemp("jwt") / "data"
    oidc = [free_port() for _ in range(3)]
    cas = [
        CaProcess(data, "--oidc-listen", f"127.0.0.1:{port}", "--jwks-max-age", "60s")
        for port in oidc
    ]
    for ca, port in zip(cas, oidc, strict=True):
        OIDC[ca.addr] = f"http://127.0.0.1:{port}"
        ca.launch()
    try:
        for ca in cas:
            ca.wait_ready()
        yield cas
    finally:
        for ca in cas:
            ca.stop()


def stub(ca: CaProcess) -> tuple[grpc.Channel, jwt_svid_pb2_grpc.JwtSvidServiceStub]:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.root_cert_path.read_bytes())
    channel = grpc.secure_channel(
        ca.addr, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    )
    return channel, jwt_svid_pb2_grpc.JwtSvidServiceStub(channel)


def mint(ca: CaProcess, audiences: list[str], token: str | None, **fields: str) -> str:
    channel, client = stub(ca)
    with channel:
        headers = [("authorization", f"Bearer {token}")] if token else []
        request = jwt_svid_pb2.MintJwtSvidRequest(audience=audiences, **fields)
        return client.MintJwtSvid(request, metadata=headers, timeout=10).token


def get(url: str) -> tuple[Any, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read()), response.headers.get("Cache-Control", "")


def test_a_relying_party_validates_from_the_discovery_document_alone(replicas: list[CaProcess]):
    ca = replicas[0]
    token = mint(ca, ["billing", "audit"], ca.mint_token("shop", "cart"))
    document, cache = get(f"{oidc_url(ca)}/.well-known/openid-configuration")
    assert cache == "public, max-age=60"
    keys = jwt.PyJWKClient(str(document["jwks_uri"]))
    signing = keys.get_signing_key_from_jwt(token)
    claims = jwt.decode(
        token,
        signing.key,
        algorithms=list(document["id_token_signing_alg_values_supported"]),
        audience="billing",
        issuer=str(document["issuer"]),
        options={"require": ["exp", "iat", "sub", "aud", "iss", "jti"]},
    )
    assert claims["sub"] == IDENTITY
    assert claims["exp"] - claims["iat"] == 300  # --jwt-svid-ttl default
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(token, signing.key, algorithms=["ES256"], audience="someone-else")


def test_three_replicas_publish_one_jwks_and_sign_with_its_one_active_key(
    replicas: list[CaProcess],
):
    jwks = [get(f"{oidc_url(ca)}/keys")[0] for ca in replicas]
    assert jwks[0] == jwks[1] == jwks[2]
    keys = jwks[0]["keys"]
    assert isinstance(keys, list) and len(keys) == 1
    kids = {
        jwt.get_unverified_header(mint(ca, ["x"], ca.mint_token("shop", "cart")))["kid"]
        for ca in replicas
    }
    assert kids == {keys[0]["kid"]}
    assert (replicas[0].data_dir / "jwt-authority.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("audiences", "fields", "code"),
    [
        ([], {}, grpc.StatusCode.INVALID_ARGUMENT),
        # 1 MB of audience (just under the CA's 1 MiB message cap, so the CA reads it).
        (["a" * 1_000_000], {}, grpc.StatusCode.INVALID_ARGUMENT),
        ([f"aud-{i}" for i in range(1000)], {}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            ["x"],
            {"impersonated_identity": "spiffe://cluster.local/ns/shop/sa/admin"},
            grpc.StatusCode.UNAUTHENTICATED,
        ),
        (["x"], {"impersonated_identity": "not a spiffe id"}, grpc.StatusCode.UNAUTHENTICATED),
    ],
    ids=["no-audience", "1MB-audience", "1000-audiences", "another-identity", "garbage-identity"],
)
def test_hostile_requests_are_refused_and_nothing_is_signed(
    replicas: list[CaProcess], audiences: list[str], fields: dict[str, str], code: grpc.StatusCode
):
    ca = replicas[1]
    with pytest.raises(grpc.RpcError) as refused:
        mint(ca, audiences, ca.mint_token("shop", "cart"), **fields)
    assert refused.value.code() == code
    assert refused.value.details()


def test_no_credentials_no_token(replicas: list[CaProcess]):
    with pytest.raises(grpc.RpcError) as refused:
        mint(replicas[2], ["x"], None)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_bundle_rpc_serves_the_published_jwks(replicas: list[CaProcess]):
    ca = replicas[0]
    channel, client = stub(ca)
    with channel:
        headers = [("authorization", f"Bearer {ca.mint_token('shop', 'cart')}")]
        answer = client.FetchJwtBundle(jwt_svid_pb2.JwtBundleRequest(), metadata=headers)
    published = get(f"{oidc_url(ca)}/keys")[0]["keys"]
    bundle = json.loads(answer.jwks)["keys"]
    assert [k["kid"] for k in bundle] == [k["kid"] for k in published]
    assert {k["use"] for k in bundle} == {"jwt-svid"}
    assert answer.trust_domain_id == "spiffe://cluster.local"


def test_meshca_status_shows_the_keys_and_the_discovery_endpoint(replicas: list[CaProcess]):
    ca = replicas[0]
    section = status_json(ca.debug_address)["jwt_svid"]
    published = get(f"{oidc_url(ca)}/keys")[0]["keys"]
    assert section["issuer"] == oidc_url(ca)
    assert section["discovery"] == f"{oidc_url(ca)}/.well-known/openid-configuration"
    assert section["jwks_max_age_seconds"] == 60
    assert [(k["kid"], k["phase"]) for k in section["keys"]] == [(published[0]["kid"], "active")]
    table = meshca_status(ca.debug_address)
    assert table.returncode == 0, table.stderr
    assert "JWT-SVID keys (issuer" in table.stdout and published[0]["kid"] in table.stdout


def test_the_data_dir_holds_what_was_published(replicas: list[CaProcess]):
    state = json.loads(Path(replicas[0].data_dir / "jwt-authority.json").read_text())
    assert [k["phase"] for k in state["keys"]] == ["active"]


def test_workers_sign_with_one_key_and_their_supervisor_serves_discovery(
    tmp_path: Path, starts_processes: None
):
    """`meshca ca --workers 2`: one discovery port for the group (the supervisor's, from the
    shared store), and a token from either worker validates against it with its `iss`."""
    port = free_port()
    ca = CaProcess(tmp_path / "data", "--workers", "2", "--oidc-listen", f"127.0.0.1:{port}")
    ca.start()
    try:
        OIDC[ca.addr] = f"http://127.0.0.1:{port}"
        document, _cache = get(f"{oidc_url(ca)}/.well-known/openid-configuration")
        assert document["issuer"] == oidc_url(ca)
        keys = jwt.PyJWKClient(document["jwks_uri"])
        for _ in range(8):  # a new connection each time: the kernel picks a worker
            token = mint(ca, ["x"], ca.mint_token("shop", "cart"))
            claims = jwt.decode(
                token,
                keys.get_signing_key_from_jwt(token).key,
                algorithms=["ES256"],
                audience="x",
                issuer=document["issuer"],
            )
            assert claims["sub"] == IDENTITY
        section = status_json(ca.debug_address)["jwt_svid"]  # the supervisor's view
        assert section["issuer"] == document["issuer"] and len(section["keys"]) == 1
    finally:
        ca.stop()
