"""The plugged-in authority driver: an operator's CA in `--cacerts-dir`, followed as it
changes, without stranding a workload.

`PluggedCaDirectory` reads Istio's `cacerts` layout (or cert-manager's `tls.crt tls.key
ca.crt`), validated on load; `PluggedDriver` loads it at start and re-reads it when its files
change (one poll per `--ca-reload-interval`), each change checked by `PluggedChangeGuard`.

The operator's steps for a new root B replacing A are: `root-cert.pem` holding A+B (signing
material still under A), then the signing material under B, then `root-cert.pem` holding B
alone. A new intermediate under the same root is a single step (a hot swap). Each reload is
checked against what workloads already have — the bundle this CA last published — before the
CA uses it:

- the new signing certificate must chain to a root *already* distributed (else workloads would
  receive leaves they cannot verify yet: publish the new root first);
- a root may leave the bundle only once no unexpired leaf this CA signed chains to it (else
  those workloads' peers would reject them: wait until they expire);
- with `--activate-at-coverage F`, signing may move to another root only once that fraction
  of the reporting agents (`ca_server.fleet.coverage`, the same figure the self-signed gate
  reads) serve a bundle holding it: "published" is not "received", and a leaf under a root
  its peers do not hold yet fails their handshakes. An intermediate swap under the same root
  is not gated. What the reports could not see counts as not trusting (`AgentCoverage`).
  The wait has a deadline like the self-signed gate's: `--activate-deadline` (a share, 0.5 by
  default) of the current signing certificate's remaining life, counted from when this process
  first refused the change for coverage. Past it the change is taken anyway, said loudly (a
  WARNING, an `authority-switch-deadline` audit line, `meshca_ca_plugged_switch_deadline_total`):
  waiting longer would let the current signing material expire. The operator can also take it
  back, or restart the CA to take it at once.

A refused change is logged (once) with what to do, the current authority kept, and the change
checked again at every poll, so it is taken as soon as it becomes safe. A restart accepts
the directory as it is (the emergency path when the old root is compromised).

The signer (`signer.LocalSigner`) records each leaf under the root it chains to: the per-root
leaf ledger the second rule needs; the driver's `LedgerSink` publishes it so CA processes
sharing the state see each other's leaves. The gate's figure and deadline are the self-signed
gate's rules (`ca_server.fleet.gate_coverage`, `slots.gate_deadline`, `slots.gate_verdict`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from ca_server.authority.driver_core import DriverCore, DriverSettings
from ca_server.authority.report import AuthorityReport
from ca_server.authority.signer import anchor_id, anchor_of
from ca_server.authority.slots import GateVerdict, authority_id, gate_deadline, gate_verdict
from ca_server.config import TtlPolicy
from ca_server.errors import CaSetupError
from ca_server.fleet import AgentReports, LeafLedger, LedgerSink, gate_coverage
from ca_server.metrics import CaMetrics
from certs import (
    CertsError,
    ChainError,
    SigningAuthority,
    load_cert,
    load_certs,
    load_private_key,
    make_authority,
    verify_chain,
)
from meshca.clock import Clock
from meshca.logs import audit

log = logging.getLogger(__name__)


class StrandingChangeError(CaSetupError):
    """A plugged-in CA change that would leave workloads unable to verify each other."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        # "signer-not-distributed" | "signer-not-trusted-yet" | "root-still-in-use"
        self.reason = reason


# Istio's plugged-in CA layouts: (cert, key, root, chain) file names.
ISTIO_LAYOUT = ("ca-cert.pem", "ca-key.pem", "root-cert.pem", "cert-chain.pem")
TLS_LAYOUT = ("tls.crt", "tls.key", "ca.crt")


class AuthoritySource(Protocol):
    def load(self, now: datetime) -> SigningAuthority:
        """The current signing material, validated at `now`."""
        ...

    def fingerprint(self) -> str:
        """Changes whenever the underlying files change (cheap: compared on every poll)."""
        ...

    @property
    def description(self) -> str: ...


