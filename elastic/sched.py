"""Keep the manager's own threads from preempting the training threads (Linux `SCHED_BATCH`).

Ray's threads wake up many times a second: each worker's 10 ms signal timer,
its RPC and poll threads, the raylet, the GCS, the agents, the driver's own
Ray threads. Under the default policy a waking thread preempts whatever runs
on its core, and on a machine whose cores the ranks keep busy that is a rank
in the middle of a step, which its peers then wait for at the next
collective. Under `SCHED_BATCH` a thread keeps its share of the CPU (same
nice value) but its wake-ups never preempt: it runs at the next scheduler
tick or on a core that goes idle. On the 8-rank layout on 2 cores the
training threads were preempted about 3,400 times a second, about 2,500 with
the job's other threads on `SCHED_BATCH` (plain torch.distributed ranks:
2,300-2,600); see `bench/README.md` for what it did to step times.

A rank's training thread and the threads it starts (gloo's, torch's) stay on
the normal policy, and so does its memory-snapshot writer (a GPU rank's): a
Python thread shares the training thread's GIL, and on `SCHED_IDLE` it was
descheduled while holding it whenever the cores were busy, stalling the
training thread behind it (the memory tier's step cost on `dp_shard=4`: 1.43x
on SCHED_IDLE, 1.03x on the normal policy). A CPU rank's snapshots are
therefore copied by its node agent (`storage.copy_out`), whose thread can be
idle. Where the policy cannot be set (not Linux, or a sandbox that forbids
it) nothing changes.
"""

from __future__ import annotations

import contextlib
import os


def _set_policy(tid: int, policy: int) -> bool:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except OSError:
        return False


def batch_this_process() -> None:
    """Put every current thread of this process on SCHED_BATCH; threads they start later inherit it."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    for tid in os.listdir("/proc/self/task"):
        _set_policy(int(tid), os.SCHED_BATCH)


def idle_this_thread() -> None:
    """Put the calling thread on SCHED_IDLE: it runs only on a core nothing else wants.

    For the node agent's memory-tier replication (a copy that training never
    waits on while a core is idle now and then): the memory tier's step cost on
    `hsdp 2x2` went from 1.23x to 1.01x, on `pp=2 gpipe` from 1.24x to 1.03x;
    and for its copies of the snapshots out of its CPU ranks' memory (in-run,
    `dp_shard=4` 1.02x against 1.06x written by the rank's own thread). Never
    for a thread of a rank process (see above).
    """
    if hasattr(os, "SCHED_IDLE"):
        _set_policy(0, os.SCHED_IDLE)


def normal_this_thread() -> None:
    """Put the calling thread back on the normal policy (a training thread started by a batch thread)."""
    if hasattr(os, "SCHED_OTHER"):
        _set_policy(0, os.SCHED_OTHER)


@contextlib.contextmanager
def batch_what_starts_here():
    """Processes and threads started in the block from this thread inherit SCHED_BATCH; this thread's policy is restored."""
    if not hasattr(os, "SCHED_BATCH"):
        yield
        return
    before = os.sched_getscheduler(0)
    changed = _set_policy(0, os.SCHED_BATCH)
    try:
        yield
    finally:
        if changed:
            _set_policy(0, before)
