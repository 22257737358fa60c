"""elastic.sched: what starts in the batch block inherits SCHED_BATCH; a training thread goes back to normal."""

import os
import threading

import pytest

from elastic.sched import batch_this_process, batch_what_starts_here, normal_this_thread

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
