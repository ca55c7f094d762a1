from prometheus_client import CollectorRegistry, Counter, generate_latest

from meshca.prometheus_compat import IstioCounterAliases
from tests.support.metrics import sample_value


def test_counters_are_re_exported_under_the_istio_name_without_total():
    registry = CollectorRegistry()
    csr = Counter("meshca_x_requests", "requests", ["kind"], registry=registry)
    registry.register(IstioCounterAliases({"citadel_server_csr_count": csr}))
    csr.labels("a").inc(3)
    csr.labels("b").inc()

    text = generate_latest(registry).decode()
    assert 'citadel_server_csr_count{kind="a"} 3.0' in text
    assert "citadel_server_csr_count_total" not in text
    assert sample_value(text, "citadel_server_csr_count") == 4
    assert sample_value(text, "meshca_x_requests_total") == 4
