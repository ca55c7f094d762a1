"""The agent's client for the Istio CA API (`IstioCertificateService/CreateCertificate`).

Concurrency: asyncio with `grpc.aio`; one channel per client, used from the event loop only.
Callers may issue concurrent `sign()` calls: the single-identity agent issues one at a time, the
node agent up to `--max-concurrent-fetches` (they share the channel, multiplexed by HTTP/2).

Transport: TLS, verifying the CA with the configured root file (or the OS roots). The root file
is re-read whenever the CA is unreachable, and the channel rebuilt if it changed, so a rotated
mesh root is picked up without a restart. The CA's serving certificate names `localhost`,
`127.0.0.1` and `istiod.istio-system.svc`; any other address is dialled with the TLS name
overridden to `istiod.istio-system.svc`. Reconnect backoff is capped at 1 s so the agent reaches
a restarted CA immediately.

Node mode: `sign(..., impersonate=id)` adds request metadata `ImpersonatedIdentity: <SPIFFE URI>` (a
`google.protobuf.Struct`, docs/reference.md#ca-api): the caller authenticates as itself (the node
agent's service account) and asks for a pod identity on its node.

Each call: fresh token read (see `agent.token`), `authorization`, `clusterid` and `CA_HEADER_*`
headers, `x-meshca-renewal: 1` when the caller still holds a valid certificate for the identity
(a meshca CA sheds those before first certificates when overloaded), a deadline; transient
failures (docs/reference.md#status-codes) are retried a few times with backoff, or after the
CA's retry hint (the `grpc-retry-pushback-ms` trailer of a shed request) times a jitter factor
in [1, 1.5], and a response is only accepted if `agent.acceptance` accepts it for exactly the
identity and key asked for, verified to the root bundle it carries. Errors: the `CaClientError`
family of `agent.errors`. Latency is measured on the injected clock's `monotonic()`.

Trust bundle: `trust(pem)` (called by `agent.trust_bundle` when the served bundle changes) makes
the next call use a channel trusting that bundle; the old channel is closed once its calls
finish. With a `PropagationReport` (`agent.propagation`) every call also carries the agent id,
its bundle digest and the authority of the leaf being renewed (`agent.signing.SigningRequest`'s
`leaf_authority`);
`report()` sends the same facts between renewals on meshca's own report RPC (`agent.reporter`
calls it) and returns the CA's tainted authorities.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from agent.acceptance import accept_certificate
from agent.backoff import Backoff
from agent.errors import (
    RETRYABLE_CODES,
    CaClientError,
    CaConnectionError,
    CaRequestError,
    CaResponseError,
    CertificateRefused,
)
from agent.metrics import AgentMetrics
from agent.propagation import AgentReport, PropagationReport
from agent.signing import SignedCertificate, SigningRequest
from agent.token import TokenProvider
from certs import (
    CertsError,
    PrivateKey,
    SpiffeId,
    certs_to_pem,
    key_matches_certificate,
    load_certs,
    load_private_key,
)
from meshca.clock import Clock
from meshca.host_port import split_host_port
from meshca.wire import (
    CA_SERVING_HOSTS,
    CA_TLS_NAME,
    IMPERSONATED_IDENTITY,
    RENEWAL_HEADER,
    RETRY_PUSHBACK_TRAILER,
)
from meshca_proto import (
    ca_pb2,
    ca_pb2_grpc,
    jwt_svid_pb2,
    jwt_svid_pb2_grpc,
    report_pb2,
    report_pb2_grpc,
)

__all__ = [
    "RETRYABLE_CODES",
    "CaClient",
    "CaClientError",
    "CaConnectionError",
    "CaRequestError",
    "CaResponseError",
]

log = logging.getLogger(__name__)

RETIRE_GRACE_SECONDS = 10.0
CALL_RETRY_BACKOFF = Backoff(initial=0.1, maximum=1.0)
CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),  # retries are ours, counted and logged
]


# A hinted retry waits the hint times a factor in [1, 1 + this]: never sooner than the CA asked,
# and spread so the agents it refused together do not come back together.
PUSHBACK_JITTER = 0.5
# Statuses that mean the call never got an answer from the CA (an UNAVAILABLE that carries a
# retry hint is the CA answering "not now", so it does not count).
UNANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _unanswered(code: grpc.StatusCode, retry_after: float | None) -> bool:
    """The call got no answer from the CA (see `UNANSWERED`)."""
    return code in UNANSWERED and retry_after is None


def retry_pushback(trailers: Sequence[tuple[str, str | bytes]] | None) -> float | None:
    """The CA's retry hint in seconds, or `None` when it sent none (or an unusable one)."""
    for key, value in trailers or ():
        if key == RETRY_PUSHBACK_TRAILER:
            try:
                millis = int(value)
            except ValueError:
                return None
            return millis / 1000 if millis >= 0 else None
    return None


