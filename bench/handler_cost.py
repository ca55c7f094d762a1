"""What meshca's own code costs per certificate, without gRPC: the CA's handler in-process.

Run: `.venv/bin/python -m bench.handler_cost [--requests 3000] [--repetitions 5]`

`bench/vs_cfssl.py` and `bench/profile_ca.py` measure the whole server, where about half the CPU
is gRPC's and asyncio's machinery and a run-to-run spread of ±3 % hides a cut of a few
microseconds. This bench isolates the part meshca owns: the `CertificateService` the CA builds
(same `meshca ca` flags as `bench/vs_cfssl.py`: a plugged-in P-256 root and the development
token issuer; its real authenticators, CSR checks, TTL policy, signer, leaf ledger, metrics and
audit line, written to /dev/null) answering `CreateCertificate` one request after another on
an event loop. The context is a small stand-in for `grpc.aio.ServicerContext` giving the
request headers (a cached bearer token, as in the h2load benches) and the peer, as the TLS port
gives them without a client certificate.

Baseline, measured in the same run: the cryptography any CA pays for one certificate with the
`certs` library alone (parse and verify the CSR's signature, the leaf from the DER template as
the CA's signer makes it, PEM).
Printed: CPU µs per request for both (process time, median of the repetitions), the handler's
overhead above the floor and the ratio, so runs compare across code changes on a noisy machine.

The leaf step alone, in the same repetitions (`--leaf-loops` each): the reference
`CertificateBuilder` (`SigningAuthority.leaf_profile.build`, the profile cached per authority)
beside the DER template the CA signs with (`SigningAuthority.leaf_template.sign`, the key's
SPKI sliced from the verified CSR), and the template plus the one `load_der_x509_certificate`
the CA's signer does for its callers; both from the same key, identity and validity.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

from cryptography import x509

from bench.vs_cfssl import IDENTITY, write_pki
from ca_server.admission import Admission
from ca_server.authority import authority_driver_for
from ca_server.config import CaConfig
from ca_server.dev_issuer import load_dev_issuer
from ca_server.flags import add_ca_arguments
from ca_server.fleet import AgentReports
from ca_server.metrics import CaMetrics
from ca_server.server import build_authenticators, impersonation_policy_for
from ca_server.service import CertificateService
from certs import (
    PublicKey,
    cert_to_pem,
    load_cert,
    load_csr,
    load_verified_csr,
    make_authority,
    public_key_of,
)
from certs.keys import load_private_key
from meshca.clock import SystemClock
from meshca.logs import configure_logging
from meshca_proto import ca_pb2


class BenchContext:
    """What the handler reads from `grpc.aio.ServicerContext` on a successful request."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"the bench request was refused: {code}: {details}")


async def build_service(workdir: Path) -> tuple[CertificateService, str]:
    """The service exactly as `meshca ca --cacerts-dir ... --dev-issuer` builds it."""
    parser = argparse.ArgumentParser()
    add_ca_arguments(parser)
    args = parser.parse_args(
        [
            "--data-dir",
            str(workdir / "data"),
            "--cacerts-dir",
            str(workdir / "cacerts"),
            "--dev-issuer",
        ]
    )
    config = CaConfig.from_args(args, {})
    config.data_dir.mkdir(parents=True, exist_ok=True)
    clock = SystemClock()
    metrics = CaMetrics()
    agent_reports = AgentReports()
    driver = authority_driver_for(config, metrics, clock, agent_reports)
    await driver.start()
    service = CertificateService(
        authenticators=build_authenticators(config, driver.signer, clock),
        impersonation=impersonation_policy_for(None),
        signer=driver.signer,
        ttl_policy=driver.ttl_policy,
        metrics=metrics,
        clock=clock,
        admission=Admission(config.admission, clock.monotonic),
        agent_reports=agent_reports,
    )
    token = load_dev_issuer(config.data_dir).mint(
        IDENTITY.namespace, IDENTITY.service_account, ttl=timedelta(hours=24)
    )
    return service, token


