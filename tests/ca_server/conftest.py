"""Fixtures for the CA tests: a real `meshca ca` process trusting the dev issuer and an RSA
"Kubernetes" issuer whose JWKS file the tests control."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ca_process import CaProcess
from tests.support.token_issuer import K8S_ISSUER, RsaIssuer, make_rsa_issuer


@pytest.fixture(scope="module")
def rsa_issuer(tmp_path_factory: pytest.TempPathFactory) -> RsaIssuer:
    return make_rsa_issuer(tmp_path_factory.mktemp("issuer"))


@pytest.fixture(scope="module")
def ca(
    tmp_path_factory: pytest.TempPathFactory, rsa_issuer: RsaIssuer, starts_processes: None
) -> Iterator[CaProcess]:
    process = CaProcess(
        tmp_path_factory.mktemp("ca") / "data",
        "--jwks",
        str(rsa_issuer.jwks_path),
        "--jwt-issuer",
        K8S_ISSUER,
        "--dev-issuer",
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def root_pem(ca: CaProcess) -> bytes:
    return ca.root_cert_path.read_bytes()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp for tests that start agents: their SDS socket paths must
    stay under 107 bytes, which pytest's long tmp_path does not."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="mcs-") as path:
        yield Path(path)
