"""The trust bundle the agent serves (`ROOTCA`), changed without minting new leaves.

Why: when the CA's authority rotates, the bundle changes first ({old, new} roots) and the leaves
later, at their normal renewal. Istio re-signs every leaf on a bundle change (a mesh-wide CSR
storm); here a new bundle only reaches the places a bundle lives: the `ROOTCA` SDS secret (pod
and node mode alike, one `ROOTCA`), `root-cert.pem` in every output directory (through the
cache's listeners: `agent.file_output` writes a new generation, so a reader never sees half a
set), and the CA client's TLS trust for its own connection to the CA. No CSR is sent.

Sources (`SOURCE_*`, the `source` label of the metrics):

- `root-file`: the root file the agent already reads (`--ca-root` / `CA_ROOT_CA`; in Kubernetes
  the `istio-ca-root-cert` ConfigMap mount), followed by `RootFileWatch` (`agent.polled_file`:
  a `stat` each second that sees the kubelet's `..data` symlink swap, in-place rewrites and
  renames; a file that cannot be read counts as refused);
- `ca-response`: the root bundle at the end of every CA answer (`agent.scheduler` hands it in);
- `restored`: the bundle in a previous run's output files, at start-up; it is served only when
  no other source has delivered one (it may be older than the root file).

The rule (`TrustBundleKeeper.learn`):

1. A bundle is refused, with a log line and `meshca_agent_trust_bundle_refused_total{source}`,
   when it is not PEM, holds no CA certificate, or every CA certificate in it has expired;
   the served bundle stays as it was. Non-CA certificates in a bundle are dropped (logged).
2. Each source remembers the last bundle it delivered; only a *change* from a source counts
   (a re-read of an unchanged file, or a CA answer carrying the same roots as the previous one,
   does nothing). The bundle that changed most recently is the *latest*.
3. Served = latest plus retained, where retained are the roots (from the served bundle or any
   source's bundle) that anchor a leaf the agent currently serves but that the latest bundle
   would not verify. Those are kept, with a warning naming the leaf, until that leaf is
   replaced: dropping them would make Envoy reject peers whose leaves come from the same
   authority as ours, and make our own `root-cert.pem` fail to verify our `cert-chain.pem`.
   The leaf about to be replaced by the CA answer being learned (`replacing=`) is left out of
   the check; the scheduler calls `recheck()` once the new leaf is published.
4. The CA client trusts served plus the root file's latest bundle, so a CA answer can never take
   away the root the CA's own serving certificate chains to.

The bundle digest (`bundle_digest`) is canonical: SHA-256 over the sorted SHA-256 digests of
the roots' DER encodings, so order and PEM formatting do not matter. It is what the agent
reports to the CA (`agent.propagation`) and what the metrics show.

Concurrency: everything runs on the agent's event loop; `RootFileWatch`'s `stat`s and reads run
in a worker thread (`agent.polled_file`) and hand their results back to the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509

from agent.errors import TrustBundleRefused
from agent.metrics import AgentMetrics, CounterChild
from agent.polled_file import DEFAULT_POLL_INTERVAL, PolledFile
from agent.secrets import ROOT_RESOURCE, RootSecret, SecretCache, TlsSecret
from certs import CertsError, certs_to_pem, is_ca, load_certs, verify_chain
from certs.bundle import bundle_digest, root_fingerprint
from meshca.clock import Clock

log = logging.getLogger(__name__)

SOURCE_ROOT_FILE = "root-file"
SOURCE_CA_RESPONSE = "ca-response"
SOURCE_RESTORED = "restored"
SOURCES = (SOURCE_ROOT_FILE, SOURCE_CA_RESPONSE, SOURCE_RESTORED)

ANCHOR_MEMO_LIMIT = 65536


@dataclass(frozen=True)
class TrustBundle:
    """A validated set of CA certificates, in the order first seen, without duplicates."""

    roots: tuple[x509.Certificate, ...]

    @classmethod
    def parse(cls, data: str | bytes, *, what: str, now: datetime) -> TrustBundle:
        """The CA certificates in `data`; `TrustBundleRefused` says why there are none to
        serve (not PEM, no CA certificate, all expired)."""
        try:
            certs = load_certs(data, what=what)
        except CertsError as exc:
            raise TrustBundleRefused(f"{what} is not a PEM certificate bundle: {exc}") from None
        cas = [cert for cert in certs if is_ca(cert)]
        if not cas:
            raise TrustBundleRefused(
                f"{what} holds {len(certs)} certificate(s) but no CA certificate "
                "(BasicConstraints CA:TRUE); it must hold the mesh root(s)"
            )
        if len(cas) < len(certs):
            log.warning(
                "%s: ignoring %d certificate(s) that are not CAs", what, len(certs) - len(cas)
            )
        if all(cert.not_valid_after_utc <= now for cert in cas):
            raise TrustBundleRefused(f"every CA certificate in {what} has expired")
        return cls(()).with_roots(cas)

    def with_roots(self, extra: Iterable[x509.Certificate]) -> TrustBundle:
        """This bundle plus the roots of `extra` it does not hold yet (appended)."""
        roots = list(self.roots)
        seen = {root_fingerprint(root) for root in roots}
        for root in extra:
            fingerprint = root_fingerprint(root)
            if fingerprint not in seen:
                seen.add(fingerprint)
                roots.append(root)
        return TrustBundle(tuple(roots))

    @property
    def digest(self) -> str:
        return bundle_digest(self.roots)

    @property
    def pem(self) -> str:
        return certs_to_pem(self.roots)


class TrustBundleMetrics:
    """The trust-bundle part of `AgentMetrics`, by source."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def updated(self, source: str) -> None:
        self._metrics.trust_bundle_updates.labels(source=source).inc()

    def refused(self, source: str) -> CounterChild:
        return self._metrics.trust_bundle_refused.labels(source=source)

    def served(self, bundle: TrustBundle, retained: int) -> None:
        """The served bundle: one `trust_bundle_info` series, for its digest."""
        metrics = self._metrics
        metrics.trust_bundle_info.clear()
        metrics.trust_bundle_info.labels(bundle.digest[:16]).set(1)
        metrics.trust_bundle_roots.set(len(bundle.roots))
        metrics.trust_bundle_retained_roots.set(retained)


