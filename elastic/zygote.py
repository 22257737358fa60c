"""A node's fork server for rank processes: it imports the training stack once, then forks each new rank from itself.

A rank process that starts from nothing spends its first seconds importing
torch, DTensor and the training code and warming them up: 3.3 s of CPU on
this machine, paid again by every rank and spare a node starts, on the cores
the job trains on. The agent starts one zygote instead (a child of its
spawning thread, like a rank process, so it dies with the agent), which pays
that once; each rank process is then a fork of it, ready in milliseconds and
sharing its imported pages. A forked rank is a child of the zygote and dies
with it (its parent-death signal; the zygote runs one thread). An agent
whose zygote died starts another (`elastic.agent.ZYGOTE_RESTARTS` times at
most); one whose zygote could not start starts ranks afresh.

Only for ranks without a GPU: a fork is safe only from a process that never
initialised CUDA, and that has not been checked on a GPU node, so GPU ranks
start as fresh processes (`elastic.agent`).

A fork copies only the thread that called it: a lock another thread held
stays locked in the child for good. So the zygote keeps to one thread.
Torch's pools start in each rank, after its fork
(`elastic.rank_process._set_threads`); two libraries would start threads as
they load, and the zygote's environment turns them off: pyarrow's bundled
jemalloc its background purger (`JE_ARROW_MALLOC_CONF`; freed pages are then
returned by the threads that free them), and numpy's OpenBLAS its pool
(`OPENBLAS_NUM_THREADS=1` unless set; the ranks do their math in torch).
Should a thread be there even so, the zygote names it on stderr, in the
agent's log.

The agent's side of the pipe (`Zygote`), one message at a time:

    -> ("fork",), then the new rank's pipe end as a passed descriptor   <- ("forked", pid)
    -> ("reap", pid), once the rank's pipe has closed                    <- ("exited", pid, returncode)

The zygote reaps a rank only when asked: until then its pid is held (a
zombie's at worst), so the agent's kill can never reach another process.
`returncode` is Popen's: the exit code, or minus the signal that killed it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import traceback
from multiprocessing import Pipe, reduction
from multiprocessing.connection import Connection

from elastic.messages import Ready, StartFailed

PROCESS_NAME = "elastic-zygote"
"""What the fork server calls itself (its `comm`); the ranks it forks rename themselves (`elastic.rank_process.PROCESS_NAME`)."""
REAP_POLL_S = 0.02
"""How often the zygote looks again for a rank it was asked to reap that has closed its pipe but not yet exited."""


def main() -> None:
    """`python -m elastic.zygote FD PARENT_PID`: import and warm up the training stack, then fork ranks on request."""
    from elastic import rank_process

    rank_process.die_with(int(sys.argv[2]))
    rank_process.name_this_process(PROCESS_NAME)
    conn = Connection(int(sys.argv[1]))
    try:
        rank_process.import_training()
    except BaseException:
        conn.send(StartFailed(traceback.format_exc()))
        raise
    if len(threads := _thread_names()) > 1:
        print(f"elastic: the rank fork server forks with {len(threads)} threads ({', '.join(threads)}); a lock one of "
              "them holds at a fork stays held in that rank", file=sys.stderr, flush=True)
    conn.send(Ready(os.getpid()))
    _serve(conn)


def _thread_names() -> list[str]:
    """This process's threads' names (Linux; elsewhere none are listed)."""
    names = []
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # ended meanwhile
    return sorted(names)


def _serve(conn: Connection) -> None:
    from elastic import rank_process

    asked: set[int] = set()  # ranks to reap once they exit
    while True:
        for pid in list(asked):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                asked.discard(pid)
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
        if not conn.poll(REAP_POLL_S if asked else None):
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the agent is gone: its parent-death signal will take the ranks
        if message[0] == "reap":
            asked.add(message[1])
            continue
        fd = reduction.recv_handle(conn)
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            conn.close()
            rank_process.serve_forked(Connection(fd), zygote)  # never returns
        os.close(fd)
        conn.send(("forked", pid))


class ForkedRank:
    """A rank process forked by the node's zygote, with the part of `subprocess.Popen` the agent uses."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int:
        """Once its pipe has closed: its exit code (minus the signal that killed it)."""
        if self.returncode is None:
            self.returncode = self._zygote.reap(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)  # not reaped yet: the pid is still this process's


class Zygote:
    """The agent's end: start the zygote and wait until it is ready (on the agent's spawning thread), then fork ranks."""

    def __init__(self, env: dict, timeout_s: float):
        one_thread = {  # see the module's docstring; in jemalloc's options the last setting wins over the user's
            "JE_ARROW_MALLOC_CONF": ",".join(filter(None, [env.get("JE_ARROW_MALLOC_CONF"), "background_thread:false"])),
            "OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", "1"),
        }
        ours, theirs = Pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "elastic.zygote", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env={**env, **one_thread}, cwd=os.getcwd(),
            )
        finally:
            theirs.close()
        self._conn = ours
        if not ours.poll(timeout_s):
            self.proc.kill()
            raise TimeoutError(f"the rank fork server did not start within {timeout_s}s")
        answer = ours.recv()
        if not isinstance(answer, Ready):
            raise RuntimeError(f"the rank fork server could not start: {answer.error}")
        self._send_lock = threading.Lock()
        self._forked: list[int] = []  # a fork's answer, for the spawning thread (one fork at a time)
        self._exited: dict[int, int] = {}
        self._changed = threading.Condition()
        self.alive = True
        threading.Thread(target=self._read, name="zygote-read", daemon=True).start()

    def fork(self) -> tuple[ForkedRank, Connection]:
        """A new rank process and the agent's end of its pipe; raises OSError if the zygote is gone."""
        ours, theirs = Pipe()
        try:
            with self._send_lock:
                self._conn.send(("fork",))
                reduction.send_handle(self._conn, theirs.fileno(), self.proc.pid)
            with self._changed:
                self._changed.wait_for(lambda: self._forked or not self.alive)
                if not self._forked:
                    raise OSError("the rank fork server is gone")
                pid = self._forked.pop()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ForkedRank(pid, self), ours

    def reap(self, pid: int) -> int:
        try:
            with self._send_lock:
                self._conn.send(("reap", pid))
        except OSError:
            pass  # gone: see below
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exited or not self.alive)
            # A zygote that died took its ranks with it (their parent-death signal is SIGKILL).
            return self._exited.pop(pid, -signal.SIGKILL)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._changed:
                if message[0] == "forked":
                    self._forked.append(message[1])
                else:
                    self._exited[message[1]] = message[2]
                self._changed.notify_all()
        with self._changed:
            self.alive = False
            self._changed.notify_all()


if __name__ == "__main__":
    main()
