"""The token provider re-reads its file, fails clearly, and never puts the token in messages."""

from __future__ import annotations

from pathlib import Path

import jwt
import pytest

from agent.token import (
    FileTokenProvider,
    IdentityResolver,
    TokenClaimsError,
    TokenFileEmpty,
    TokenFileMissing,
    identity_from_token,
)
from certs import SpiffeId


def make_token(claims: dict[str, object]) -> str:
    return jwt.encode(claims, "not-verified-by-the-agent-0123456789abcdef", algorithm="HS256")


def test_missing_and_empty_files_raise_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "istio-token"
    provider = FileTokenProvider(path)
    with pytest.raises(TokenFileMissing, match="does not exist"):
        provider.token()
    path.write_text("  \n")
    with pytest.raises(TokenFileEmpty, match=r"token file .* is empty"):
        provider.token()


def test_rereads_the_file_on_every_call(tmp_path: Path) -> None:
    path = tmp_path / "istio-token"
    provider = FileTokenProvider(path)
    path.write_text("first\n")
    assert provider.token() == "first"
    path.write_text("second")
    assert provider.token() == "second"


def test_optional_token_yields_empty(tmp_path: Path) -> None:
    provider = FileTokenProvider(tmp_path / "absent", required=False)
    assert provider.token() == ""


def test_identity_from_kubernetes_claim_and_from_sub() -> None:
    k8s = make_token({"kubernetes.io": {"namespace": "shop", "serviceaccount": {"name": "cart"}}})
    assert identity_from_token(k8s, "cluster.local") == SpiffeId("cluster.local", "shop", "cart")
    sub = make_token({"sub": "system:serviceaccount:ns1:sa1"})
    assert identity_from_token(sub, "td") == SpiffeId("td", "ns1", "sa1")


def test_unusable_tokens_do_not_leak_their_text() -> None:
    secret_looking = "abc.def.ghi"
    with pytest.raises(TokenClaimsError) as info:
        identity_from_token(secret_looking, "cluster.local")
    assert secret_looking not in str(info.value)
    with pytest.raises(TokenClaimsError, match="POD_NAMESPACE"):
        identity_from_token(make_token({"sub": "someone"}), "cluster.local")


def test_resolver_prefers_configured_identity(tmp_path: Path) -> None:
    fixed = SpiffeId("cluster.local", "a", "b")
    provider = FileTokenProvider(tmp_path / "absent")
    assert IdentityResolver(fixed, provider, "cluster.local")() == fixed
    with pytest.raises(TokenFileMissing):
        IdentityResolver(None, provider, "cluster.local")()
