"""AgentConfig: flags beat environment variables, which beat Istio's defaults."""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, add_agent_arguments
from certs import KeySpec


def parse(argv: list[str], env: dict[str, str] | None = None) -> AgentConfig:
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    return AgentConfig.from_args(parser.parse_args(argv), env or {})


def test_defaults_are_istios() -> None:
    config = parse([])
    assert config.ca_addr == "istiod.istio-system.svc:15012"
    assert config.ca_root_ca == Path("./var/run/secrets/istio/root-cert.pem")
    assert config.trust_domain == "cluster.local"
    assert config.secret_ttl == timedelta(hours=24)
    assert config.grace_period_ratio == 0.5
    assert config.grace_period_ratio_jitter == 0.01
    assert config.key_spec == KeySpec("ECDSA", curve="P256")
    assert config.token_path == Path("./var/run/secrets/tokens/istio-token")
    assert config.sds_socket == Path("./var/run/secrets/workload-spiffe-uds/socket")
    assert config.status_listen == "127.0.0.1:15020"
    assert config.output_certs is None and config.identity is None
    assert config.file_mounted_certs is False
    assert config.credential_bundle is None


def test_env_overrides_default_and_flag_overrides_env() -> None:
    env = {
        "CA_ADDR": "env-ca:15012",
        "SECRET_TTL": "1h",
        "POD_NAMESPACE": "envns",
        "SERVICE_ACCOUNT": "envsa",
        "TRUST_DOMAIN": "example.org",
        "SECRET_GRACE_PERIOD_RATIO": "0.4",
        "OUTPUT_CERTS": "/tmp/env-out",
        "ISTIO_META_CLUSTER_ID": "c1",
    }
    from_env = parse([], env)
    assert from_env.ca_addr == "env-ca:15012"
    assert from_env.secret_ttl == timedelta(hours=1)
    assert str(from_env.identity) == "spiffe://example.org/ns/envns/sa/envsa"
    assert from_env.grace_period_ratio == 0.4
    assert from_env.output_certs == Path("/tmp/env-out")
    assert from_env.cluster_id == "c1"

    flags = parse(
        [
            "--ca-addr",
            "flag-ca:1",
            "--secret-ttl",
            "30s",
            "--namespace",
            "flagns",
            "--grace-period-ratio",
            "0.3",
            "--status-listen",
            "127.0.0.1:0",
        ],
        env,
    )
    assert flags.ca_addr == "flag-ca:1"
    assert flags.secret_ttl == timedelta(seconds=30)
    assert str(flags.identity) == "spiffe://example.org/ns/flagns/sa/envsa"
    assert flags.grace_period_ratio == 0.3
    assert (flags.status_host, flags.status_port) == ("127.0.0.1", 0)


def test_empty_env_var_means_unset() -> None:
    assert parse([], {"CA_ADDR": ""}).ca_addr == "istiod.istio-system.svc:15012"


def test_system_roots_and_ca_headers() -> None:
    config = parse([], {"CA_ROOT_CA": "SYSTEM", "CA_HEADER_TENANT": "a", "CA_HEADER_X_ID": "b"})
    assert config.ca_root_ca is None
    assert config.ca_headers == (("tenant", "a"), ("x_id", "b"))


@pytest.mark.parametrize(
    ("variable", "hint"),
    [("CA_HEADER_AUTHORIZATION", "--token-file"), ("CA_HEADER_CLUSTERID", "--cluster-id")],
)
def test_ca_headers_that_would_duplicate_the_agents_own_are_refused(variable: str, hint: str):
    """The CA refuses a request with two `authorization` (or `clusterid`) headers, so an agent
    configured to send a second one would never get a certificate: say so at start-up."""
    with pytest.raises(ConfigError, match=f"{variable}.*{hint}"):
        parse([], {variable: "x"})


