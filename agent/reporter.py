"""The agent's light periodic report to a meshca CA, and how it learns of a taint.

Every `interval` (± 20 %, so agents started together do not report together) the agent sends
what its CSRs already carry as headers (`agent.propagation`): its agent id, the digest of the
trust bundle it serves and the authorities of the leaves it serves — so the CA's coverage
figures are fresh between renewals — and the kids of the JWT bundle it holds
(`agent.jwt_svids.JwtSvidSource.held_kids`), which the CA's JWT key activation waits for.
The answer lists the authorities the CA has tainted; the reporter hands them to the one
scheduler (`CertificateScheduler.taints_learned`), which re-signs the affected leaves paced
over the taint window. Pod and node agents alike: one report
per agent, covering all its identities. The taint notice beside the root file
(`agent.taint_file`) usually tells the agent first, within seconds; the report is the source
that needs nothing but the CA connection (a root file from elsewhere, a CA that publishes no
notice), and both feed the same path (`agent.taints`).

Failures are logged and the next period tries again (the report is advisory; certificates do
not depend on it): one line when reports start failing, then quiet until one succeeds. A report
a busy CA sheds (`UNAVAILABLE` with a retry hint: reports are the CA's lowest priority) is said
at INFO, not as a warning, and counted as `UNAVAILABLE` like any other refusal.

Trying again next period holds for an unexpected error too: the report is how an agent learns of
a taint between renewals, so it must outlive a bug or an exception type gRPC did not document,
not stop at the first one. Each report's deadline is at most one period, so a call that hangs
delays the next report (and with it a taint) by one period, not by the CSR timeout. A CA that
answers `UNIMPLEMENTED` (Istio's istiod) is not meshca: the reporter says so once and stops.

Concurrency: one task on the agent's event loop (`CaCertificateSource.run` owns it); the clock
and the random source are injected.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from datetime import timedelta

import grpc

from agent.ca_client import CaClient
from agent.errors import CaClientError, CaRequestError, TokenError
from agent.jwt_svids import JwtSvidSource
from agent.metrics import AgentMetrics
from agent.propagation import PropagationReport
from agent.scheduler import CertificateScheduler
from agent.taints import SOURCE_REPORT, taints_from_report
from meshca.clock import Clock

log = logging.getLogger(__name__)

INTERVAL_JITTER = 0.2
# What the reporter last said about failing reports (it says it once, not every period).
BUSY = "busy"  # shed by an overloaded CA with a retry hint
FAILING = "failing"  # anything else


def report_delay(interval: timedelta, rng: random.Random) -> float:
    """`interval` ± 20 %, uniformly: bounded, and spread across agents."""
    seconds = interval.total_seconds()
    return seconds * rng.uniform(1.0 - INTERVAL_JITTER, 1.0 + INTERVAL_JITTER)


@dataclass
class PeriodicReporter:
    client: CaClient
    scheduler: CertificateScheduler
    propagation: PropagationReport
    clock: Clock
    interval: timedelta
    metrics: AgentMetrics
    rng: random.Random = field(default_factory=random.Random)
    jwt: JwtSvidSource | None = None  # the Workload API's JWT-SVIDs, whose bundle it reports
    sent: int = 0

    async def run(self) -> None:
        """Reports until cancelled (or until the CA turns out not to take reports)."""
        trouble: str | None = None  # what was last logged about failing reports, if anything
        while True:
            await self.clock.sleep(report_delay(self.interval, self.rng))
            try:
                await self.report_once()
            except CaRequestError as exc:
                self._count(exc.code.name)
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "the CA at %s does not take meshca agent reports (not a meshca CA?); "
                        "not reporting (coverage counts this agent from its CSRs only)",
                        self.client.addr,
                    )
                    return
                trouble = self._failed(exc, trouble)
            except (CaClientError, TokenError) as exc:
                self._count("ERROR")
                trouble = self._failed(exc, trouble)
            except Exception:  # a bug here must not end taint learning for the agent's life
                self._count("ERROR")
                log.exception("unexpected error sending the agent report; trying again next period")
                trouble = FAILING
            else:
                if trouble is not None:
                    log.info("agent report to the CA succeeded again")
                trouble = None

    @property
    def deadline(self) -> timedelta:
        """One report's deadline: the period at most (the client's own timeout if shorter)."""
        return min(self.interval, self.client.timeout)

    async def report_once(self) -> int:
        """One report; returns how many identities were rescheduled for a taint."""
        kids = self.jwt.held_kids() if self.jwt is not None else ()
        report = self.propagation.periodic(self.scheduler.leaf_authorities(), kids)
        tainted = await self.client.report(report, timeout=self.deadline)
        self.sent += 1
        self._count("OK")
        learnt = taints_from_report(tainted, self.clock.now())
        return self.scheduler.taints_learned(learnt, SOURCE_REPORT)

    def _failed(self, exc: Exception, trouble: str | None) -> str:
        """One line when reports start failing (or start failing otherwise than by the CA
        being busy), then quiet until a report succeeds again. A report the CA shed with a
        retry hint is load shedding working as meant, not a fault: said once at INFO, and the
        next period is the retry (the hint is shorter than a period or the CA is swamped)."""
        busy = isinstance(exc, CaRequestError) and exc.retry_after is not None
        now = BUSY if busy else FAILING
        if trouble == now or (trouble == FAILING and busy):
            log.debug("agent report to the CA failed (%s); trying again next period", exc)
        elif busy:
            log.info(
                "the CA is busy and shed the agent report (%s); reporting again next period", exc
            )
        else:
            log.warning("agent report to the CA failed (%s); trying again next period", exc)
        return FAILING if FAILING in (trouble, now) else BUSY

    def _count(self, outcome: str) -> None:
        self.metrics.reports.labels(outcome).inc()
