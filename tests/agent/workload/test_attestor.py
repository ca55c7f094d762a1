"""Placing a Workload API caller: cgroup texts the kubelet writes (cgroupfs and systemd
drivers, cgroup v1 and v2), unreadable processes, pids that are no longer the caller's (a
start time after the accept, a process that changed while it was read, an exited caller's
pidfd), pods the informer does not know or that ended, and connections that did not come
through the relay. `/proc` is a directory (`tests.support.fake_proc`); a pidfd is real."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import CallerNotAttested
from agent.workload.attestor import (
    BAD_IDENTITY,
    NOT_IN_POD,
    POD_ENDED,
    UNKNOWN_POD,
    NodeAttestor,
    NodeCaller,
    ProcessCgroups,
    pod_uid_in_cgroup,
)
from agent.workload.peer_process import (
    CALLER_EXITED,
    NO_PEER,
    PID_REUSED,
    UNREADABLE,
    Accepted,
    PeerCredentials,
)
from tests.support.fake_proc import boot_ns, caller, file_process, stat_text
from tests.support.workload_api_server import PodsByUid, pod_cgroup

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


def test_process_cgroups_refusals_name_the_step(tmp_path: Path) -> None:
    cgroups = ProcessCgroups(tmp_path)
    file_process(tmp_path, 42, f"0::/kubepods/burstable/pod{UID}/c\n", start_ticks=1)
    file_process(tmp_path, 43, "0::/user.slice/session-1.scope\n", start_ticks=1)
    assert cgroups.pod_uid_of(caller(42)) == UID
    cases = {0: NO_PEER, 43: NOT_IN_POD, 44: UNREADABLE}
    for pid, reason in cases.items():
        with pytest.raises(CallerNotAttested) as info:
            cgroups.pod_uid_of(caller(pid))
        assert info.value.reason == reason
    with pytest.raises(CallerNotAttested, match="hostPID: true"):
        cgroups.pod_uid_of(caller(44))


# --- is the pid still the caller's? ----------------------------------------------------------
# Each case goes through `NodeAttestor.pod_uid_of`, the relay's `inspect`: the process now at
# the caller's pid is in the payments pod, the caller was not.

PAYMENTS_UID = "8a9b0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d"
HZ = os.sysconf("SC_CLK_TCK")


def tick_of(boot_ns: int) -> int:
    return boot_ns * HZ // 1_000_000_000


@pytest.fixture
def attestor(tmp_path: Path) -> NodeAttestor:
    pods = PodsByUid()
    pods.add(UID, "shop", "orders")
    pods.add(PAYMENTS_UID, "shop", "payments")
    return NodeAttestor(pods, "cluster.local", ProcessCgroups(tmp_path))


def test_a_process_started_after_the_accept_is_not_the_caller(
    tmp_path: Path, attestor: NodeAttestor
) -> None:
    """The start-time way (no pidfd): the process at the pid must have started before the
    connection was accepted, in an earlier clock tick than the accept's."""
    accepted = boot_ns()
    file_process(tmp_path, 42, pod_cgroup(PAYMENTS_UID), start_ticks=tick_of(accepted) + 3)
    with pytest.raises(CallerNotAttested) as info:
        attestor.pod_uid_of(caller(42, accepted))
    assert info.value.reason == PID_REUSED
    assert "started after the connection was accepted" in str(info.value)
    file_process(tmp_path, 42, pod_cgroup(PAYMENTS_UID), start_ticks=tick_of(accepted))
    with pytest.raises(CallerNotAttested) as info:
        attestor.pod_uid_of(caller(42, accepted))
    assert info.value.reason == PID_REUSED
    assert "within the clock tick" in str(info.value) and "connect again" in str(info.value)
    file_process(tmp_path, 42, pod_cgroup(UID), start_ticks=tick_of(accepted) - 1)
    assert attestor.pod_uid_of(caller(42, accepted)) == UID


@pytest.fixture
def cgroup_fifo(tmp_path: Path) -> Iterator[Path]:
    """Pid 42's cgroup file as a FIFO: its reader waits for the test's writer, so the test
    acts exactly while the attestor reads it."""
    file_process(tmp_path, 42, "", start_ticks=1)
    fifo = tmp_path / "42" / "cgroup"
    fifo.unlink()
    os.mkfifo(fifo)
    yield fifo
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # frees a writer nobody read


def test_a_process_that_changes_while_it_is_read_is_not_the_caller(
    tmp_path: Path, attestor: NodeAttestor, cgroup_fifo: Path
) -> None:
    """The start-time way: the caller exits while its cgroup is read and another process, in
    another pod, takes its pid (its start time still before the accept, so only the second
    read of the stat can tell)."""
    accepted = boot_ns()
    (tmp_path / "42" / "stat").write_text(stat_text(42, tick_of(accepted) - 100))

    def take_the_pid() -> None:
        with cgroup_fifo.open("w") as reading:  # opens once the attestor opens it
            (tmp_path / "42" / "stat").write_text(stat_text(42, tick_of(accepted) - 50))
            reading.write(pod_cgroup(PAYMENTS_UID))

    taker = threading.Thread(target=take_the_pid, daemon=True)
    taker.start()
    try:
        with pytest.raises(CallerNotAttested) as info:
            attestor.pod_uid_of(caller(42, accepted))
    finally:
        taker.join(5)
    assert info.value.reason == PID_REUSED
    assert "changed while the node agent inspected it" in str(info.value)


def test_a_gone_pid_is_refused(tmp_path: Path, attestor: NodeAttestor) -> None:
    with pytest.raises(CallerNotAttested) as info:
        attestor.pod_uid_of(caller(4242))
    assert info.value.reason == UNREADABLE
    assert "it has exited" in str(info.value)


def test_with_a_pidfd_a_live_caller_is_placed_without_its_start_time(
    tmp_path: Path, attestor: NodeAttestor
) -> None:
    """The pidfd way: the pidfd (of this very process) says the caller still runs, so the pid
    was its own while the cgroup was read; no stat is read (none is filed)."""
    pid = os.getpid()
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "cgroup").write_text(pod_cgroup(UID))
    pidfd = os.pidfd_open(pid)
    try:
        assert attestor.pod_uid_of(caller(pid, pidfd=pidfd)) == UID
    finally:
        os.close(pidfd)


@pytest.mark.process  # the caller is a child process that exits
def test_with_a_pidfd_an_exited_caller_is_refused(tmp_path: Path, attestor: NodeAttestor) -> None:
    """The pidfd way: a caller that has exited is refused, whatever its pid's files now say
    (here: another pod, and a start time before the accept)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(child.pid)
    try:
        child.wait(10)
        file_process(tmp_path, child.pid, pod_cgroup(PAYMENTS_UID), start_ticks=1)
        with pytest.raises(CallerNotAttested) as info:
            attestor.pod_uid_of(caller(child.pid, pidfd=pidfd))
    finally:
        os.close(pidfd)
    assert info.value.reason == CALLER_EXITED
    assert "exited before the node agent finished inspecting it" in str(info.value)


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
