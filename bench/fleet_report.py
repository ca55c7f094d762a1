"""What `bench/fleet_scale.py` measured, and how it is printed: the start-up table, the
comparisons with the baseline (pod cache off, same N) and with the smallest N, the API requests
until ready, the new-token table, and issue 30's "Done means" targets checked against the run
(each line says which figures it compares, so a reader can check the verdict)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.audit_tally import describe
from bench.ca_tree import Readiness
from bench.token_load import LoadResult

# Issue 30, "Done means" (1, 2, 4): the limits, against the same run's 0-pod CA.
READY_LIMIT_S = {60_000: 30.0, 150_000: 60.0}
RSS_ALLOWANCE_MIB = {60_000: 64.0, 150_000: 160.0}
PEAK_ALLOWANCE_MIB = 128.0
EVENT_CPU_LIMIT_S = 0.5
NEW_TOKEN_SHARE = 0.5
ISTIOD_MS_PER_NEW_TOKEN = 2.5


@dataclass(frozen=True)
class TokenRun:
    mode: str
    new: LoadResult
    cached: LoadResult
    reviews_new: int
    reviews_cached: int
    cpu_new: float  # CPU seconds of the tree over the round
    cpu_cached: float

    @property
    def ms_per_new(self) -> float:
        return self.cpu_new * 1000 / self.new.sent

    @property
    def ms_per_cached(self) -> float:
        return self.cpu_cached * 1000 / self.cached.sent


@dataclass
class CaRun:
    pods: int
    workers: int
    pod_cache: bool
    ready: Readiness
    rss_mib: float | None = None
    peak_mib: float = 0.0
    restarts: int = 0
    start_calls: Counter[str] = field(default_factory=Counter)
    events: int = 0
    event_cpu: float | None = None  # CPU seconds over idle for `events` pod changes
    tokens: TokenRun | None = None
    died_after_ready: bool = False

    @property
    def label(self) -> str:
        return "on" if self.pod_cache else "off"

    @property
    def cpu_per_thousand_events(self) -> float | None:
        if self.event_cpu is None or self.events == 0:
            return None
        return self.event_cpu * 1000 / self.events


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} MiB"


def _delta(value: float | None, base: float | None, unit: str = "MiB") -> str:
    if value is None or base is None:
        return "—"
    return f"{value - base:+,.1f} s" if unit == "s" else f"{value - base:+,.0f} {unit}"


def _ratio(value: float | None, base: float | None) -> str:
    return "" if value is None or not base else f" ({value / base:.2f}x)"


def _cache_size(ready: Readiness) -> str:
    """What the CA says its pod cache holds at ready (`meshca_ca_kube_cache_objects`)."""
    return "" if ready.pods_in_cache is None else f" (pod cache: {ready.pods_in_cache:,.0f})"


def start_row(run: CaRun) -> str:
    ready = run.ready
    ready_text = _seconds(ready.seconds) if ready.seconds is not None else "**never**"
    events = run.cpu_per_thousand_events
    calls = run.start_calls
    pod_calls = (
        f"{calls['list pods'] + calls['watch pods (initial state)']}/"
        f"{calls['list pods (continue)']}/{calls['watch pods']}"
    )
    return (
        f"| {run.pods:,} | {run.workers} | {run.label} | {ready_text} | "
        f"{ready.cpu_seconds:.1f} s | {_mib(run.rss_mib)} | {_mib(run.peak_mib)} | "
        f"{'—' if events is None else f'{events:.2f} s'} | {pod_calls} | "
        f"{calls['create tokenreviews']} | {run.restarts}"
        f"{' (died after ready)' if run.died_after_ready else ''} |"
    )


START_HEADER = (
    "| pods | workers | pod cache | ready | CPU to ready | RSS after ready (Σ tree) | "
    "peak to ready+events (Σ VmHWM: upper bound of the peak of the sum) | "
    "CPU / 1,000 pod events | pod state requests (LIST start or watch-list)/pages/WATCH at "
    "start | TokenReviews at start | "
    "processes replaced |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def comparisons(runs: Sequence[CaRun]) -> list[str]:
    """Each cache-on run against the baseline of the same N and workers, and against its own
    configuration at the smallest N."""
    lines = []
    by_key = {(r.pods, r.workers, r.pod_cache): r for r in runs}
    smallest = min((r.pods for r in runs), default=0)
    for run in runs:
        if not run.pod_cache:
            continue
        base = by_key.get((run.pods, run.workers, False))
        zero = by_key.get((smallest, run.workers, True))
        parts = [f"{run.pods:,} pods, workers {run.workers}:"]
        if base is not None:
            parts.append(
                f"vs cache off: RSS {_delta(run.rss_mib, base.rss_mib)}"
                f"{_ratio(run.rss_mib, base.rss_mib)}, "
                f"peak {_delta(run.peak_mib, base.peak_mib)}"
                f"{_ratio(run.peak_mib, base.peak_mib)}, "
                f"ready {_delta(run.ready.seconds, base.ready.seconds, 's')}"
                f"{_ratio(run.ready.seconds, base.ready.seconds)};"
            )
        if zero is not None and zero is not run:
            parts.append(
                f"vs {smallest:,} pods: RSS {_delta(run.rss_mib, zero.rss_mib)}"
                f"{_ratio(run.rss_mib, zero.rss_mib)}, "
                f"peak {_delta(run.peak_mib, zero.peak_mib)}"
                f"{_ratio(run.peak_mib, zero.peak_mib)}"
            )
            if run.rss_mib is not None and zero.rss_mib is not None and run.pods > smallest:
                per_pod = (run.rss_mib - zero.rss_mib) * 1024 * 1024 / (run.pods - smallest)
                parts.append(f"({per_pod / 1024:,.1f} KiB per pod)")
        lines.append(" ".join(parts))
    return lines


TOKEN_HEADER = (
    "| pods | workers | validation | new tokens/s | cached/s | new ÷ cached | TokenReviews "
    "new/cached | CPU ms per new token | per cached | failures |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def token_row(run: CaRun) -> str | None:
    t = run.tokens
    if t is None:
        return None
    ratio = t.new.rate / t.cached.rate if t.cached.rate else 0.0
    failures = sum(t.new.failures.values()) + sum(t.cached.failures.values())
    example = next(iter((t.new.failures + t.cached.failures).most_common(1)), None)
    return (
        f"| {run.pods:,} | {run.workers} | {t.mode} | {t.new.rate:,.0f} | {t.cached.rate:,.0f} | "
        f"{ratio:.2f} | {t.reviews_new}/{t.reviews_cached} | {t.ms_per_new:.2f} | "
        f"{t.ms_per_cached:.2f} | {failures}{f' ({example[0]})' if example else ''} |"
    )


def print_report(runs: Sequence[CaRun]) -> None:
    print("\n## Start-up and steady state\n")
    print(START_HEADER)
    for run in runs:
        print(start_row(run))
    never = [r for r in runs if r.ready.seconds is None]
    for run in never:
        print(f"- never ready ({run.pods:,} pods, workers {run.workers}): {run.ready.why_not}")
    print()
    for line in comparisons(runs):
        print(f"- {line}")
    print("\nAPI requests until ready (audit log):")
    for run in runs:
        print(
            f"- {run.pods:,} pods, workers {run.workers}, cache {run.label}: "
            f"{describe(run.start_calls)}{_cache_size(run.ready)}"
        )
    rows = [row for row in map(token_row, runs) if row]
    if rows:
        print("\n## New-token throughput\n")
        print(TOKEN_HEADER)
        print("\n".join(rows))
    checks = targets(runs)
    if checks:
        print("\n## Issue 30 targets (Done means 1, 2, 4)\n")
        print("\n".join(f"- {line}" for line in checks))


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _limit_for(pods: int, limits: dict[int, float]) -> float | None:
    reached = [size for size in limits if pods >= size]
    return limits[max(reached)] if reached else None


def targets(runs: Sequence[CaRun]) -> list[str]:
    """Issue 30's measurable "Done means" for each pod-cache run they apply to."""
    lines = []
    smallest = {
        r.workers: r for r in sorted(runs, key=lambda r: r.pods) if r.pod_cache and r.pods == 0
    }
    for run in runs:
        if not run.pod_cache or run.pods == 0:
            continue
        where = f"{run.pods:,} pods, workers {run.workers}:"
        ready_limit = _limit_for(run.pods, READY_LIMIT_S)
        if ready_limit is not None:
            seconds = run.ready.seconds
            ok = seconds is not None and seconds <= ready_limit
            shown = "never" if seconds is None else _seconds(seconds)
            lines.append(f"{_verdict(ok)} {where} ready {shown} ≤ {ready_limit:.0f} s")
        zero = smallest.get(run.workers)
        allowance = _limit_for(run.pods, RSS_ALLOWANCE_MIB)
        if zero is not None and allowance is not None and zero.rss_mib is not None:
            ok = run.rss_mib is not None and run.rss_mib <= zero.rss_mib + allowance
            lines.append(
                f"{_verdict(ok)} {where} RSS after ready "
                f"{'never measured' if run.rss_mib is None else _mib(run.rss_mib)} "
                f"≤ 0-pod {_mib(zero.rss_mib)} "
                f"+ {allowance:.0f} MiB"
            )
            ok = run.peak_mib <= zero.peak_mib + PEAK_ALLOWANCE_MIB
            lines.append(
                f"{_verdict(ok)} {where} peak {_mib(run.peak_mib)} ≤ 0-pod peak "
                f"{_mib(zero.peak_mib)} + {PEAK_ALLOWANCE_MIB:.0f} MiB"
            )
        events = run.cpu_per_thousand_events
        if events is not None:
            lines.append(
                f"{_verdict(events <= EVENT_CPU_LIMIT_S)} {where} {events:.2f} s CPU per "
                f"1,000 pod events ≤ {EVENT_CPU_LIMIT_S} s"
            )
        calls = run.start_calls
        states = calls["list pods"] + calls["watch pods (initial state)"]
        one = states == 1 and calls["watch pods"] == 1
        lines.append(
            f"{_verdict(one)} {where} one pod LIST + WATCH per replica at start (LIST "
            f"{calls['list pods']} + streamed {calls['watch pods (initial state)']}, "
            f"WATCH {calls['watch pods']})"
        )
        tokens = run.tokens
        if tokens is not None and tokens.cached.rate:
            share = tokens.new.rate / tokens.cached.rate
            ok = share >= NEW_TOKEN_SHARE and tokens.reviews_new == 0
            lines.append(
                f"{_verdict(ok)} {where} new tokens {tokens.new.rate:,.0f}/s ≥ half of cached "
                f"{tokens.cached.rate:,.0f}/s ({share:.2f}), TokenReviews {tokens.reviews_new}"
            )
        elif run.pods >= 60_000 and run.ready.seconds is None:
            lines.append(f"FAIL {where} no new-token figures: the pod cache never became ready")
    for run in runs:
        if run.tokens is not None and run.tokens.mode == "tokenreview":
            ms = run.tokens.ms_per_new
            lines.append(
                f"{_verdict(ms <= ISTIOD_MS_PER_NEW_TOKEN)} {run.pods:,} pods, workers "
                f"{run.workers}: TokenReview path {ms:.2f} ms CPU per new token ≤ istiod's "
                f"~{ISTIOD_MS_PER_NEW_TOKEN} ms"
            )
    return lines
