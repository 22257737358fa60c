"""The rank fork server (elastic.zygote): forked ranks are ready at once, are named as ranks, report how they ended,
and die with their fork server; a dead fork server refuses to fork, so the agent starts ranks afresh."""

import os
import signal
from pathlib import Path

import pytest

from elastic.messages import Ready
from elastic.rank_process import PROCESS_NAME
from elastic.zygote import PROCESS_NAME as ZYGOTE_NAME, Zygote

pytestmark = pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")


def _comm_and_parent(pid: int) -> tuple[str, int]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.index("(") + 1 : text.rindex(")")], int(text.rsplit(")", 1)[1].split()[1])


@pytest.fixture
def zygote():
    # More than one torch thread asked for: the ranks' pools start after their fork, never in the fork server.
    z = Zygote(dict(os.environ, ELASTIC_TORCH_THREADS="2", OMP_NUM_THREADS="2"), 120.0)
    yield z
    z.proc.kill()
    z.proc.wait()


def test_the_fork_server_forks_from_one_thread(zygote):
    # A fork copies only the forking thread; a lock another thread (pyarrow's jemalloc purger, a torch pool) held at
    # that moment would stay held in the rank for good.
    threads = [Path(f"/proc/{zygote.proc.pid}/task/{tid}/comm").read_text().strip() for tid in os.listdir(f"/proc/{zygote.proc.pid}/task")]
    assert threads == [ZYGOTE_NAME]
    rank, conn = zygote.fork()
    assert isinstance(conn.recv(), Ready)
    conn.close()
    assert rank.wait() == 0


def test_forked_ranks_are_ready_at_once_named_as_ranks_and_report_how_they_ended(zygote):
    assert _comm_and_parent(zygote.proc.pid) == (ZYGOTE_NAME, os.getpid())
    killed, conn = zygote.fork()
    ready = conn.recv()
    assert isinstance(ready, Ready) and ready.pid == killed.pid
    # A fork, not a fresh process: the fork server's child, with its command line (no exec, no imports of its own).
    assert _comm_and_parent(killed.pid) == (PROCESS_NAME, zygote.proc.pid)
    assert Path(f"/proc/{killed.pid}/cmdline").read_bytes() == Path(f"/proc/{zygote.proc.pid}/cmdline").read_bytes()
    assert killed.poll() is None
    killed.kill()
    with pytest.raises(EOFError):
        conn.recv()
    assert killed.wait() == -signal.SIGKILL and killed.poll() == -signal.SIGKILL
    killed.kill()  # reaped: a no-op, never a signal to whatever process has the pid now

    left, conn = zygote.fork()
    assert isinstance(conn.recv(), Ready)
    conn.close()  # its agent is gone: the rank exits
    assert left.wait() == 0


def test_a_dead_fork_server_takes_its_ranks_with_it_and_forks_no_more(zygote):
    rank, conn = zygote.fork()
    assert isinstance(conn.recv(), Ready)
    os.kill(zygote.proc.pid, signal.SIGKILL)
    assert conn.poll(10), "a forked rank outlived its fork server"
    with pytest.raises(EOFError):
        conn.recv()
    assert rank.wait() == -signal.SIGKILL
    with pytest.raises(OSError):
        zygote.fork()
    assert not zygote.alive
