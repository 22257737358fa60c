"""elastic.sched: what starts in the batch block inherits SCHED_BATCH; a training thread goes back to normal;
background work is idle until a waiting rank lifts it, and never idle where it could not be lifted."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import elastic.sched
from elastic.sched import Background, Lift, batch_this_process, batch_what_starts_here, idle_is_reversible, normal_this_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


def _policy_of_new_thread(body=lambda: None) -> int:
    seen = []

    def run():
        body()
        seen.append(os.sched_getscheduler(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


def test_threads_started_in_the_block_are_batch_and_the_caller_is_restored():
    before = os.sched_getscheduler(0)
    with batch_what_starts_here():
        assert _policy_of_new_thread() == os.SCHED_BATCH
        assert _policy_of_new_thread(normal_this_thread) == os.SCHED_OTHER  # a training thread's first step
    assert os.sched_getscheduler(0) == before
    assert _policy_of_new_thread() == before


def test_a_worker_process_puts_every_thread_on_batch_except_what_it_sets_back():
    def child(q):
        batch_this_process()
        q.put((os.sched_getscheduler(0), _policy_of_new_thread(), _policy_of_new_thread(normal_this_thread)))

    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    got = q.get(timeout=30)
    p.join()
    assert got == (os.SCHED_BATCH, os.SCHED_BATCH, os.SCHED_OTHER)


def _background_policies(bg, hurry: bool) -> list[int]:
    """A Background task's policy when it starts and after `hurry` (or none) while it runs."""
    started, go, seen = threading.Event(), threading.Event(), []

    def task():
        seen.append(os.sched_getscheduler(0))
        started.set()
        go.wait(30)
        seen.append(os.sched_getscheduler(0))

    done = bg.submit(task)
    assert started.wait(30)
    if hurry:
        bg.hurry()
    go.set()
    done.result(timeout=30)
    return seen


@pytest.mark.skipif(not idle_is_reversible(), reason="this process may not lift a thread off SCHED_IDLE")
def test_background_work_is_idle_until_a_hurry_lifts_it_for_a_while(monkeypatch):
    # A rank waiting on the agent's idle copy (or replica) lifts it to SCHED_BATCH: idle work on a node whose cores
    # another process keeps busy would hardly ever run. The lift holds for a while, then the work is idle again.
    monkeypatch.setattr(elastic.sched, "LIFT_MIN_S", 1.0)
    bg = Background("test-bg")
    try:
        assert _background_policies(bg, hurry=False) == [os.SCHED_IDLE, os.SCHED_IDLE]
        assert _background_policies(bg, hurry=True) == [os.SCHED_IDLE, os.SCHED_BATCH]
        assert _background_policies(bg, hurry=False) == [os.SCHED_BATCH, os.SCHED_BATCH]
        time.sleep(1.1)
        assert _background_policies(bg, hurry=False) == [os.SCHED_IDLE, os.SCHED_IDLE]
    finally:
        bg.shutdown()


def test_a_lift_lasts_longer_while_waits_keep_coming_and_short_again_after_a_quiet_spell(monkeypatch):
    monkeypatch.setattr(elastic.sched, "LIFT_MIN_S", 0.2)
    monkeypatch.setattr(elastic.sched, "LIFT_MAX_S", 0.8)
    lift = Lift()
    assert not lift.active()
    spans = []
    for _ in range(4):  # each wait comes while lifted: lasting contention
        lift.renew()
        spans.append(lift.span)
    assert spans == [0.2, 0.4, 0.8, 0.8] and lift.active()
    time.sleep(0.9)  # past the lift's end, but within a lift's length of it: the wait came back soon
    assert not lift.active()
    lift.renew()
    assert lift.span == 0.8
    time.sleep(1.7)  # a quiet spell longer than a lift
    lift.renew()
    assert lift.span == 0.2


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to an unprivileged user")
def test_a_process_that_may_not_leave_idle_never_puts_background_work_there():
    # Without CAP_SYS_NICE and with RLIMIT_NICE 0 (an ordinary user's default) a thread cannot leave SCHED_IDLE:
    # the work stays on the policy it starts with (the agent's SCHED_BATCH), so no rank ever waits on starved work.
    code = """
import os, resource, sys
sys.path.insert(0, sys.argv[1])
import elastic.sched
from elastic.sched import Background, idle_is_reversible  # before the drop: the interpreter may live under /root
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
os.setgid(65534); os.setuid(65534)
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
bg = Background("unprivileged")
print(idle_is_reversible(), bg.submit(os.sched_getscheduler, 0).result(), os.SCHED_BATCH)
bg.shutdown()
"""
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code, str(repo)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    reversible, policy, batch = done.stdout.split()
    assert reversible == "False" and policy == batch
