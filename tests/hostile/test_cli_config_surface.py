"""A careless or hostile operator's configuration: every bad value is refused at start-up with a
message naming the flag or variable, before anything listens or signs."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, add_agent_arguments
from ca_server.config import CaConfig
from ca_server.config import ConfigError as CaConfigError
from meshca.cli import build_parser
from tests.support.processes import child_env


def _agent(argv: list[str], env: dict[str, str] | None = None) -> AgentConfig:
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    return AgentConfig.from_args(parser.parse_args(argv), env or {})


AGENT_CASES = {
    "relative FILE_SECRET_DIRS": ([], {"FILE_SECRET_DIRS": "certs:/etc/x"}, "FILE_SECRET_DIRS"),
    "relative --file-secret-dirs": (["--file-secret-dirs", "./x"], {}, "FILE_SECRET_DIRS"),
    "negative SECRET_TTL": ([], {"SECRET_TTL": "-1h"}, "SECRET_TTL"),
    "zero SECRET_TTL": ([], {"SECRET_TTL": "0s"}, "SECRET_TTL"),
    "SECRET_TTL not a duration": ([], {"SECRET_TTL": "forever"}, "SECRET_TTL"),
    "grace ratio above 1": ([], {"SECRET_GRACE_PERIOD_RATIO": "2"}, "SECRET_GRACE_PERIOD_RATIO"),
    "grace ratio not a number": (
        [],
        {"SECRET_GRACE_PERIOD_RATIO": "half"},
        "SECRET_GRACE_PERIOD_RATIO",
    ),
    "jitter swallowing the ratio": (
        [],
        {"SECRET_GRACE_PERIOD_RATIO_JITTER": "0.6"},
        "SECRET_GRACE_PERIOD_RATIO_JITTER",
    ),
    "unknown curve": ([], {"ECC_CURVE": "P192"}, "key"),
    "tiny RSA key": ([], {"WORKLOAD_RSA_KEY_SIZE": "512"}, "key"),
    "unknown signature algorithm": ([], {"ECC_SIGNATURE_ALGORITHM": "DSA"}, "ECC_SIGNATURE"),
    "node mode without a source": (["--node-mode"], {}, "--node-mode"),
    "negative fetch limit": (["--max-concurrent-fetches", "-1"], {}, "--max-concurrent-fetches"),
    "credential bundle with a CA": ([], {"CREDENTIAL_BUNDLE": "/b.pem"}, "FILE_MOUNTED_CERTS"),
}


@pytest.mark.parametrize(("argv", "env", "names"), AGENT_CASES.values(), ids=list(AGENT_CASES))
def test_bad_agent_settings_are_refused_naming_the_setting(
    argv: list[str], env: dict[str, str], names: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _agent(argv, env)
    assert names.lower() in str(refused.value).lower(), str(refused.value)


def test_file_secret_dirs_default_and_override() -> None:
    assert _agent([]).file_secret_dirs == (
        Path("/etc/certs"),
        Path("/etc/istio"),
        Path("/var/run/secrets"),
    )
    assert _agent([], {"FILE_SECRET_DIRS": "/a:/b"}).file_secret_dirs == (Path("/a"), Path("/b"))
    assert _agent(["--file-secret-dirs", "/c"], {"FILE_SECRET_DIRS": "/a"}).file_secret_dirs == (
        Path("/c"),
    )


CA_CASES = {
    "min TTL above max": ["--min-workload-cert-ttl", "48h", "--max-workload-cert-ttl", "24h"],
    "jwks without issuer": ["--jwks", "/tmp/jwks.json"],
}


@pytest.mark.parametrize("args", CA_CASES.values(), ids=list(CA_CASES))
def test_bad_ca_settings_stop_with_a_message(args: list[str]) -> None:
    parsed = build_parser("ca").parse_args(["ca", "--data-dir", "/tmp/d", *args])
    with pytest.raises(CaConfigError) as refused:
        CaConfig.from_args(parsed, {})
    assert any(flag in str(refused.value) for flag in ("ttl", "TTL", "--jwt-issuer"))


def test_sds_socket_path_longer_than_the_unix_limit_is_refused(tmp_path: Path) -> None:
    from agent.sds import SdsServer
    from agent.secrets import SecretCache

    with pytest.raises(ValueError, match="Unix socket limit"):
        SdsServer(SecretCache(), tmp_path / ("s" * 120))


KUBECONFIGS = {
    "missing file": None,
    "not YAML": "garbage: [\n",
    "no current context": "apiVersion: v1\nkind: Config\n",
    "contexts of the wrong type": "apiVersion: v1\nkind: Config\ncurrent-context: x\ncontexts: 7\n",
}


@pytest.mark.process
@pytest.mark.parametrize("content", KUBECONFIGS.values(), ids=list(KUBECONFIGS))
@pytest.mark.parametrize("command", [("authority", "show"), ("status",)], ids=" ".join)
def test_an_unusable_kubeconfig_is_one_clear_line_not_a_traceback(
    tmp_path: Path, content: str | None, command: tuple[str, ...]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    if content is not None:
        kubeconfig.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "meshca", *command, "--kubeconfig", str(kubeconfig)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode in (1, 2), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"cannot load Kubernetes credentials from the kubeconfig {kubeconfig}" in result.stderr