def cpu_us_per_call(call: Callable[[], object], count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        call()
    return (time.process_time() - started) / count * 1e6


async def handler_us(service: CertificateService, context: BenchContext, csr: str, n: int) -> float:
    request = ca_pb2.IstioCertificateRequest(csr=csr)
    started = time.process_time()
    for _ in range(n):
        await service.CreateCertificate(request, context)
    return (time.process_time() - started) / n * 1e6


async def step_costs(workdir: Path, csr: str, count: int) -> None:
    """Each step of `CreateCertificate` timed where it runs (the thread's CPU time around the
    call, inside the whole handler: the steps run on the caches the other steps leave, as in
    the server, which makes each dearer than in a loop of its own); the rest is the handler's
    own code and the small calls between the steps."""
    import ca_server.service as service_module  # the names the handler calls through

    service, token = await build_service(workdir)
    context = BenchContext(token)
    await handler_us(service, context, csr, 50)
    spent: dict[str, int] = {}

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time_ns()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0) + time.thread_time_ns() - started

        return step

    def timed_async(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        async def step(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time_ns()
            try:
                return await call(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0) + time.thread_time_ns() - started

        return step

    for name in ("load_verified_csr", "authorize_csr", "grant_validity", "audit", "authn_request"):
        setattr(service_module, name, timed(name, getattr(service_module, name)))
    authenticators = service._authenticators
    authenticators.authenticate = timed_async(  # type: ignore[method-assign]
        "authenticate", authenticators.authenticate
    )
    signer = service._signer
    signer.sign = timed("signer.sign", signer.sign)  # type: ignore[method-assign]
    service._record_report = timed("_record_report", service._record_report)  # type: ignore[method-assign]
    leaves = service._metrics.leaves
    leaves.record = timed("leaf ledger record", leaves.record)  # type: ignore[method-assign]
    admission = service._admission
    admission.admit = timed("admission", admission.admit)  # type: ignore[method-assign]
    request = ca_pb2.IstioCertificateRequest(csr=csr)
    started = time.thread_time_ns()
    for _ in range(count):
        await service.CreateCertificate(request, context)
    total = time.thread_time_ns() - started
    print(f"steps of CreateCertificate in place, {count} requests, CPU µs per request:")
    for name, ns in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {name:22} {ns / count / 1000:6.1f}")
    print(f"  {'rest of the handler':22} {(total - sum(spent.values())) / count / 1000:6.1f}")
    print(f"  {'whole handler':22} {total / count / 1000:6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000, help="requests per repetition")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument(
        "--leaf-loops", type=int, default=2000, help="leaves per step and repetition"
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="also time each step of the handler in place (CPU µs per request)",
    )
    args = parser.parse_args()
    configure_logging("WARNING", open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the run
    logging.getLogger().setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="meshca-handler-") as tmp:
        workdir = Path(tmp)
        write_pki(workdir)
        csr = (workdir / "request.csr").read_text()
        root = load_cert((workdir / "ca.pem").read_bytes())
        root_key = load_private_key((workdir / "ca-key.pem").read_bytes())

        authority = make_authority(root, root_key, [], [root])  # as the CA holds it

        def floor() -> str:
            """The CSR read and the leaf as the CA's signer makes it (DER template), PEM."""
            request, key = load_verified_csr(csr)
            now = datetime.now(UTC)
            der = authority.leaf_template.sign(
                cast(PublicKey, key),
                IDENTITY,
                not_before=now,
                not_after=now + timedelta(hours=24),
                csr=request,
            )
            return cert_to_pem(x509.load_der_x509_certificate(der))

        request = load_csr(csr)
        public_key = public_key_of(request)
        start = datetime.now(UTC)
        end = start + timedelta(hours=24)
        profile, template = authority.leaf_profile, authority.leaf_template

        def builder_leaf() -> object:
            return profile.build(public_key, IDENTITY, not_before=start, not_after=end)

        def template_leaf() -> bytes:
            return template.sign(public_key, IDENTITY, not_before=start, not_after=end, csr=request)

        def template_leaf_loaded() -> object:
            return x509.load_der_x509_certificate(template_leaf())

        leaf_steps: dict[str, list[float]] = {"builder": [], "template": [], "loaded": []}

        async def run() -> tuple[list[float], list[float]]:
            service, token = await build_service(workdir)
            context = BenchContext(token)
            await handler_us(service, context, csr, 50)  # warm: the token is verified once
            floors, handlers = [], []
            for _ in range(args.repetitions):  # alternate, so load changes hit both alike
                floors.append(cpu_us_per_call(floor, args.requests))
                handlers.append(await handler_us(service, context, csr, args.requests))
                for name, step in (
                    ("builder", builder_leaf),
                    ("template", template_leaf),
                    ("loaded", template_leaf_loaded),
                ):
                    leaf_steps[name].append(cpu_us_per_call(step, args.leaf_loops))
            return floors, handlers

        floors, handlers = asyncio.run(run())
        if args.steps:
            asyncio.run(step_costs(workdir, csr, args.requests))
    floor_us, handler_cpu_us = statistics.median(floors), statistics.median(handlers)
    print(f"{args.requests} requests x {args.repetitions}, CPU µs per certificate (median):")
    print(f"  floor: certs library (CSR read + verify, template leaf + sign, PEM)  {floor_us:6.1f}")
    print(f"  CertificateService.CreateCertificate, in-process            {handler_cpu_us:6.1f}")
    print(
        f"  handler overhead above the floor  {handler_cpu_us - floor_us:6.1f} µs; "
        f"handler ÷ floor {handler_cpu_us / floor_us:.2f}"
    )
    print(f"  all repetitions: floor {[round(f) for f in floors]}")
    print(f"                   handler {[round(h) for h in handlers]}")
    builder_us, template_us, loaded_us = (
        statistics.median(leaf_steps[name]) for name in ("builder", "template", "loaded")
    )
    print(
        f"leaf step, P-256 issuer, {args.leaf_loops} leaves x {args.repetitions}, "
        "CPU µs per leaf (median):"
    )
    print(f"  CertificateBuilder (WorkloadLeafProfile.build, cached profile)  {builder_us:6.1f}")
    print(
        f"  DER template (LeafTemplate.sign)                                {template_us:6.1f}"
        f"   builder ÷ template {builder_us / template_us:.2f}"
    )
    print(
        f"  DER template + load_der_x509_certificate (the CA's signer)      {loaded_us:6.1f}"
        f"   builder ÷ this {builder_us / loaded_us:.2f}"
    )
    for name in ("builder", "template", "loaded"):
        print(f"  all repetitions: {name} {[round(v, 1) for v in leaf_steps[name]]}")


if __name__ == "__main__":
    main()
