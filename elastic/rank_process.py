"""One rank's process: started by its node's agent (`elastic.agent`), trains in a thread, talks to the agent over a pipe.

Started afresh (`main`), or forked from the node's fork server (`serve_forked`,
`elastic.zygote`); either way it calls itself `PROCESS_NAME`.

A rank is a plain Python process, not a Ray worker: it runs none of Ray's
threads or timers (on a small machine, each Ray worker's wake-ups are CPU
taken from training), and it never outlives its agent: the kernel kills it
when the agent's thread that started it ends (a parent-death signal, set
before anything else), whatever its own threads are doing; and it exits when
the pipe closes.

Three threads:
- the main thread serves the agent's commands (`elastic.messages`: start,
  stop after a step, dump stacks, reset) one at a time, answering each with
  its request's id;
- the training thread (`train-g<generation>-r<rank>`) joins the generation's
  process group and runs `elastic.train.Trainer`; a stack dump reports it
  apart from the other threads, for the controller's hang diagnosis. It
  outlives its generation (`_TrainingThread`) while the next one gives this
  process the same rank of the same layout;
- the reporter pushes the rank's progress (step, phase, new records, the
  loop's end) to the agent: at once for a save, an error or the end, in
  batches of step records every `elastic.train.STEP_REPORT_S`, and at least
  every `REPORT_EVERY_S` while a generation runs, so that the agent always
  has a recent phase to report.

A process outlives its generation when it can: `reset` stops the loop and
drops the process group, and the next generation reuses it warm (no new
process, no imports). A loop still inside a collective after the grace
period has its collectives aborted (`_abort_collectives`), which makes it
return; one still stuck after that answers False and is killed by its agent.

Nothing at module level imports torch: `main` sets the thread and device
environment first.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import itertools
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from datetime import timedelta
from multiprocessing.connection import Connection

from elastic.messages import (
    ABORT_JOIN_S, Copied, CopyOut, DumpStacks, Hurry, Pull, Pulled, RankState, Ready, Replicated, Reply, Request, Reset, StackDump,
    Start, StartFailed, StopAfter,
)

REPORT_EVERY_S = 1.0
"""The longest a running rank goes without pushing its state: the phase the controller sees is at most this old."""


class _TrainingThread(threading.Thread):
    """The thread that runs this process's generations while they give it the same seat (layout, rank, device).

    A generation's first step costs far more in a new thread than in one that
    has run the same step before: at 8 gloo ranks on 2 cores, 1.05 s in a new
    thread against 0.35 s in the old one after `destroy_process_group` and a
    new group (steady steps 0.19 s; bench/README.md). What DTensor keeps per
    thread stays valid because a later generation in the same seat asks the
    same questions of meshes equal to the old ones (a DeviceMesh compares by
    layout; its groups are looked up by name, and torch names them afresh, in
    the same order). A generation in another seat gets a new thread: a mesh
    of the same shape with this process at another coordinate compares equal
    too, so nothing kept for the old seat is trusted there.
    """

    def __init__(self, seat: tuple):
        super().__init__(name="train", daemon=True)
        self.seat = seat
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # (function, args, done) or None: end
        self.start()

    def run_generation(self, done: threading.Event, main, *args) -> None:
        """Run `main(*args)` in this thread, then set `done`."""
        self._work.put((main, args, done))

    def retire(self) -> None:
        """End the thread once its current generation (already stopped by `reset`) has returned."""
        self._work.put(None)

    def run(self) -> None:
        from elastic.sched import normal_this_thread

        normal_this_thread()  # started by the command thread, which is on SCHED_BATCH
        while (item := self._work.get()) is not None:
            main, args, done = item
            try:
                main(*args)
            finally:
                done.set()


class RankRuntime:
    """The rank's side of one generation at a time; methods are the agent's commands."""

    def __init__(self, send):
        self._send = send  # thread-safe: (message) -> None
        self._commands = {Start: self.start, StopAfter: self.stop_after, DumpStacks: self.stacks, Reset: self.reset}
        self._wake = threading.Event()  # a record, the end of the loop, or a new generation: push now
        self._thread: _TrainingThread | None = None
        self._done: threading.Event | None = None  # set when the current generation's loop has returned
        self._control = None
        self._progress = None
        self._error: str | None = None
        self._finished = False
        self._generation = -1
        self._lock = threading.Lock()  # a push and a reset never interleave
        self._pulls: dict[int, list] = {}  # Pull id -> [answered Event, Pulled or None]
        self._copies: dict[tuple[int, int], Future] = {}  # (generation, step) of a CopyOut -> its Copied, once answered
        self._pull_ids = itertools.count()
        threading.Thread(target=self._report, name="reporter", daemon=True).start()

    # -- commands ------------------------------------------------------------------
    def serve(self, command):
        """Carry out one of the agent's commands; what it returns is the reply's value."""
        return self._commands[type(command)](command)

    def start(self, command: Start) -> None:
        """Join the generation's process group and train in a background thread."""
        from elastic.train import Control, Progress, RankSpec

        spec = RankSpec(**command.spec)
        with self._lock:
            self._generation = spec.generation
            self._control = Control(pull=self.pull, copy_out=self.copy_out, hurry=self.hurry)
            self._progress = Progress()
            self._progress.changed = self._wake  # every record wakes the reporter
            self._error, self._finished = None, False
        self._done = threading.Event()
        seat = (tuple(sorted(spec.layout.items())), spec.rank, spec.device)
        if self._thread is None or self._thread.seat != seat:
            if self._thread is not None:
                self._thread.retire()
            self._thread = _TrainingThread(seat)
        self._thread.name = f"train-g{spec.generation}-r{spec.rank}"
        self._thread.run_generation(self._done, self._main, spec, command.store_host, command.store_port, command.timeout_s)
        self._wake.set()

    def replicated(self, message: Replicated) -> None:
        """The agent's acknowledgement of a memory snapshot's replica: the loop may step past it."""
        with self._lock:
            control = self._control if message.generation == self._generation else None
        if control is not None:
            control.replicated.ack(message.step)

    def pull(self, ranges: dict[str, list[tuple[int, int]]]) -> tuple[list[str], int]:
        """Ask the agent for these byte ranges of the staged memory step (`elastic.train.Control.pull`); wait for its
        answer, or the generation's stop."""
        pull_id, waiting = next(self._pull_ids), [threading.Event(), None]
        self._pulls[pull_id] = waiting
        try:
            self._send(Pull(pull_id, ranges))
            control = self._control
            while not waiting[0].wait(0.5):
                if control is None or control.stop.is_set():
                    raise RuntimeError("the generation stopped while its agent pulled the memory step's files")
        finally:
            self._pulls.pop(pull_id, None)
        answer: Pulled = waiting[1]
        if answer.error is not None:
            raise RuntimeError(f"the node agent could not pull what this rank reads of the memory step: {answer.error}")
        return list(answer.fetched), answer.nbytes

    def copy_out(self, message: CopyOut) -> Future:
        """Have the agent copy a memory snapshot out of this process (`elastic.train.Control.copy_out`); the future
        of its `Copied`. No timeout: the tensors it reads must not change or go before it answers, and the agent
        always answers (where it dies, this process ends with it)."""
        answer: Future = Future()
        self._copies[(message.generation, message.step)] = answer
        self._send(message)
        return answer

    def copied(self, message: Copied) -> None:
        answer = self._copies.pop((message.generation, message.step), None)
        if answer is not None:
            answer.set_result(message)

    def hurry(self, step: int) -> None:
        self._send(Hurry(self._generation, step))

    def pulled(self, message: Pulled) -> None:
        waiting = self._pulls.get(message.id)
        if waiting is not None:
            waiting[1] = message
            waiting[0].set()

    def stop_after(self, command: StopAfter) -> None:
        if self._control is not None:
            self._control.stop_at = command.step

    def stacks(self, _: DumpStacks) -> StackDump:
        """The Python stack of every thread of this process, the training thread's apart."""
        frames = sys._current_frames()
        training, others = None, []
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if frame is None:
                continue
            stack = "".join(traceback.format_stack(frame))
            if thread is self._thread:
                training = stack
            else:
                others.append(f"--- thread {thread.name}\n{stack}")
        return StackDump(training, "\n".join(others))

    def reset(self, command: Reset) -> bool:
        """End this generation here: stop the loop, drop the process group. False if the loop is stuck."""
        import torch.distributed as dist

        if self._control is not None:
            self._control.stop.set()
            self._control.replicated.release()
        if self._done is not None:
            self._done.wait(command.grace_s)
            if not self._done.is_set() and _abort_collectives():
                self._done.wait(ABORT_JOIN_S)  # its collective now fails instead of waiting for a dead peer
            if not self._done.is_set():
                return False
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is what we are leaving behind
                return False
        with self._lock:
            self._done = self._control = self._progress = None
            self._error, self._finished, self._generation = None, False, -1
        gc.collect()  # the old model still holds the old groups; freeing them closes their connections, releasing peers
        return True

    # -- the training thread ------------------------------------------------------------
    def _main(self, spec, store_host: str, store_port: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        from elastic.train import Trainer

        try:
            store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
            gen_store = dist.PrefixStore(f"gen{spec.generation}", store)
            if spec.device == "cuda":
                torch.cuda.set_device(0)  # the agent set CUDA_VISIBLE_DEVICES to this rank's GPU
            backend = "nccl" if spec.device == "cuda" else "gloo"
            world = 1
            for v in spec.layout.values():
                world *= v
            dist.init_process_group(backend, store=gen_store, rank=spec.rank, world_size=world, timeout=timedelta(seconds=timeout_s))
            completed = Trainer(spec, self._progress, fault_store=store, control=self._control).run()
            if not self._control.stop.is_set():
                dist.barrier()
                dist.destroy_process_group()
            self._finished = completed
        except BaseException:  # reported to the controller through the agent
            self._error = traceback.format_exc()
        finally:
            self._wake.set()  # the end is pushed at once

    # -- the reporter ---------------------------------------------------------------------
    def _state(self) -> RankState:
        p = self._progress
        return RankState(
            generation=self._generation,
            step=p.step if p else -1,
            phase=p.phase if p else "idle",
            phase_since=p.phase_since if p else time.time(),
            records=p.drain() if p else [],
            finished=self._finished,
            error=self._error,
        )

    def _report(self) -> None:
        while True:
            self._wake.wait(REPORT_EVERY_S if self._progress is not None else None)
            self._wake.clear()  # before draining: a record added after this wakes the next push
            with self._lock:
                state = self._state()
            self._send(state)


def _abort_collectives() -> bool:
    """Make a training thread blocked in a collective with a dead or stuck peer return (with an error), so that the
    process can be reset and kept instead of killed; False when there is no process group.

    NCCL: abort its communicators. gloo: its `abort` leaves a pending collective waiting (torch 2.13), so this shuts
    down the process's connected TCP sockets instead. They are gloo's pairs and the ending generation's store client
    (a durable save in flight to an object store would fail too: a generation that ends no longer commits it). The
    pending op then fails with "connection closed", as do the peers' ops that wait on this rank, releasing them in
    turn. Listening sockets stay: gloo aborts the process when its listener's accept fails.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        return True
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket (or closed since the listing)
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected
        finally:
            sock.detach()  # the descriptor stays gloo's to close
    return True


def _warm_up() -> None:
    """Pay now what a process's first generation would pay on the recovery path: a model's first initialisation on
    the meta device imports torch's decompositions and dynamo (1.1 s on this machine, bench/README.md)."""
    import torch

    with torch.device("meta"):
        torch.nn.Sequential(torch.nn.Embedding(2, 2), torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    # What is imported stays for the process's life: the collection at each reset need not scan it (0.3 s otherwise).
    gc.freeze()


def _serve(conn: Connection) -> None:
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    runtime = RankRuntime(send)
    send(Ready(os.getpid()))
    while True:
        try:
            request: Request | Replicated | Pulled | Copied = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the agent is gone: so is this rank
        if isinstance(request, Replicated):  # unasked: no reply
            runtime.replicated(request)
            continue
        if isinstance(request, Pulled):  # the answer to the rank's own Pull
            runtime.pulled(request)
            continue
        if isinstance(request, Copied):  # the answer to the rank's own CopyOut
            runtime.copied(request)
            continue
        try:
            reply = Reply(request.id, runtime.serve(request.command))
        except Exception:  # noqa: BLE001 - answered, so the agent is never left waiting
            reply = Reply(request.id, error=traceback.format_exc())
        send(reply)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NAME = 15
PROCESS_NAME = "elastic-rank"
"""What a rank process calls itself (its `comm`, as `ps` and /proc/PID/stat show it), however it was started."""


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent's spawning thread ends; exit now if that already happened.

    The pipe's end-of-file reaches only a main thread that is reading it, and
    one busy in a command (a reset waiting out its grace period) or still
    importing torch would outlive its agent, holding its GPU. The signal
    fires whatever the process is doing. Checked after it is set: a parent
    that died before has already handed us to another process.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(0)


def name_this_process(name: str) -> None:
    """Set this process's `comm` (at most 15 bytes): a forked rank's command line is its fork server's."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def import_training() -> None:
    """Import and warm up everything a generation needs, while the process is a spare, not on the recovery path.

    It starts no thread: the node's fork server (`elastic.zygote`) runs it
    before it forks ranks, and each rank sets its torch threads itself
    (`_set_threads`), after its start or its fork.
    """
    import elastic.train  # noqa: F401  (torch, DTensor and the strategies with it)

    _warm_up()


def _set_threads() -> None:
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("ELASTIC_TORCH_THREADS", "1"))))


def _become_rank(parent: int) -> None:
    """What every rank process does first, however it was started."""
    die_with(parent)
    name_this_process(PROCESS_NAME)
    faulthandler.enable()  # a crash prints every thread's Python stack into the agent's log


def serve_forked(conn: Connection, parent: int) -> None:
    """A rank process forked from its node's fork server (`elastic.zygote`), which imported everything: serve the agent."""
    _become_rank(parent)
    _set_threads()  # a fork inherits no thread pool
    _serve(conn)


def main() -> None:
    """`python -m elastic.rank_process FD PARENT_PID`: serve the agent (PARENT_PID) on the inherited pipe end FD."""
    _become_rank(int(sys.argv[2]))
    conn = Connection(int(sys.argv[1]))
    try:
        import_training()
        _set_threads()
    except BaseException:
        conn.send(StartFailed(traceback.format_exc()))
        raise
    _serve(conn)


if __name__ == "__main__":
    main()
