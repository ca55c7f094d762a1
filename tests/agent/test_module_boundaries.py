"""Inside the agent: the certificate pipeline does not depend on its transport, and node mode's
identity sources are reached only where the one identity source is chosen.

Read from the source with `ast` (nothing imported, `tests/support/source_imports.py`), so a
lazy import inside a function counts too.
"""

from __future__ import annotations

from tests.support.processes import REPO_ROOT
from tests.support.source_imports import imported_modules, within

# What the pipeline passes and the parts that decide and drive, none of which needs gRPC: the
# CA client is one `agent.signing.CertificateSigner`, handed in.
PIPELINE = (
    "agent.signing",
    "agent.scheduler",
    "agent.rotation",
    "agent.cert_state",
    "agent.identity_sources",
)
TRANSPORT = ("agent.ca_client", "grpc")


def imports_of(module: str) -> set[str]:
    path = REPO_ROOT / (module.replace(".", "/") + ".py")
    return set(imported_modules(path.read_text(encoding="utf-8")))


def importers_of(target: str) -> set[str]:
    """The agent modules that import `target` (at any depth)."""
    found = set()
    for path in sorted((REPO_ROOT / "agent").glob("*.py")):
        module = "agent." + path.stem
        if any(within(name, (target,)) for name in imports_of(module)):
            found.add(module)
    return found


def test_the_pipeline_does_not_import_the_transport() -> None:
    found = {
        f"{module} imports {name}"
        for module in PIPELINE
        for name in imports_of(module)
        if within(name, TRANSPORT)
    }
    assert found == set()


def test_node_sources_are_chosen_in_one_place() -> None:
    """`agent.identity_sources.identity_source_for` picks the source; the certificate source
    only asks whether the chosen one watches pods (the Workload API's attestor needs them)."""
    assert importers_of("agent.node_identities") == {
        "agent.identity_sources",
        "agent.certificate_source",
    }


def test_the_probe_sees_imports() -> None:
    """The reader finds the imports the tests above forbid, where they do exist."""
    assert "agent.ca_client" in imports_of("agent.certificate_source")
    assert "agent.reporter" in importers_of("agent.ca_client")
