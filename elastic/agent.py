"""The node agent: one Ray actor per node, which runs the node's ranks as child processes.

Ray places and supervises the agent; the ranks themselves are plain Python
processes (`elastic.rank_process`), the way torchelastic's agent runs its
workers. One Ray worker per node instead of one per rank: on a 2-core
machine, eight Ray workers' timers, RPC and io threads took CPU from eight
ranks in lockstep (see `bench/README.md`), and a rank process that runs no
Ray code has none of them.

The agent reserves the node's whole worker capacity in Ray's accounting (the
CPUs and GPUs of every slot), gives each child its own GPU, and relays the
controller's calls:

- `prepare` makes sure enough warm children are up (torch and the training
  code imported), `start` hands each one its rank of the new generation;
- `poll(generation, wait_s)` is a long poll over all the node's ranks: it
  answers when a child pushes records or ends, or dies (its pipe closes, so a
  killed rank is seen within milliseconds), and otherwise after `wait_s`;
- `stacks`, `stop_after` and `teardown` reach every rank on the node.

A child whose generation ended cleanly stays up, idle, for the next one; one
spare per node (CPU jobs) is started ahead so that a rank that dies is
replaced by a process that is already up. Children exit when the agent goes
away (their pipe closes), so a node that dies takes its ranks with it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import ray

from elastic.sched import batch_this_process

ROOT = Path(__file__).resolve().parent.parent
GATHER_S = 0.02
"""Once a rank's step records wake a poll, how long the agent waits for its other ranks' before it answers."""


@dataclass
class _Child:
    proc: subprocess.Popen
    conn: Connection
    gpus: list[str]
    rank: int | None = None  # None: idle (a spare, or kept warm from an ended generation)
    ready: threading.Event = field(default_factory=threading.Event)
    failed: str | None = None  # why it could not start (its traceback)
    exit: str | None = None  # set once the process is gone
    state: dict | None = None  # the last state it pushed (see elastic.rank_process)
    records: list = field(default_factory=list)  # records not yet polled, of generation `records_gen`
    records_gen: int = -1
    replies: queue.Queue = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one command at a time


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank process killed by {signal.Signals(-code).name}"
    return f"rank process exited with code {code}"


@ray.remote(max_restarts=0, max_concurrency=8)
class NodeAgent:
    def __init__(self, cpus_per_rank: float, gpus_per_rank: float, working_dir: str = ""):
        batch_this_process()  # the agent's threads never preempt a rank's training thread (elastic.sched); children inherit it
        self._omp_threads = str(max(1, int(cpus_per_rank)))  # what Ray gives a worker with these CPUs
        self._gpus_per_rank = int(gpus_per_rank)
        self._gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        # The job's working directory: where the driver imports the model's builder from. Ranks start in this actor's
        # directory (on a `ray job submit --working-dir` cluster, that node's copy of it), which `python -m` puts first
        # on their import path; the driver's directory follows, where this node has it (an embedded cluster, a shared disk).
        self._import_dirs = [str(ROOT)] + ([working_dir] if working_dir and os.path.isdir(working_dir) else [])
        self._children: list[_Child] = []
        self._changed = threading.Event()  # a child pushed records, ended, or died: wake the waiting poll
        self._records_lock = threading.Lock()  # a push's records and a poll's draining never interleave

    def info(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": self._gpu_ids}

    # -- children ----------------------------------------------------------------------
    def _spawn(self) -> _Child:
        taken = {g for c in self._children for g in c.gpus}
        gpus = [g for g in self._gpu_ids if g not in taken][: self._gpus_per_rank]
        env = dict(os.environ, OMP_NUM_THREADS=self._omp_threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*self._import_dirs, env.get("PYTHONPATH")]))
        if self._gpus_per_rank:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        ours, theirs = Pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic.rank_process", str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env, cwd=os.getcwd()
        )
        theirs.close()
        child = _Child(proc, ours, gpus)
        self._children.append(child)
        threading.Thread(target=self._read, args=(child,), name=f"read-{proc.pid}", daemon=True).start()
        return child

    def _read(self, c: _Child) -> None:
        """Everything a child sends: readiness, pushed state, command replies; and its end."""
        while True:
            try:
                kind, body = c.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "state":
                records = body.pop("records")
                with self._records_lock:
                    if body["generation"] != c.records_gen:
                        c.records, c.records_gen = [], body["generation"]
                    c.records.extend(records)
                    c.state = body
                if records or body["finished"] or body["error"]:
                    self._changed.set()
            elif kind == "reply":
                c.replies.put(body)
            elif kind == "ready":
                c.ready.set()
            elif kind == "failed":
                c.failed = body
        c.exit = _describe_exit(c.proc.wait())
        c.ready.set()
        c.replies.put(None)  # whoever waits on a reply learns at once that none will come
        self._changed.set()

    def _ask(self, children: list[_Child], command: str, *args, timeout_s: float) -> list:
        """Send `command` to each child, then collect the answers (None: no answer in time, or it died)."""
        asked = []
        for c in children:
            c.lock.acquire()
            try:
                if c.exit is not None:
                    raise OSError("the rank process is gone")
                c.conn.send((command, args))
                asked.append(c)
            except (OSError, ValueError):
                c.lock.release()
        deadline = time.monotonic() + timeout_s
        answers = {}
        try:
            for c in asked:
                try:
                    reply = c.replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    reply = None
                answers[id(c)] = reply[0] if reply is not None and reply[1] is None else None
        finally:
            for c in asked:
                while not c.replies.empty():  # a late answer must not be taken for the next command's
                    c.replies.get_nowait()
                c.lock.release()
        return [answers.get(id(c)) for c in children]

    def _kill(self, children: list[_Child]) -> None:
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
            if c in self._children:
                self._children.remove(c)

    def _assign(self, c: _Child, rank: int | None, generation: int) -> None:
        """Give `c` a rank of `generation` (None, -1: idle), forgetting what it reported before."""
        with self._records_lock:
            c.rank, c.state, c.records, c.records_gen = rank, None, [], generation

    def _ranks(self) -> list[_Child]:
        return sorted((c for c in self._children if c.rank is not None), key=lambda c: c.rank)

    # -- the controller's calls --------------------------------------------------------
    def prepare(self, n: int, keep_idle: int, timeout_s: float, spare: bool = False) -> list[int]:
        """Have `n` idle children up and ready (warm ones first), plus up to `keep_idle` more; kill the rest.

        With `spare`, also start one more now (not waited for), so that its
        start-up overlaps the others'. Returns the pids of the `n`.
        """
        idle = [c for c in self._children if c.rank is None and c.exit is None]
        self._kill([c for c in self._children if c.exit is not None])
        while len(idle) < n + (1 if spare else 0):
            idle.append(self._spawn())
        self._kill(idle[n + keep_idle:])
        deadline = time.monotonic() + timeout_s
        for c in idle[:n]:
            if not c.ready.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a rank process did not start within {timeout_s}s")
            if c.failed or c.exit:
                raise RuntimeError(f"a rank process failed to start: {c.failed or c.exit}")
        return [c.proc.pid for c in idle[:n]]

    def start(self, assignments: list[tuple[int, dict]], store_host: str, store_port: int, timeout_s: float) -> dict[int, int]:
        """Give each ready idle child its rank and spec; return {rank: pid}."""
        idle = [c for c in self._children if c.rank is None and c.exit is None and c.ready.is_set()]
        pairs = list(zip(idle, assignments))
        for c, (rank, spec) in pairs:
            self._assign(c, rank, spec["generation"])
        for c, (_, spec) in pairs:
            self._ask([c], "start", spec, store_host, store_port, timeout_s, timeout_s=30.0)
        return {rank: c.proc.pid for c, (rank, _) in pairs}

    def spare(self) -> None:
        """Start one idle child if there is none (not waited for: it comes up while the ranks train)."""
        if not any(c.rank is None and c.exit is None for c in self._children):
            self._spawn()

    @ray.method(enable_task_events=False)  # about one call a second: not worth a record in the GCS each
    def poll(self, generation: int, wait_s: float) -> dict[int, dict]:
        """{rank: {"alive", "error", "poll"}} for the node's ranks, after waiting up to `wait_s` for news."""
        def ended() -> bool:
            return any(c.exit or (c.state and (c.state["finished"] or c.state["error"])) for c in self._ranks())

        if wait_s > 0 and not ended() and self._changed.wait(wait_s) and not ended():
            time.sleep(GATHER_S)  # ranks in lockstep push within moments of each other: one answer for all of them
        self._changed.clear()  # before draining: a push after this wakes the next poll
        now = time.time()
        out = {}
        for c in self._ranks():
            if c.exit is not None:
                out[c.rank] = {"alive": False, "error": c.exit}
                continue
            s = c.state or {"generation": generation, "step": -1, "phase": "start", "phase_since": now, "finished": False, "error": None}
            records = []
            with self._records_lock:
                if c.records_gen == generation:
                    records, c.records = c.records, []
            out[c.rank] = {"alive": True, "poll": {**s, "phase_s": now - s["phase_since"], "records": records}}
        return out

    def stop_after(self, step: int) -> None:
        self._ask(self._ranks(), "stop_after", step, timeout_s=10.0)

    def stacks(self, timeout_s: float) -> dict[int, str]:
        ranks = self._ranks()
        return {c.rank: s if s is not None else "<no stack: no answer>" for c, s in zip(ranks, self._ask(ranks, "stacks", timeout_s=timeout_s))}

    def teardown(self, kill_ranks: list[int], grace_s: float) -> int:
        """End the generation here: kill `kill_ranks`, reset the others (kill any still stuck); how many stay warm."""
        self._kill([c for c in self._ranks() if c.rank in set(kill_ranks)])
        rest = self._ranks()
        kept = 0
        for c, ok in zip(rest, self._ask(rest, "reset", grace_s, timeout_s=grace_s + 0.5)):
            if ok:
                self._assign(c, None, -1)
                kept += 1
            else:
                self._kill([c])
        return kept

    def shutdown(self) -> None:
        self._kill(list(self._children))
