"""Istio's metric names, exactly, on top of meshca's conventional ones.

Istio exports its counters without the `_total` suffix that `prometheus_client` always appends
to a Counter. meshca records with ordinary Counters under its own `meshca_*` names and this
collector re-exports each one under the Istio name (type `unknown`, same labels and values), so
existing Istio dashboards keep working and meshca's own series stay conventional.

The source of an alias is any collector yielding the counter's family: the Counter itself in a
single process, or `FamilyOf(multiprocess_collector, name)` where a supervisor aggregates the
counters its worker processes wrote (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class FamilyOf(Collector):
    """Only the metric family `name` (without `_total`) out of everything `source` yields."""

    def __init__(self, source: Collector, name: str) -> None:
        self._source = source
        self._name = name

    def collect(self) -> Iterable[Metric]:
        return [family for family in self._source.collect() if family.name == self._name]


class IstioCounterAliases(Collector):
    def __init__(self, aliases: Mapping[str, Collector]) -> None:
        self._aliases = dict(aliases)

    def collect(self) -> Iterable[Metric]:
        for alias, source in self._aliases.items():
            families = list(source.collect())
            names = ", ".join(f"{family.name}_total" for family in families) or "a meshca counter"
            metric = Metric(alias, f"Istio-compatible name of {names}", "unknown")
            for family in families:
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        metric.add_sample(alias, sample.labels, sample.value)
            yield metric
