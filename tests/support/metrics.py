"""Reading Prometheus text exposition in tests, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_value(exposition: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples `name{...}` whose labels include `labels`; 0.0 when none exist
    (a labelled counter never incremented has no sample at all)."""
    wanted = labels or {}
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items())
    )
