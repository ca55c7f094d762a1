"""Placing a Workload API caller: cgroup texts the kubelet writes (cgroupfs and systemd
drivers, cgroup v1 and v2), unreadable processes, pods the informer does not know or that
ended, and connections that did not come through the relay. Pure: `/proc` is a directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import CallerNotAttested
from agent.peer_relay import Accepted
from agent.workload_attestor import (
    BAD_IDENTITY,
    NO_CGROUP,
    NO_PEER,
    NOT_IN_POD,
    POD_ENDED,
    UNKNOWN_POD,
    NodeAttestor,
    NodeCaller,
    PeerCredentials,
    ProcessCgroups,
    pod_uid_in_cgroup,
)
from tests.support.workload_api_server import PodsByUid

UID = "5f0c8e3e-1d2b-4c6a-9e7f-0a1b2c3d4e5f"
SYSTEMD_UID = UID.replace("-", "_")
CID = "cri-containerd-9b1c0d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d"


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v2, systemd driver (burstable, besteffort, guaranteed)
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
        f"{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice/"
        f"{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/{CID}.scope\n",
        # cgroup v1, cgroupfs driver: one line per controller, all naming the same pod
        f"12:memory:/kubepods/burstable/pod{UID}/9b1c0d2e\n11:cpu,cpuacct:/kubepods/burstable/"
        f"pod{UID}/9b1c0d2e\n1:name=systemd:/kubepods/burstable/pod{UID}/9b1c0d2e\n",
        # cgroup v2 seen from inside a container's own cgroup namespace... plus kind's nesting
        f"0::/system.slice/docker-abc.scope/kubelet.slice/kubelet-kubepods.slice/"
        f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{SYSTEMD_UID}.slice/"
        f"{CID}.scope\n",
    ],
)
def test_the_pod_uid_in_every_kubelet_layout(text: str) -> None:
    assert pod_uid_in_cgroup(text) == UID


@pytest.mark.parametrize(
    "text",
    [
        "0::/user.slice/user-1000.slice/session-2.scope\n",
        "0::/system.slice/kubelet.service\n",
        "0::/\n",
        "",
        f"0::/kubepods/burstable/pod{UID}ab/x\n",  # not a UID: longer than one
        "0::/podcast.slice/x\n",
    ],
)
def test_a_process_in_no_pod_names_no_uid(text: str) -> None:
    assert pod_uid_in_cgroup(text) is None


def test_a_cgroup_text_naming_two_pods_is_refused() -> None:
    other = "8a9b0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d"
    with pytest.raises(CallerNotAttested) as info:
        pod_uid_in_cgroup(f"12:memory:/kubepods/pod{UID}/a\n11:cpu:/kubepods/pod{other}/b\n")
    assert info.value.reason == NOT_IN_POD
    assert "2 different pods" in str(info.value)


def write_cgroup(proc: Path, pid: int, text: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(text)


def test_process_cgroups_refusals_name_the_step(tmp_path: Path) -> None:
    cgroups = ProcessCgroups(tmp_path)
    write_cgroup(tmp_path, 42, f"0::/kubepods/burstable/pod{UID}/c\n")
    write_cgroup(tmp_path, 43, "0::/user.slice/session-1.scope\n")
    assert cgroups.pod_uid_of(42) == UID
    cases = {0: NO_PEER, 43: NOT_IN_POD, 44: NO_CGROUP}
    for pid, reason in cases.items():
        with pytest.raises(CallerNotAttested) as info:
            cgroups.pod_uid_of(pid)
        assert info.value.reason == reason
    with pytest.raises(CallerNotAttested, match="hostPID: true"):
        cgroups.pod_uid_of(44)


def test_the_pod_decides_the_identity(tmp_path: Path) -> None:
    pods = PodsByUid()
    pods.add(UID, "shop", "orders")
    attestor = NodeAttestor(pods, "cluster.local", ProcessCgroups(tmp_path))
    assert attestor.identity_of_pod(UID).uri == "spiffe://cluster.local/ns/shop/sa/orders"
    with pytest.raises(CallerNotAttested) as info:
        attestor.identity_of_pod("8a9b0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d")
    assert info.value.reason == UNKNOWN_POD and "retry in a moment" in str(info.value)
    pods.add(UID, "shop", "orders", phase="Failed")
    with pytest.raises(CallerNotAttested) as info:
        attestor.identity_of_pod(UID)
    assert info.value.reason == POD_ENDED
    pods.add(UID, "Shop_Bad", "orders")
    with pytest.raises(CallerNotAttested) as info:
        attestor.identity_of_pod(UID)
    assert info.value.reason == BAD_IDENTITY


class Records:
    def __init__(self, records: dict[str, Accepted]) -> None:
        self.records = records

    def accepted(self, peer: str) -> Accepted | None:
        return self.records.get(peer)


def test_node_caller_serves_only_what_was_learned_at_accept(tmp_path: Path) -> None:
    pods = PodsByUid()
    pods.add(UID, "shop", "orders")
    refusal = CallerNotAttested(NOT_IN_POD, "not in a pod")
    caller = NodeCaller(
        Records(
            {
                "unix-abstract:a": Accepted(PeerCredentials(7, 0, 0), UID, None),
                "unix-abstract:b": Accepted(PeerCredentials(8, 0, 0), None, refusal),
            }
        ),
        NodeAttestor(pods, "cluster.local", ProcessCgroups(tmp_path)),
    )
    assert caller.resource_for("unix-abstract:a") == "spiffe://cluster.local/ns/shop/sa/orders"
    with pytest.raises(CallerNotAttested) as info:
        caller.resource_for("unix-abstract:b")
    assert info.value is refusal
    for peer in ("unix:", "unix-abstract:c", "ipv4:127.0.0.1:5"):
        with pytest.raises(CallerNotAttested) as info:
            caller.resource_for(peer)
        assert info.value.reason == NO_PEER
