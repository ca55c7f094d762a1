"""Changing a plugged-in CA (`--cacerts-dir`) without stranding a workload.

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
  of the reporting agents (`ca_server.authority.agent_reports`, the same figure the self-signed gate
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

`RecordingSigner` keeps the per-root leaf ledger the second rule needs; its `LedgerSink`
publishes it so CA processes sharing the state see each other's leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from cryptography import x509

from ca_server.authority.agent_reports import coverage
from ca_server.authority.leaf_ledger import LeafLedger, LedgerSink
from ca_server.authority.signer import IssuedCertificate, LocalSigner
from ca_server.authority.slots import AgentCoverage, authority_id
from ca_server.errors import CaSetupError
from ca_server.ttl import Validity
from certs import ChainError, PublicKey, SigningAuthority, SpiffeId, verify_chain
from certs.chain import issued_by
from meshca.clock import Clock
from meshca.logs import audit

log = logging.getLogger(__name__)


class StrandingChangeError(CaSetupError):
    """A plugged-in CA change that would leave workloads unable to verify each other."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        # "signer-not-distributed" | "signer-not-trusted-yet" | "root-still-in-use"
        self.reason = reason


def anchor_of(authority: SigningAuthority) -> x509.Certificate | None:
    """The root the signing chain ends at (what a leaf from this authority verifies to)."""
    top = (authority.cert, *authority.intermediates)[-1]
    for root in authority.roots:
        if root == top or issued_by(top, root):
            return root
    return None


class RecordingSigner(LocalSigner):
    """A `LocalSigner` that records each leaf under the ID of the root it chains to."""

    def __init__(self, authority: SigningAuthority, ledger: LeafLedger, clock: Clock) -> None:
        super().__init__(authority)
        self._ledger = ledger
        self._clock = clock
        self._anchor_id = _anchor_id(authority)

    def replace(self, authority: SigningAuthority) -> None:
        # The anchor is found once per authority (it may take signature checks), not per leaf.
        self._anchor_id = _anchor_id(authority)
        super().replace(authority)

    def sign(
        self,
        public_key: PublicKey,
        identity: SpiffeId,
        validity: Validity,
        *,
        csr: x509.CertificateSigningRequest | None = None,
    ) -> IssuedCertificate:
        anchor_id = self._anchor_id
        issued = super().sign(public_key, identity, validity, csr=csr)
        if anchor_id is not None:
            self._ledger.record(anchor_id, issued.leaf.not_valid_after_utc, self._clock.now())
        return issued


def _anchor_id(authority: SigningAuthority) -> str | None:
    anchor = anchor_of(authority)
    return authority_id(anchor) if anchor is not None else None


class PluggedChangeGuard:
    def __init__(
        self,
        ledger: LeafLedger,
        sink: LedgerSink,
        switch_at_coverage: float | None = None,
        deadline_share: float = 0.5,
        on_deadline: Callable[[], None] = lambda: None,
    ) -> None:
        self._ledger = ledger
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
        self._sink.save(self._ledger, now)

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
        counted = coverage(bundle, self._sink.agents(now))
        root_id = authority_id(anchor)
        covered = AgentCoverage(
            counted.trusting.get(root_id, 0), counted.reporting, counted.unseen, counted.unreadable
        )
        if covered.reaches(fraction):
            self._waiting = None
            return
        if self._waiting is None or self._waiting[0] != root_id:
            self._waiting = (root_id, now)
        since = self._waiting[1]
        deadline = since + (current.cert.not_valid_after_utc - since) * self._deadline_share
        if now >= deadline:
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