@pytest.mark.parametrize(
    ("env", "flag", "expected"),
    [
        ({}, None, KeySpec("ECDSA", curve="P256")),
        (
            {"ECC_SIGNATURE_ALGORITHM": "ECDSA", "ECC_CURVE": "P384"},
            None,
            KeySpec("ECDSA", curve="P384"),
        ),
        ({"WORKLOAD_RSA_KEY_SIZE": "3072"}, None, KeySpec("RSA", rsa_bits=3072)),
        ({"ECC_SIGNATURE_ALGORITHM": "RSA"}, None, KeySpec("RSA", rsa_bits=2048)),
        ({"WORKLOAD_RSA_KEY_SIZE": "3072"}, "ec-p384", KeySpec("ECDSA", curve="P384")),
    ],
)
def test_key_spec(env: dict[str, str], flag: str | None, expected: KeySpec) -> None:
    assert parse(["--key-type", flag] if flag else [], env).key_spec == expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"SECRET_TTL": "forever"}, "SECRET_TTL"),
        ([], {"SECRET_GRACE_PERIOD_RATIO": "1.5"}, "SECRET_GRACE_PERIOD_RATIO"),
        ([], {"SECRET_GRACE_PERIOD_RATIO": "x"}, "not a number"),
        ([], {"ECC_CURVE": "P521", "ECC_SIGNATURE_ALGORITHM": "ECDSA"}, "curve"),
        ([], {"FILE_MOUNTED_CERTS": "maybe"}, "FILE_MOUNTED_CERTS"),
        (["--status-listen", "nowhere"], {}, "HOST:PORT"),
        (["--report-interval", "100ms"], {}, "--report-interval .* between"),
        (["--report-interval", "11m"], {}, "--report-interval .* between"),
        (["--taint-resign-window", "soon"], {}, "--taint-resign-window"),
    ],
)
def test_bad_values_name_the_setting(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv, env)


def test_report_and_taint_settings() -> None:
    default = parse([])
    assert default.report_interval == timedelta(minutes=2)
    assert default.taint_resign_window == timedelta(minutes=5)
    custom = parse(["--report-interval", "0", "--taint-resign-window", "30s"])
    assert custom.report_interval == timedelta(0)  # off
    assert custom.taint_resign_window == timedelta(seconds=30)


def test_the_workload_api_is_off_unless_a_socket_is_given() -> None:
    assert parse([]).workload_api_socket is None
    assert parse([], {"SPIFFE_ENDPOINT_SOCKET": ""}).workload_api_socket is None


@pytest.mark.parametrize(
    "value", ["unix:///run/spiffe/socket", "unix:/run/spiffe/socket", "/run/spiffe/socket"]
)
def test_workload_api_socket_forms(value: str) -> None:
    """The forms SPIFFE_ENDPOINT_SOCKET takes, from the flag or that same variable."""
    expected = Path("/run/spiffe/socket")
    assert parse(["--workload-api-socket", value]).workload_api_socket == expected
    assert parse([], {"SPIFFE_ENDPOINT_SOCKET": value}).workload_api_socket == expected
    flag_wins = parse(["--workload-api-socket", "/a/s"], {"SPIFFE_ENDPOINT_SOCKET": value})
    assert flag_wins.workload_api_socket == Path("/a/s")


def test_workload_api_socket_mode() -> None:
    assert parse(["--workload-api-socket", "/s"]).workload_api_socket_mode == 0o600
    config = parse(["--workload-api-socket", "/s", "--workload-api-socket-mode", "0666"])
    assert config.workload_api_socket_mode == 0o666


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--workload-api-socket", "tcp://127.0.0.1:8081"], {}, "on a Unix socket only"),
        ([], {"SPIFFE_ENDPOINT_SOCKET": "tcp:127.0.0.1:8081"}, "SPIFFE_ENDPOINT_SOCKET"),
        (["--workload-api-socket", "unix:"], {}, "no path given"),
        (["--workload-api-socket", "/" + "s" * 120], {}, "longer than 107 bytes"),
        (["--workload-api-socket", "/s", "--workload-api-socket-mode", "rw"], {}, "octal"),
        (["--workload-api-socket", "/s", "--workload-api-socket-mode", "4755"], {}, "permission"),
        (
            ["--workload-api-socket", "/run/s", "--sds-socket", "/run/s"],
            {},
            "is the SDS socket",
        ),
        (
            ["--workload-api-socket", "/s", "--node-mode", "--identities", "a/b"],
            {},
            "static --identities list cannot tell callers apart",
        ),
    ],
)
def test_bad_workload_api_settings_name_the_setting(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv, env)


def test_credential_bundle_from_flag_or_env_in_file_mounted_mode() -> None:
    """The kubelet's podCertificate bundle replaces cert-chain.pem + key.pem; the flag wins."""
    env = {"FILE_MOUNTED_CERTS": "true", "CREDENTIAL_BUNDLE": "/var/run/pod/bundle.pem"}
    assert parse([], env).credential_bundle == Path("/var/run/pod/bundle.pem")
    flag = parse(["--credential-bundle", "etc/certs/b.pem"], env)
    assert flag.credential_bundle == Path("etc/certs/b.pem")
    assert flag.file_mounted_dir == Path("./etc/certs")  # the root stays root-cert.pem there
    with pytest.raises(ConfigError, match="FILE_MOUNTED_CERTS"):
        parse(["--credential-bundle", "/b.pem"])
