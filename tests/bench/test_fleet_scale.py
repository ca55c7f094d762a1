"""`bench/fleet_scale.py`, the instrument of issue 30: the parts that read the API server's audit
log and the CA's metrics, and one tiny run of the whole bench on the real control plane (a
handful of pods), so the bench that measures the fleet cannot rot between the runs that use it.

The smoke run's checks are the bench's own sanity: each mode makes the API calls it must (the
cache-on CA one pod LIST, the baseline none), offline validation costs no TokenReview and the
TokenReview mode one per new token and none per cached one — a bench whose numbers were wired
to the wrong CA or the wrong window fails here."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.audit_tally import request_kind
from bench.ca_tree import OBJECTS_METRIC, SYNCED_METRIC, Readiness, pod_cache_gauge
from bench.fleet_report import CaRun, targets
from bench.fleet_scale import parse_args, run


def test_a_list_page_that_continues_is_counted_apart_from_a_list_start() -> None:
    pods = {"resource": "pods"}
    first = {"verb": "list", "objectRef": pods, "requestURI": "/api/v1/pods?limit=500"}
    later = {"verb": "list", "objectRef": pods, "requestURI": "/api/v1/pods?limit=500&continue=x"}
    watch = {"verb": "watch", "objectRef": pods, "requestURI": "/api/v1/pods?watch=true"}
    stream = {
        "verb": "watch",
        "objectRef": pods,
        "requestURI": "/api/v1/pods?resourceVersionMatch=NotOlderThan&sendInitialEvents=true",
    }
    review = {
        "verb": "create",
        "objectRef": {"resource": "tokenreviews", "apiGroup": "authentication.k8s.io"},
        "requestURI": "/apis/authentication.k8s.io/v1/tokenreviews",
    }
    token = {
        "verb": "create",
        "objectRef": {"resource": "serviceaccounts", "subresource": "token"},
        "requestURI": "/api/v1/namespaces/a/serviceaccounts/b/token",
    }
    jwks = {"verb": "get", "requestURI": "/openid/v1/jwks"}
    assert [request_kind(e) for e in (first, later, watch, stream, review, token, jwks)] == [
        "list pods",
        "list pods (continue)",
        "watch pods",
        "watch pods (initial state)",
        "create tokenreviews",
        "create serviceaccounts/token",
        "get /openid/v1/jwks",
    ]


def test_the_pod_cache_gauges_are_read_per_worker_and_absent_when_not_exported() -> None:
    exposition = (
        f"# TYPE {SYNCED_METRIC} gauge\n"
        f'{SYNCED_METRIC}{{pid="1",resource="pods"}} 1.0\n'
        f'{SYNCED_METRIC}{{pid="2",resource="pods"}} 0.0\n'
        f'{SYNCED_METRIC}{{pid="1",resource="serviceaccounts"}} 1.0\n'
        f"# TYPE {OBJECTS_METRIC} gauge\n"
        f'{OBJECTS_METRIC}{{resource="pods"}} 1234.0\n'
    )
    assert sorted(pod_cache_gauge(exposition, SYNCED_METRIC) or []) == [0.0, 1.0]
    assert pod_cache_gauge(exposition, OBJECTS_METRIC) == [1234.0]
    assert pod_cache_gauge("# TYPE other gauge\nother 1.0\n", SYNCED_METRIC) is None


def _cache_run(pods: int, ready: float | None, rss: float | None, peak: float) -> CaRun:
    one_each = Counter({"list pods": 1, "watch pods": 1} if ready is not None else {})
    readiness = Readiness(ready, 1.0, "" if ready is not None else "exited")
    return CaRun(pods, 2, True, readiness, rss, peak, start_calls=one_each)


def test_issue_30_targets_compare_60000_pods_with_the_same_runs_0_pod_ca() -> None:
    zero = _cache_run(0, 3.0, 312.0, 344.0)
    within = _cache_run(60_000, 29.0, 312.0 + 64.0, 344.0 + 128.0)
    assert all(line.startswith("PASS") for line in targets([zero, within]))
    over = _cache_run(60_000, 31.0, 312.0 + 65.0, 344.0 + 129.0)
    verdicts = [line.split()[0] for line in targets([zero, over])]
    assert verdicts.count("FAIL") == 3 and verdicts.count("PASS") == 1  # one LIST + WATCH
    never = targets([zero, _cache_run(60_000, None, None, 2459.0)])
    assert all(line.startswith("FAIL") for line in never)
    assert any("ready never" in line for line in never)


@pytest.mark.process
def test_a_tiny_fleet_run_measures_both_cas_and_counts_their_api_calls() -> None:
    flags = {
        "--pods": "30",
        "--workers": "2",
        "--tokens": "12",
        "--events": "10",
        "--namespaces": "3",
        "--nodes": "2",
        "--accounts-per-namespace": "2",
        "--idle-seconds": "0.5",
        "--ready-timeout": "60",
    }
    options = parse_args([part for pair in flags.items() for part in pair])
    runs = run(options)
    assert [(r.pods, r.pod_cache) for r in runs] == [(30, True), (30, False)]
    cache_on, cache_off = runs
    for each in runs:
        assert each.ready.seconds is not None, each.ready.why_not
        assert each.rss_mib is not None and each.rss_mib > 20
        assert each.peak_mib >= each.rss_mib - 1
        assert each.restarts == 0
        assert each.events == 10
    # One pod state request (a list, or since issue 30 a watch-list) per replica, one list per
    # worker before: the bench counts either.
    states = ("list pods", "watch pods (initial state)")
    assert 1 <= sum(cache_on.start_calls[kind] for kind in states) <= 2
    assert sum(cache_off.start_calls[kind] for kind in states) == 0
    assert cache_on.tokens is not None and cache_off.tokens is not None
    offline, review = cache_on.tokens, cache_off.tokens
    for rounds in (offline, review):
        assert not rounds.new.failures and not rounds.cached.failures
        assert rounds.new.sent == rounds.cached.sent == 12
    assert (offline.reviews_new, offline.reviews_cached) == (0, 0)
    # Across two workers: the second round reaches the worker that reviewed each token.
    assert (review.reviews_new, review.reviews_cached) == (12, 0)
