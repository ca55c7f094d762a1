"""The CA's threads under Linux's SCHED_BATCH scheduling policy (`--cpu-scheduling batch`).

Why: a CA worker is CPU-bound, and gRPC wakes its own helper threads (the completion-queue
poller, the event-engine threads) several times per request. Under the default policy each of
those wake-ups preempts the thread that is verifying and signing: about five involuntary
context switches per certificate, each leaving that thread's caches cold, so the same CSR
check and leaf signature cost twice as much inside the server as in a loop. SCHED_BATCH tells
the kernel these threads are CPU-bound: a woken thread waits until the running one blocks or
its time slice ends, instead of preempting it. The CPU share is unchanged (same nice level),
no privilege is needed, and other processes on the node are preempted less, not more.
Measured with `bench/stack_ceiling.py --compare-normal` (docs/performance.md): 5 % more
certificates per second with 2 workers (7-11 % in `bench/vs_cfssl.py` A/B runs), and a lower
p99.

Set once, first thing in `meshca ca`, before gRPC starts a thread: threads inherit their
creator's policy, and worker processes inherit the supervisor's. Where the call is missing
(not Linux) or refused (a seccomp profile), the CA runs under the default policy and says so.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

CPU_SCHEDULING_CHOICES = ("batch", "normal")


def apply_cpu_scheduling(choice: str) -> bool:
    """Puts the calling thread (and the threads and processes it starts later) under the
    policy `choice` names; True when that policy is now in force."""
    if choice not in CPU_SCHEDULING_CHOICES:
        raise ValueError(f"unknown CPU scheduling {choice!r}; use one of {CPU_SCHEDULING_CHOICES}")
    policy_name = "SCHED_BATCH" if choice == "batch" else "SCHED_OTHER"
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, policy_name, None)
    if setter is None or policy is None:
        log.info("--cpu-scheduling %s: not available on this system; left as it is", choice)
        return False
    try:
        setter(0, policy, os.sched_param(0))
    except OSError as exc:
        log.warning(
            "--cpu-scheduling %s refused (%s); running under the policy meshca started with",
            choice,
            exc.strerror,
        )
        return False
    return True
