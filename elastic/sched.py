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

Idle work must not starve while a rank waits on it. `SCHED_IDLE` runs only
on a core nothing else wants; on a node whose cores another process keeps
busy it barely runs at all, and a rank that must wait for its snapshot's copy
or replica before its next optimizer step waited for seconds (two busy loops
on the 2 cores: the memory tier's step cost went from 1.04x to 7x on
`dp_shard=4`). So idle work runs on a `Background` thread, which a waiting
rank has lifted to `SCHED_BATCH` (`Background.hurry`) for a while (`Lift`).
Linux lets a thread leave `SCHED_IDLE` only with `CAP_SYS_NICE` or an
`RLIMIT_NICE` that allows nice 0 (`idle_is_reversible`); without either the
work stays on `SCHED_BATCH` from the start: never starved, at some cost on
an idle node.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor


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


@functools.cache
def idle_is_reversible() -> bool:
    """Whether a thread of this process may go from SCHED_IDLE back to SCHED_BATCH (tried on a thread of its own)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result = []

    def attempt() -> None:
        result.append(_set_policy(0, os.SCHED_IDLE) and _set_policy(0, os.SCHED_BATCH))

    probe = threading.Thread(target=attempt, name="sched-probe")
    probe.start()
    probe.join()
    return result[0]


def lift(tid: int) -> bool:
    """Put thread `tid` of this process on SCHED_BATCH (from SCHED_IDLE: `idle_is_reversible`)."""
    return hasattr(os, "SCHED_BATCH") and _set_policy(tid, os.SCHED_BATCH)


LIFT_MIN_S, LIFT_MAX_S = 1.0, 60.0


class Lift:
    """How long idle work stays lifted after a rank had to wait on it.

    A lift comes late (the agent's thread that takes the rank's request may
    first wait for the GIL, held by the idle thread it is to lift, which
    barely runs), and lifted work costs the ranks more on an idle node
    (`interleaved_1f1b`: 1.09x lifted all along against 1.03-1.05x). So a
    lift lasts `LIFT_MIN_S` (a wait at the start of a run, on an idle node),
    twice as long each time a wait comes back within a lift's length of the
    last one's end (lasting contention: one late snapshot a minute, not one
    a step), up to `LIFT_MAX_S`.
    """

    def __init__(self) -> None:
        self.until = 0.0  # time.monotonic()
        self.span = LIFT_MIN_S

    def renew(self) -> None:
        now = time.monotonic()
        self.span = min(2 * self.span, LIFT_MAX_S) if now < self.until + self.span else LIFT_MIN_S
        self.until = now + self.span

    def active(self) -> bool:
        return time.monotonic() < self.until

    def hurry(self, tids: list[int]) -> None:
        """A rank waits on the work of threads `tids` (of this process): lift them, and renew the lift."""
        if idle_is_reversible():
            self.renew()
            for tid in tids:
                lift(tid)

    def settle(self) -> None:
        """On a thread about to take on more work: back on SCHED_IDLE, unless lifted."""
        if not self.active():
            idle_this_thread()


class Background:
    """One thread for work that training must not feel and may have to wait for (see the module's docstring).

    Its tasks run on SCHED_IDLE (where `idle_is_reversible`); `hurry` lifts
    the thread to SCHED_BATCH for a while (`Lift`).
    """

    def __init__(self, name: str):
        self._tid: int | None = None
        self._lift = Lift()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._started)

    def _started(self) -> None:
        self._tid = threading.get_native_id()

    def _run(self, fn, args):
        self._lift.settle()
        return fn(*args)

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(self._run, fn, args)

    def hurry(self) -> None:
        if self._tid is not None:
            self._lift.hurry([self._tid])

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


def idle_this_thread() -> None:
    """Put the calling thread on SCHED_IDLE: it runs only on a core nothing else wants.

    For the node agent's memory-tier replication (a copy that training never
    waits on while a core is idle now and then): the memory tier's step cost on
    `hsdp 2x2` went from 1.23x to 1.01x, on `pp=2 gpipe` from 1.24x to 1.03x;
    and for its copies of the snapshots out of its CPU ranks' memory (in-run,
    `dp_shard=4` 1.02x against 1.06x written by the rank's own thread). Never
    for a thread of a rank process (see above). Only where the thread can be
    lifted back (`idle_is_reversible`), for a rank that waits on it.
    """
    if idle_is_reversible():
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
