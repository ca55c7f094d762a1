"""Fixtures for Kubernetes mode against a real kube-apiserver and etcd (built from the Go modules
pinned in tests/realbin; `tests.support.real_binaries`).

The control plane starts once per session (per xdist worker). Each test that runs a CA gets its
own namespace and ServiceAccount with `deploy/`'s RBAC applied for it (`ca_account`), so tests
cannot see each other's Secret, Lease or RBAC. A missing binary fails the test: nothing here
skips.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ca_process import CaProcess
from tests.support.deploy_rbac import Rule, is_allowed, required_rule
from tests.support.kube_api_calls import (
    ATTEST_REFUSAL,
    CA_RBAC,
    POD_CERTIFICATE_RBAC,
    attest_rule,
    contract_rules,
    describe,
)
from tests.support.real_kube import AppliedRbac, RealControlPlane, apply_deploy_rbac

_names = itertools.count(1)


@pytest.fixture(scope="session")
def control_plane(starts_processes: None) -> Iterator[RealControlPlane]:
    plane = RealControlPlane().start()
    try:
        yield plane
    finally:
        plane.stop()


def unique(prefix: str) -> str:
    """A namespace or object name no other test of this session uses."""
    return f"{prefix}-{next(_names)}"


@dataclass
class Account:
    """A component's ServiceAccount with deploy/'s RBAC, and a kubeconfig that authenticates
    as it."""

    namespace: str
    name: str
    kubeconfig: Path
    rbac: AppliedRbac


def make_account(
    plane: RealControlPlane,
    directory: Path,
    *,
    deploy_account: str = "meshca",
    drop: Rule | None = None,
    namespace: str | None = None,
) -> Account:
    namespace = namespace or unique("ca")
    if namespace not in {ns.metadata.name for ns in plane.core.list_namespace().items}:
        plane.create_namespace(namespace)
    plane.create_service_account(namespace, deploy_account)
    rbac = apply_deploy_rbac(
        plane, namespace, deploy_account, deploy_account=deploy_account, drop=drop
    )
    directory.mkdir(parents=True, exist_ok=True)
    kubeconfig = plane.account_kubeconfig(
        directory / f"{namespace}-{deploy_account}.kubeconfig", namespace, deploy_account
    )
    return Account(namespace, deploy_account, kubeconfig, rbac)


def api_calls(plane: RealControlPlane, account: Account) -> list[tuple[Rule, int]]:
    """Each request `account` made, from the API server's audit log: the narrowest rule that
    allows it, and the status the server answered (403: RBAC refused it)."""
    username = f"system:serviceaccount:{account.namespace}:{account.name}"
    calls = []
    for event in plane.audit_events(username):
        code = int(event.get("responseStatus", {}).get("code", 0))
        ref = event.get("objectRef")
        if ref is None:  # a non-resource URL, e.g. /openid/v1/jwks
            path = event["requestURI"].split("?")[0]
            calls.append((Rule("", path, event["verb"], "cluster"), code))
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        rule = required_rule(
            ref.get("apiGroup", ""),
            resource,
            event["verb"],
            ref.get("namespace"),
            account.namespace,
            ref.get("name"),  # the authorizer's: a list/watch's field-selector name too
        )
        attest = attest_rule(ref.get("name")) if resource == "clustertrustbundles" else None
        if attest is not None and event["verb"] in ("create", "update"):
            # Admission's `attest` check, after RBAC allowed the write: refused, it is the
            # attest rule that is missing, not the write's.
            message = event.get("responseStatus", {}).get("message", "")
            if code == 403 and ATTEST_REFUSAL in message:
                calls += [(rule, 200), (attest, 403)]
                continue
            if code != 403:
                calls.append((attest, code))
        calls.append((rule, code))
    return calls


def assert_calls_within_contract(
    plane: RealControlPlane, account: Account, contract: frozenset[Rule]
) -> set[Rule]:
    """Every call `account` made is one tests/support/kube_api_calls.py declares and the server
    allowed it (deploy/'s RBAC sufficed); returns the rules used."""
    calls = api_calls(plane, account)
    outside = {rule for rule, _ in calls if not is_allowed(set(contract), rule)}
    assert not outside, f"API calls outside tests/support/kube_api_calls.py: {describe(outside)}"
    refused = {rule for rule, code in calls if code == 403}
    assert not refused, f"refused by deploy/'s RBAC: {describe(refused)}"
    return contract_rules(contract, (rule for rule, _ in calls))


@pytest.fixture
def ca_account(control_plane: RealControlPlane, tmp_path: Path) -> Iterator[Account]:
    """The CA's ServiceAccount `meshca` in a fresh namespace, with exactly deploy/'s RBAC; the
    test fails if the CA made a call outside the contract or one the RBAC refused."""
    account = make_account(control_plane, tmp_path)
    try:
        yield account
        assert_calls_within_contract(control_plane, account, CA_RBAC | POD_CERTIFICATE_RBAC)
    finally:
        account.rbac.delete(control_plane)


RealCaFactory = Callable[..., CaProcess]


@pytest.fixture
def real_ca(tmp_path: Path, ca_account: Account, starts_processes: None) -> Iterator[RealCaFactory]:
    """`real_ca("ca-0", *args, start=True)`: `meshca ca` in Kubernetes mode against the real
    API server, authenticated as `ca_account`, its namespace the CA's own."""
    started: list[CaProcess] = []

    def make(name: str = "ca-0", *args: str, start: bool = True) -> CaProcess:
        ca = CaProcess(
            tmp_path / name,
            "--kubeconfig",
            str(ca_account.kubeconfig),
            "--namespace",
            ca_account.namespace,
            "--instance-id",
            name,
            *args,
        )
        started.append(ca)
        if start:
            ca.start()
        return ca

    try:
        yield make
    finally:
        for ca in started:
            ca.stop()
