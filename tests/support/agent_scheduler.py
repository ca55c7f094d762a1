"""The agent's certificate scheduler for in-process tests, wired as the agent wires it.

`agent.certificate_source` gives the scheduler the agent's metrics and a trust-bundle keeper
that publishes `ROOTCA` into the same cache; a test scheduler gets the same parts, real ones,
so a test sees what the agent would (the keeper's retention rules, the metrics' series).
"""

from __future__ import annotations

import random

from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.scheduler import CertificateScheduler, StartHook
from agent.secrets import SecretCache
from agent.signing import CertificateSigner
from agent.trust_bundle import TrustBundleKeeper
from meshca.clock import Clock


def scheduler_for(
    config: AgentConfig,
    signer: CertificateSigner,
    cache: SecretCache,
    clock: Clock,
    metrics: AgentMetrics,
    *,
    start_hook: StartHook | None = None,
    rng: random.Random | None = None,
) -> CertificateScheduler:
    """`CertificateScheduler.from_config` with `metrics` and a `TrustBundleKeeper` on `cache`."""
    return CertificateScheduler.from_config(
        config,
        signer,
        cache,
        clock,
        metrics=metrics,
        trust_bundle=TrustBundleKeeper(cache, clock, metrics),
        start_hook=start_hook,
        rng=rng,
    )
