"""Reading Prometheus text exposition in tests, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_value(exposition: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of the sample `name{labels}`; 0.0 when absent (a counter never incremented)."""
    wanted = labels or {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                return float(sample.value)
    return 0.0