class TrustBundleKeeper:
    """Holds the served trust bundle and publishes every change (see the module docstring)."""

    def __init__(
        self,
        cache: SecretCache,
        clock: Clock,
        metrics: AgentMetrics,
    ) -> None:
        self._cache = cache
        self._clock = clock
        self._metrics = TrustBundleMetrics(metrics)
        self._from: dict[str, TrustBundle] = {}  # source -> its last accepted bundle
        self._latest: TrustBundle | None = None
        self.served: TrustBundle | None = None
        self.retained: tuple[x509.Certificate, ...] = ()
        self._trust_listeners: list[Callable[[bytes], None]] = []
        self._anchors: dict[tuple[str, str, str], x509.Certificate | None] = {}
        self.updates = 0
        self.refusals = 0

    def add_trust_listener(self, listener: Callable[[bytes], None]) -> None:
        """Calls `listener(pem)` with the CA-connection trust (rule 4) whenever it changes."""
        self._trust_listeners.append(listener)

    @property
    def digest(self) -> str | None:
        """The served bundle's digest, reported to the CA; None before the first bundle."""
        return self.served.digest if self.served is not None else None

    async def learn(self, data: str | bytes, source: str, *, replacing: str | None = None) -> bool:
        """Takes a bundle from `source`; returns True when the served bundle changed.

        `replacing`: the secret whose leaf the caller is about to replace with one verified
        against this bundle (a CA answer), left out of the retention check."""
        now = self._clock.now()
        try:
            bundle = TrustBundle.parse(data, what=f"trust bundle ({source})", now=now)
        except TrustBundleRefused as exc:
            self.refusals += 1
            self._metrics.refused(source).inc()
            kept = "keeping the served bundle" if self.served else "no bundle served yet"
            log.warning("refusing the %s trust bundle: %s; %s", source, exc, kept)
            return False
        previous = self._from.get(source)
        if previous is None or previous.digest != bundle.digest:
            self._from[source] = bundle
            if source != SOURCE_RESTORED or self._latest is None:
                self._latest = bundle
        return await self._recompute(replacing)

    async def _recompute(self, replacing: str | None) -> bool:
        latest = self._latest
        if latest is None:
            return False
        retained = self._roots_to_retain(latest, replacing)
        served = latest.with_roots(retained)
        self.retained = tuple(retained)
        if self.served is not None and served.digest == self.served.digest:
            # The same roots, maybe kept for another reason.
            self._metrics.served(self.served, len(retained))
            return False
        before = self.served
        self.served = served
        self.updates += 1
        source = next((s for s, b in self._from.items() if b is latest), "unknown")
        self._metrics.updated(source)
        self._metrics.served(served, len(retained))
        log.info(
            "trust bundle %s: %d root(s), digest %s (from the %s; was %s); no new leaves needed",
            "now served" if before is None else "changed",
            len(served.roots),
            served.digest[:16],
            source,
            before.digest[:16] if before else "none",
        )
        # Everything up to the cache's own store runs without yielding, so concurrent learns
        # (node mode's workers) apply in order. The cache's listeners rewrite root-cert.pem.
        trust = served.with_roots(self._from.get(SOURCE_ROOT_FILE, TrustBundle(())).roots)
        for listener in self._trust_listeners:
            listener(trust.pem.encode("ascii"))
        await self._cache.publish(RootSecret(ROOT_RESOURCE, served.pem))
        return True

    async def recheck(self) -> bool:
        """Re-applies the rule after a leaf was published (it may need a root to be kept, or
        free one that was); True when the served bundle changed."""
        return await self._recompute(None)

    def _roots_to_retain(
        self, latest: TrustBundle, replacing: str | None
    ) -> list[x509.Certificate]:
        """Roots that anchor a served leaf `latest` would not verify (rule 3), taken from the
        served bundle or any source's bundle."""
        if self.served is None and not self._cache.names():
            return []
        pool = TrustBundle(self.served.roots if self.served else ())
        for bundle in self._from.values():
            pool = pool.with_roots(bundle.roots)
        latest_prints = {root_fingerprint(root) for root in latest.roots}
        keep: dict[bytes, x509.Certificate] = {}
        for name in self._cache.names():
            secret = self._cache.get(name)
            if name == replacing or not isinstance(secret, TlsSecret):
                continue
            anchor = self._missing_anchor(secret, latest, pool)
            if anchor is None or root_fingerprint(anchor) in latest_prints:
                continue
            if root_fingerprint(anchor) not in keep:
                log.warning(
                    "the new trust bundle lacks the root (%s) that the served certificate %r "
                    "chains to; keeping that root in ROOTCA until the certificate is renewed",
                    anchor.subject.rfc4514_string() or root_fingerprint(anchor).hex()[:16],
                    name,
                )
            keep[root_fingerprint(anchor)] = anchor
        return list(keep.values())

    def _missing_anchor(
        self, secret: TlsSecret, latest: TrustBundle, pool: TrustBundle
    ) -> x509.Certificate | None:
        """The root in `pool` that `secret`'s chain ends at, when `latest` does not verify it
        (None when it does, or when nothing does). Memoised per (leaf, bundles)."""
        key = (secret.version, latest.digest, pool.digest)
        if key in self._anchors:
            return self._anchors[key]
        now = self._clock.now()
        anchor: x509.Certificate | None = None
        try:
            chain = load_certs(secret.cert_chain_pem)
            try:
                verify_chain(chain, latest.roots, now=now)
            except CertsError:
                anchor = verify_chain(chain, pool.roots, now=now)
        except CertsError:
            anchor = None
        if len(self._anchors) > ANCHOR_MEMO_LIMIT:
            self._anchors.clear()
        self._anchors[key] = anchor
        return anchor