class CaClient:
    """Asks the CA to sign CSRs. Create once, `await close()` at shutdown."""

    def __init__(
        self,
        addr: str,
        root_ca: Path | None,
        tokens: TokenProvider,
        clock: Clock,
        *,
        metrics: AgentMetrics,
        cluster_id: str = "",
        extra_headers: Sequence[tuple[str, str]] = (),
        timeout: timedelta = timedelta(seconds=10),
        prov_cert: Path | None = None,
        retry: Backoff = CALL_RETRY_BACKOFF,
        max_attempts: int = 3,
        rng: random.Random | None = None,
        report: PropagationReport | None = None,
    ) -> None:
        self.addr = addr
        self._root_ca = root_ca
        self._tokens = tokens
        self._clock = clock
        self._cluster_id = cluster_id
        self._extra_headers = tuple(extra_headers)
        self._timeout = timeout.total_seconds()
        self._prov_cert = prov_cert
        self._metrics = metrics
        self._retry = retry
        self._max_attempts = max(1, max_attempts)
        self._rng = rng or random.Random()
        self._channel: grpc.aio.Channel | None = None
        self._root_pem: bytes | None = None
        self._report = report
        self._trusted: bytes | None = None  # the served trust bundle, once known
        self._retiring: set[asyncio.Task[None]] = set()
        # What the channel presents from `prov_cert`, and the files' stat when it was read.
        self._prov_pair: tuple[bytes, bytes] | None = None
        self._prov_stamp: tuple[tuple[int, int, int], ...] | None = None

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def trust(self, root_pem: bytes) -> None:
        """Trusts `root_pem` for the connection to the CA from the next call on; calls in
        flight finish on the old channel, which is then closed."""
        if root_pem == self._trusted:
            return
        self._trusted = root_pem
        channel, self._channel = self._channel, None
        if channel is not None and root_pem != self._root_pem:
            log.info("trusting the new bundle for the connection to the CA")
            self._retire(channel)
        elif channel is not None:
            self._channel = channel  # already trusts exactly this

    async def sign(self, request: SigningRequest) -> SignedCertificate:
        """One certificate for `request.identity`, retrying transient failures a few times.

        `request.impersonate` (node mode) is sent as the `ImpersonatedIdentity` request
        metadata; the answer must be for `request.identity` all the same.

        Raises `TokenError` (token unreadable), `CaRequestError` (gRPC status, `.retryable`
        says whether trying again can help), `CaResponseError` (unusable answer) or
        `CaConnectionError` (cannot build the channel).
        """
        attempt = 0
        while True:
            try:
                return await self._sign_once(request)
            except CaRequestError as exc:
                attempt += 1
                if exc.code == grpc.StatusCode.UNAVAILABLE and exc.retry_after is None:
                    await self._refresh_root_if_changed()
                if not exc.retryable or attempt >= self._max_attempts:
                    raise
                if exc.retry_after is not None:
                    delay = exc.retry_after * self._rng.uniform(1.0, 1.0 + PUSHBACK_JITTER)
                else:
                    delay = self._retry.delay(attempt - 1, self._rng)
                log.info("CA call failed (%s); retry %d in %.2fs", exc, attempt, delay)
                self._metrics.record_retry()
                await self._clock.sleep(delay)

    async def _sign_once(self, request: SigningRequest) -> SignedCertificate:
        metadata = self._metadata()  # reads the token: may raise TokenError
        if request.renewal:
            metadata += ((RENEWAL_HEADER, "1"),)
        if self._report is not None:
            metadata += self._report.headers(request.leaf_authority)
        channel = self._get_channel()
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        message = ca_pb2.IstioCertificateRequest(
            csr=request.csr_pem, validity_duration=int(request.ttl.total_seconds())
        )
        if request.impersonate is not None:
            message.metadata.CopyFrom(impersonation_metadata(request.impersonate))
        started = self._clock.monotonic()
        try:
            response = await stub.CreateCertificate(
                message, metadata=metadata, timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            retry_after = retry_pushback(exc.trailing_metadata())
            answered = not _unanswered(exc.code(), retry_after)
            self._record(started, exc.code().name, answered=answered)
            raise CaRequestError(exc.code(), exc.details() or "", retry_after=retry_after) from None
        self._record(started, "OK", answered=True)
        return self._validate(list(response.cert_chain), request.identity, request.key)

    @property
    def timeout(self) -> timedelta:
        """Each call's deadline."""
        return timedelta(seconds=self._timeout)

    async def report(
        self, report: AgentReport, *, timeout: timedelta | None = None
    ) -> dict[str, float]:
        """Sends one periodic report (`meshca.v1.AgentReportService/Report`) with the same
        credentials as a CSR; returns the tainted authorities (ID -> seconds since the taint).
        One attempt (deadline `timeout`, else the client's): the next period is the retry, also
        for a report the CA shed because it is busy (`CaRequestError.retry_after` set). Raises
        `TokenError`, `CaRequestError` (`UNIMPLEMENTED` from a CA that is not meshca) or
        `CaConnectionError`."""
        metadata = self._metadata()
        stub = report_pb2_grpc.AgentReportServiceStub(self._get_channel())
        message = report_pb2.AgentReportRequest(
            agent_id=report.agent_id,
            trust_bundle_sha256=report.bundle_digest or "",
            leaf_authorities=sorted(report.leaf_authorities),
            jwt_kids=report.jwt_kids,
        )
        try:
            response = await stub.Report(
                message,
                metadata=metadata,
                timeout=self._timeout if timeout is None else timeout.total_seconds(),
            )
        except grpc.aio.AioRpcError as exc:
            # A report shed with a retry hint is the CA answering "busy", not silence.
            retry_after = retry_pushback(exc.trailing_metadata())
            # The report also tells whether the CA is reachable.
            self._metrics.record_reachability(answered=not _unanswered(exc.code(), retry_after))
            raise CaRequestError(exc.code(), exc.details() or "", retry_after=retry_after) from None
        self._metrics.record_reachability(answered=True)
        return {t.id: t.seconds_since_taint for t in response.tainted}

    async def mint_jwt_svid(
        self, audiences: Sequence[str], impersonate: SpiffeId | None
    ) -> jwt_svid_pb2.MintJwtSvidResponse:
        """One JWT-SVID (`meshca.v1.JwtSvidService/MintJwtSvid`) with the same credentials as
        a CSR; `impersonate` (node mode) names the pod's identity. One attempt: the workload's
        call is the retry. Raises `TokenError`, `CaRequestError` or `CaConnectionError`."""
        message = jwt_svid_pb2.MintJwtSvidRequest(
            audience=list(audiences), impersonated_identity=impersonate.uri if impersonate else ""
        )
        stub = jwt_svid_pb2_grpc.JwtSvidServiceStub(self._get_channel())
        return await self._unary(stub.MintJwtSvid, message)

    async def fetch_jwt_bundle(self) -> jwt_svid_pb2.JwtBundleResponse:
        """The trust domain's JWT bundle and tainted key IDs (`FetchJwtBundle`)."""
        stub = jwt_svid_pb2_grpc.JwtSvidServiceStub(self._get_channel())
        return await self._unary(stub.FetchJwtBundle, jwt_svid_pb2.JwtBundleRequest())

    async def _unary(self, method: Any, message: Any) -> Any:
        metadata = self._metadata()
        try:
            return await method(message, metadata=metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            retry_after = retry_pushback(exc.trailing_metadata())
            raise CaRequestError(exc.code(), exc.details() or "", retry_after=retry_after) from None

    def _record(self, started: float, outcome: str, *, answered: bool) -> None:
        elapsed = self._clock.monotonic() - started
        self._metrics.record_ca_request(elapsed, outcome, answered=answered)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        headers: list[tuple[str, str]] = []
        token = self._tokens.token()
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        if self._cluster_id:
            headers.append(("clusterid", self._cluster_id))
        headers.extend(self._extra_headers)
        return tuple(headers)

    def _validate(
        self, elements: list[str], identity: SpiffeId, key: PrivateKey
    ) -> SignedCertificate:
        received_at = self._clock.now()
        if len(elements) < 2:
            raise CaResponseError(
                f"CA returned {len(elements)} certificate element(s); expected the leaf and the "
                "root bundle at least"
            )
        try:
            chain = [
                load_certs(pem, what=f"cert_chain[{i}]")[0] for i, pem in enumerate(elements[:-1])
            ]
            roots = load_certs(elements[-1], what="root bundle (last cert_chain element)")
        except CertsError as exc:
            raise CaResponseError(f"CA response does not parse: {exc}") from None
        try:
            accept_certificate(chain, key, now=received_at, identity=identity, roots=roots)
        except CertificateRefused as exc:
            raise CaResponseError(f"CA's answer refused: {exc}") from None
        return SignedCertificate(
            chain_pem=certs_to_pem(chain),
            root_bundle_pem=certs_to_pem(roots),
            leaf=chain[0],
            received_at=received_at,
        )

    # -- channel ---------------------------------------------------------------------------

    def _get_channel(self) -> grpc.aio.Channel:
        if self._channel is not None and self._provisioning_renewed():
            log.info(
                "provisioning certificate in %s changed; connecting to the CA with it",
                self._prov_cert,
            )
            self._retire(self._channel)
            self._channel = None
        if self._channel is None:
            self._channel = self._build_channel()
        return self._channel

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Closes `channel` after the calls in flight on it had time to finish."""
        task = asyncio.get_running_loop().create_task(channel.close(RETIRE_GRACE_SECONDS))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _provisioning_renewed(self) -> bool:
        """True when `PROV_CERT` now holds another usable certificate than the channel's.

        Istio's VM pattern points `PROV_CERT` at `OUTPUT_CERTS`: the agent renews over mTLS with
        the certificate it was last issued, so the channel must follow the files, or it keeps
        presenting the first certificate until the CA refuses it as expired. A stat per call
        notices a change; a pair caught mid-update (key not matching the leaf) is not taken, and
        is looked at again on the next call."""
        if self._prov_cert is None:
            return False
        try:
            stamp = _files_stamp(self._prov_cert / "cert-chain.pem", self._prov_cert / "key.pem")
        except OSError:
            return False  # unreadable now: keep the channel that works
        if stamp == self._prov_stamp:
            return False
        try:
            chain = (self._prov_cert / "cert-chain.pem").read_bytes()
            key = (self._prov_cert / "key.pem").read_bytes()
            usable = key_matches_certificate(load_private_key(key), load_certs(chain)[0])
        except (OSError, CertsError):
            usable = False
        if not usable:
            return False
        return (chain, key) != self._prov_pair

    def _read_root(self) -> bytes | None:
        if self._root_ca is None:
            return None
        try:
            return self._root_ca.read_bytes()
        except OSError as exc:
            raise CaConnectionError(
                f"cannot read the CA root certificate {self._root_ca} ({exc.strerror}); "
                "set CA_ROOT_CA to the mesh root (or SYSTEM)"
            ) from None

    def _build_channel(self) -> grpc.aio.Channel:
        self._root_pem = self._trusted if self._trusted is not None else self._read_root()
        private_key = chain = None
        if self._prov_cert is not None:
            try:
                self._prov_stamp = _files_stamp(
                    self._prov_cert / "cert-chain.pem", self._prov_cert / "key.pem"
                )
                chain = (self._prov_cert / "cert-chain.pem").read_bytes()
                private_key = (self._prov_cert / "key.pem").read_bytes()
            except OSError as exc:
                raise CaConnectionError(
                    f"cannot read the provisioning certificate in {self._prov_cert}: {exc}"
                ) from None
            self._prov_pair = (chain, private_key)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self._root_pem, private_key=private_key, certificate_chain=chain
        )
        log.debug("connecting to the CA at %s", self.addr)
        return grpc.aio.secure_channel(self.addr, credentials, options=channel_options(self.addr))

    async def _refresh_root_if_changed(self) -> None:
        """The CA is unreachable: maybe the mesh root rotated. Rebuild if the file changed
        (unless `trust()` is in use: then the trust bundle keeper watches the file)."""
        if self._trusted is not None:
            return
        try:
            current = self._read_root()
        except CaConnectionError:
            return
        if current != self._root_pem:
            log.info("CA root file %s changed; reconnecting with the new root", self._root_ca)
            await self.close()


def _files_stamp(*paths: Path) -> tuple[tuple[int, int, int], ...]:
    """Inode, size and modification time of each file (through symlinks, so the kubelet-style
    `..data` swap of an output directory shows)."""
    stamps = []
    for path in paths:
        info = path.stat()
        stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


def impersonation_metadata(identity: SpiffeId) -> struct_pb2.Struct:
    """`IstioCertificateRequest.metadata` asking for `identity` on a workload's behalf."""
    metadata = struct_pb2.Struct()
    metadata.update({IMPERSONATED_IDENTITY: identity.uri})
    return metadata


def channel_options(addr: str) -> list[tuple[str, int | str]]:
    """Fast reconnects, and the CA's TLS name for addresses its certificate does not list."""
    options = list(CHANNEL_OPTIONS)
    if _host_of(addr) not in CA_SERVING_HOSTS:
        options.append(("grpc.ssl_target_name_override", CA_TLS_NAME))
    return options


def _host_of(addr: str) -> str:
    """The host of `HOST:PORT` (`[v6]:PORT`); an address of another form (a gRPC target
    scheme, no port) is taken whole, so it never passes for one of the CA's serving names."""
    try:
        return split_host_port(addr)[0]
    except ValueError:
        return addr
