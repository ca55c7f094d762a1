"""Which main package each test binary is built from: one module directory may name several
(`tool ( ... )` block, what `go get -tool` writes for a second one), matched by name."""

from __future__ import annotations

from tests.support import real_binaries
from tests.support.real_binaries import _tools, binaries

BLOCK = """module m

tool (
\tistio.io/istio/pilot/cmd/pilot-agent
\tistio.io/istio/pilot/cmd/pilot-discovery
)

require istio.io/istio v0.0.0-1
"""


def test_tool_lines_and_blocks_are_read():
    assert _tools("tool go.etcd.io/etcd/server/v3\n") == ["go.etcd.io/etcd/server/v3"]
    assert _tools(BLOCK) == [
        "istio.io/istio/pilot/cmd/pilot-agent",
        "istio.io/istio/pilot/cmd/pilot-discovery",
    ]


def test_every_binary_has_its_own_package_and_one_module_gives_two():
    found = binaries()
    assert found["pilot-agent"].package.endswith("/pilot-agent")
    assert found["pilot-discovery"].package.endswith("/pilot-discovery")
    assert found["pilot-agent"].module_dir == found["pilot-discovery"].module_dir
    assert found["pilot-agent"].version == found["pilot-discovery"].version
    assert found["helm"].package == "helm.sh/helm/v4/cmd/helm"
    assert found["helm"].version == "v4.3.2"
    assert found["etcd"].package == "go.etcd.io/etcd/server/v3"
    assert len({b.package for b in found.values()}) == len(real_binaries._BINARIES)