class RootFileWatch:
    """Feeds the root file to the keeper: at start, and on every change (`agent.polled_file`:
    a `stat` every `interval` seconds, no watchdog in a pod agent)."""

    def __init__(
        self,
        path: Path,
        keeper: TrustBundleKeeper,
        clock: Clock,
        metrics: AgentMetrics,
        *,
        interval: float = DEFAULT_POLL_INTERVAL,
    ) -> None:
        self.path = path
        self._keeper = keeper
        self._refused = metrics.trust_bundle_refused.labels(source=SOURCE_ROOT_FILE)
        self._file = PolledFile(
            path, clock, on_change=self._changed, on_error=self._unreadable, interval=interval
        )

    async def start(self) -> None:
        """Learns the file's bundle before returning (so it precedes any CA answer or restored
        file), then follows its changes."""
        await self._file.start()

    async def _changed(self, data: bytes) -> None:
        await self._keeper.learn(data, SOURCE_ROOT_FILE)

    def _unreadable(self, reason: str) -> None:
        """A root file that cannot be read changes nothing served; it is counted as a refused
        bundle from the root file."""
        self._refused.inc()
        kept = "keeping the served bundle" if self._keeper.served else "no bundle served yet"
        log.warning("refusing the root-file trust bundle: %s; %s", reason, kept)

    async def stop(self) -> None:
        await self._file.stop()