def _files_fingerprint(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        try:
            digest.update(path.read_bytes())
        except FileNotFoundError:
            digest.update(b"<missing>")
    return digest.hexdigest()


@dataclass
class PluggedCaDirectory:
    """Istio's `cacerts`: `ca-cert.pem ca-key.pem root-cert.pem cert-chain.pem`, or the
    cert-manager style `tls.crt tls.key ca.crt`."""

    directory: Path
    layout: tuple[str, ...]

    @property
    def description(self) -> str:
        return f"plugged-in CA from {self.directory}"

    def fingerprint(self) -> str:
        return _files_fingerprint([self.directory / name for name in self.layout])

    def load(self, now: datetime) -> SigningAuthority:
        files = {name: self.directory / name for name in self.layout}
        try:
            if self.layout == ISTIO_LAYOUT:
                cert_name, key_name, root_name, chain_name = ISTIO_LAYOUT
                cert = load_cert(files[cert_name].read_bytes(), what=cert_name)
                chain = load_certs(files[chain_name].read_bytes(), what=chain_name)
            else:
                cert_name, key_name, root_name = TLS_LAYOUT
                chain = load_certs(files[cert_name].read_bytes(), what=cert_name)
                cert = chain[0]
            key = load_private_key(files[key_name].read_bytes())
            roots = load_certs(files[root_name].read_bytes(), what=root_name)
            authority = make_authority(cert, key, chain, roots)
            authority.validate(now=now)
        except FileNotFoundError as exc:
            raise CaSetupError(f"plugged-in CA file disappeared: {exc.filename}") from exc
        except CertsError as exc:
            raise CaSetupError(f"plugged-in CA in {self.directory} is unusable: {exc}") from exc
        return authority


def detect_plugged_ca(directory: Path) -> PluggedCaDirectory | None:
    """All files of one layout → that layout; some → `CaSetupError` naming what is missing;
    none → `None` (use a self-signed root)."""
    for layout in (ISTIO_LAYOUT, TLS_LAYOUT):
        present = [name for name in layout if (directory / name).exists()]
        if len(present) == len(layout):
            return PluggedCaDirectory(directory, layout)
        if present:
            missing = [name for name in layout if name not in present]
            raise CaSetupError(
                f"incomplete plugged-in CA in {directory}: found {present} but missing {missing}; "
                f"provide all of {list(layout)} (or none, for a self-signed root)"
            )
    return None


class PluggedChangeGuard:
    def __init__(
        self,
        ledger: LeafLedger,
        agents: AgentReports,
        sink: LedgerSink,
        switch_at_coverage: float | None = None,
        deadline_share: float = 0.5,
        on_deadline: Callable[[], None] = lambda: None,
    ) -> None:
        self._ledger = ledger
        self._agents = agents
        self._sink = sink
        self._switch_at_coverage = switch_at_coverage
        self._deadline_share = deadline_share
        self._on_deadline = on_deadline  # counts the switches taken at the deadline
        self._last_refusal: tuple[str, str] | None = None
        # (root the signer would move to, when this process first held that move back)
        self._waiting: tuple[str, datetime] | None = None

    def first_refusal(self, fingerprint: str, reason: str) -> bool:
        """True the first time this change is refused for this reason (log once, not at
        every poll)."""
        key = (fingerprint, reason)
        if key == self._last_refusal:
            return False
        self._last_refusal = key
        return True

    def save(self, now: datetime) -> None:
        self._sink.save(self._ledger, self._agents, now)

    def check(self, current: SigningAuthority, new: SigningAuthority, now: datetime) -> None:
        """Raises `CaSetupError` (saying what to do) if `new` would strand a workload."""
        distributed = [root for root in new.roots if root in current.roots]
        try:
            verify_chain([new.cert, *new.intermediates], distributed, now=now)
        except ChainError as exc:
            raise StrandingChangeError(
                "signer-not-distributed",
                "the new signing certificate does not chain to a root workloads already have "
                f"({exc}); first add its root to root-cert.pem beside the current one, keeping "
                "the current ca-cert.pem/ca-key.pem, wait until workloads have the new bundle, "
                "then switch the signing material",
            ) from exc
        self._check_new_root_trusted(current, new, now)
        dropped = [root for root in current.roots if root not in new.roots]
        if not dropped:
            return
        self.save(now)
        live = self._sink.live(now)
        for root in dropped:
            root_id = authority_id(root)
            count = max(live.get(root_id, 0), self._ledger.live(now).get(root_id, 0))
            if count:
                raise StrandingChangeError(
                    "root-still-in-use",
                    f"root {root_id} would leave root-cert.pem while {count} "
                    "unexpired leaves signed under it are in use; keep it in root-cert.pem "
                    "until they have expired (at most the maximum workload TTL after the "
                    "signing material moved to the new root), then remove it",
                )

    def _check_new_root_trusted(
        self, current: SigningAuthority, new: SigningAuthority, now: datetime
    ) -> None:
        """Under `--activate-at-coverage`: refuses moving the signer to a root that too few
        reporting agents trust yet (see the module docstring)."""
        fraction = self._switch_at_coverage
        anchor = anchor_of(new)
        if fraction is None or anchor is None or anchor == anchor_of(current):
            return
        self.save(now)  # this process's own reports count too
        bundle = [(authority_id(root), root) for root in current.roots]
        root_id = authority_id(anchor)
        covered = gate_coverage(bundle, self._sink.agents(now), root_id)
        if self._waiting is None or self._waiting[0] != root_id:
            self._waiting = (root_id, now)
        since = self._waiting[1]
        deadline = gate_deadline(since, current.cert.not_valid_after_utc, self._deadline_share)
        verdict = gate_verdict(covered, fraction, deadline, now)
        if verdict is GateVerdict.COVERED:
            self._waiting = None
            return
        if verdict is GateVerdict.DEADLINE:
            self._waiting = None
            self._on_deadline()
            log.warning(
                "moving signing to root %s without the wanted coverage: only %s (--activate-at-"
                "coverage wants %.0f%%), held back since %s and the --activate-deadline has "
                "passed. Agents that do not trust it yet fail to verify its leaves until they get "
                "the new bundle: check their root-cert.pem source",
                root_id,
                covered,
                fraction * 100,
                since.isoformat(),
            )
            audit(
                "authority-switch-deadline",
                outcome="switched",
                root=root_id,
                coverage=str(covered),
                waiting_since=since.isoformat(),
            )
            return
        raise StrandingChangeError(
            "signer-not-trusted-yet",
            f"signing would move to root {root_id}, but only {covered} (--activate-at-"
            f"coverage wants {fraction:.0%}); keep root-cert.pem holding both roots and "
            "wait until the agents have the new bundle (the change is taken as soon as they "
            f"do, or anyway at {deadline.isoformat()}), or restart the CA to take it now",
        )


def audit_reload(authority: SigningAuthority) -> None:
    """The audit line of an accepted change: what signs now, its root, the bundle."""
    anchor = anchor_of(authority)
    audit(
        "authority-reloaded",
        outcome="reloaded",
        authority=authority_id(authority.cert),
        root=authority_id(anchor) if anchor is not None else None,
        bundle=[authority_id(root) for root in authority.roots],
    )


def audit_refusal(error: StrandingChangeError) -> None:
    audit("authority-change-refused", outcome="refused", reason=error.reason)


def plugged_source_for(cacerts_dir: Path | None) -> PluggedCaDirectory | None:
    """The plugged-in CA when `--cacerts-dir` holds a complete layout; else `None`
    (self-signed authority slots). Raises `CaSetupError` for a missing directory or an
    incomplete layout."""
    if cacerts_dir is None:
        return None
    if not cacerts_dir.is_dir():
        what = "is not a directory" if cacerts_dir.exists() else "does not exist"
        raise CaSetupError(
            f"--cacerts-dir {cacerts_dir} {what}: give the directory holding the "
            "plugged-in CA's files, or leave the flag out for a self-signed root"
        )
    plugged = detect_plugged_ca(cacerts_dir)
    if plugged is None:
        log.info("no plugged-in CA files in %s; using a self-signed root", cacerts_dir)
    return plugged


class PluggedDriver(DriverCore):
    """A plugged-in CA (an `AuthorityDriver`): the directory, re-read when it changes, each
    change checked by the guard before use. It has no slots, so no taints and no report."""

    report: AuthorityReport | None = None

    def __init__(
        self,
        source: AuthoritySource,
        metrics: CaMetrics,
        clock: Clock,
        settings: DriverSettings,
        ttl: TtlPolicy,
        *,
        switch_at_coverage: float | None = None,
        deadline_share: float = 0.5,
    ) -> None:
        super().__init__(settings, clock, metrics)
        self.source = source
        self.ttl_policy = ttl
        self._guard = PluggedChangeGuard(
            self.ledger,
            settings.agent_reports,
            settings.ledger_sink,
            switch_at_coverage=switch_at_coverage,
            deadline_share=deadline_share,
            on_deadline=metrics.plugged_switch_deadline.inc,
        )

    def tainted_since(self) -> dict[str, datetime]:
        return {}  # a plugged-in CA has no taints

    async def start(self) -> None:
        """Loads the directory (raises `CaSetupError` for unusable material)."""
        authority = await asyncio.to_thread(self.source.load, self.clock.now())
        self._adopt(authority)
        log.info(
            "signing with %s (trust domain %s)",
            self.source.description,
            self.settings.trust_domain,
        )

    def _adopt(self, authority: SigningAuthority) -> None:
        self.adopt(authority, anchor_id(authority), authority.roots, self.tainted_since())

    async def run(self) -> None:
        """Re-reads the signing material when it changes; a broken update is refused and the
        current authority kept, so an operator's half-copied `cacerts` never stops issuance.

        Runs until cancelled: nothing the source or the reload steps raise may end it, or the
        CA would silently stop following its authority. Unusable material is logged once per
        change; any other failure (unreadable file, full disk, a bug) is logged and retried at
        the next poll."""
        seen = await asyncio.to_thread(self.source.fingerprint)
        while True:
            await self.clock.sleep(self.settings.poll_interval)
            try:
                await asyncio.to_thread(self.save_ledger)
                seen = await self._reload_if_changed(seen)
            except Exception:
                log.exception(
                    "keeping the current CA: checking %s for changes failed; retrying",
                    self.source.description,
                )

    async def _reload_if_changed(self, seen: str) -> str:
        """One poll: reloads if the fingerprint moved from `seen`; returns the fingerprint
        handled."""
        source = self.source
        current = await asyncio.to_thread(source.fingerprint)
        if current == seen:
            return seen
        now = self.clock.now()
        try:
            authority = await asyncio.to_thread(source.load, now)
            await asyncio.to_thread(self._guard.check, self.signer.authority, authority, now)
        except StrandingChangeError as exc:
            # Checked again at every poll: waiting (for leaves to expire) can make it acceptable.
            if self._guard.first_refusal(current, exc.reason):
                log.error("keeping the current CA: %s", exc)
                audit_refusal(exc)
            return seen
        except (CaSetupError, CertsError) as exc:
            log.error(
                "keeping the current CA: the changed %s is unusable: %s", source.description, exc
            )
            return current
        # The audit line first: handlers sign on the RPC server's completion-queue thread, not
        # on this loop, so a leaf of the new authority could otherwise be answered (and seen)
        # before the line that says the CA moved to it.
        audit_reload(authority)
        self._adopt(authority)
        log.info(
            "reloaded %s; now signing with serial %x",
            source.description,
            authority.cert.serial_number,
        )
        return current
