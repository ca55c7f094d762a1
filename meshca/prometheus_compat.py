"""Istio's metric names, exactly, on top of meshca's conventional ones.

Istio exports its counters without the `_total` suffix that `prometheus_client` always appends
to a Counter. meshca records with ordinary Counters under its own `meshca_*` names and this
collector re-exports each one under the Istio name (type `unknown`, same labels and values), so
existing Istio dashboards keep working and meshca's own series stay conventional.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class IstioCounterAliases(Collector):
    def __init__(self, aliases: Mapping[str, Counter]) -> None:
        self._aliases = dict(aliases)

    def collect(self) -> Iterable[Metric]:
        for alias, counter in self._aliases.items():
            metric = Metric(alias, f"Istio-compatible name of {counter._name}_total", "unknown")
            for family in counter.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        metric.add_sample(alias, sample.labels, sample.value)
            yield metric
