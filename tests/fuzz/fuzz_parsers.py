"""Coverage-guided fuzzing (atheris) of the parsers that face the network. Optional and not part
of `make test`: run `make fuzz` (installs the `fuzz` extra) or

    python -m tests.fuzz.fuzz_parsers TARGET -max_total_time=60

with TARGET one of: csr, ca-request, token, sds. The property is the one the Hypothesis tests
in tests/hostile/test_properties.py check: only the code's own typed refusals may escape.
A crash is saved by libFuzzer as `crash-*` in the working directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from envoy.service.discovery.v3 import discovery_pb2

    from agent.file_mounted import FileSecretProvider, FileWatcher, UnknownFileResourceError
    from agent.sds_decoding import sds_request_decoder
    from ca_server.authn import AuthnRequest
    from ca_server.errors import AuthenticationError
    from ca_server.jwt_authn import JwksFile, JwtAuthenticator, TrustedIssuer
    from ca_server.request_decoding import decode_certificate_request
    from meshca.clock import SystemClock
    from meshca_proto import ca_pb2
    from tests.support.inprocess_ca import good_csr
    from tests.support.parser_checks import check_csr
    from tests.support.token_issuer import K8S_ISSUER, make_rsa_issuer


def fuzz_ca_request(data: bytes) -> None:
    decode_certificate_request(data)


def _token_target() -> Callable[[bytes], None]:
    issuer = make_rsa_issuer(Path(tempfile.mkdtemp(prefix="fuzz-jwks")))
    authenticator = JwtAuthenticator(
        [TrustedIssuer(K8S_ISSUER, JwksFile(issuer.jwks_path), ("istio-ca",))],
        "cluster.local",
        SystemClock(),
    )
    loop = asyncio.new_event_loop()

    def fuzz_token(data: bytes) -> None:
        header = data.decode("utf-8", "replace")
        request = AuthnRequest(headers={"authorization": f"Bearer {header}"})
        with contextlib.suppress(AuthenticationError):
            loop.run_until_complete(authenticator.authenticate(request))

    return fuzz_token


def _sds_target() -> Callable[[bytes], None]:
    decode = sds_request_decoder(discovery_pb2.DiscoveryRequest)
    provider = FileSecretProvider(
        FileWatcher(clock=SystemClock()), allowed_dirs=(Path("/etc/certs"),)
    )

    def fuzz_sds(data: bytes) -> None:
        request = decode(data)
        for name in getattr(request, "resource_names", ()):
            try:
                provider.updates(name)
            except UnknownFileResourceError:
                pass
            except ValueError as exc:  # an embedded NUL in a path
                if "null" not in str(exc):
                    raise

    return fuzz_sds


TARGETS: dict[str, Callable[[], Callable[[bytes], None]]] = {
    "csr": lambda: check_csr,
    "ca-request": lambda: fuzz_ca_request,
    "token": _token_target,
    "sds": _sds_target,
}


def _seeds(target: str) -> list[bytes]:
    """Valid inputs to start from: the fuzzer mutates its way outward from real messages
    instead of having to discover a PEM header or a protobuf tag by chance."""
    csr = good_csr()
    if target == "csr":
        return [csr.encode()]
    if target == "ca-request":
        return [ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=3600).SerializeToString()]
    if target == "token":
        issuer = make_rsa_issuer(Path(tempfile.mkdtemp(prefix="fuzz-seed")))
        return [issuer.token("default", "sleep").encode()]
    request = discovery_pb2.DiscoveryRequest(
        resource_names=["default", "file-cert:/etc/certs/a.pem~/etc/certs/b.pem", "file-root:/x"]
    )
    request.node.id = "sidecar~10.0.0.1~app.default~default.svc.cluster.local"
    return [request.SerializeToString()]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: fuzz_parsers.py {{{'|'.join(TARGETS)}}} [libFuzzer flags]")
    name = sys.argv[1]
    corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    for index, seed in enumerate(_seeds(name)):
        (corpus / f"seed-{index}").write_bytes(seed)
    target = TARGETS[name]()
    atheris.Setup([sys.argv[0], *sys.argv[2:], str(corpus)], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
