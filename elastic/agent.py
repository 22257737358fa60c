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
  CPU ranks are forked from the node's fork server (`elastic.zygote`), which
  imported all that once, GPU ranks start afresh;
- `poll(generation, wait_s)` is a long poll over all the node's ranks: it
  answers when a child pushes records or ends, or dies (its pipe closes, so a
  killed rank is seen within milliseconds), and otherwise after `wait_s`;
- `stacks`, `stop_after` and `teardown` reach every rank on the node.

A child whose generation ended cleanly stays up, idle, for the next one; one
spare per node (CPU jobs) is started ahead so that a rank that dies is
replaced by a process that is already up. Children die with the agent: each
sets a parent-death signal, which the kernel sends when the thread that
forked it ends. So every child is forked by one thread that lives as long as
the agent (`_spawner`), never by the thread of whichever call asked for it:
Ray runs the agent's calls on a pool of threads whose lives are Ray's to
decide.

Ray runs up to eight of the agent's calls at once (a long poll waits while
the controller asks for stacks or a teardown), and each child's reader thread
updates what the child reported. One lock (`_lock`) guards the list of
children and what is known of each (its rank, state, records); it is held
only to look and to change, never while waiting on a child, so a poll is
never held up by a slow command. Commands to a child go one at a time (the
child's own `lock`), each with an id its reply must match.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import ray

from storage.catalog import commit
from storage.copy_out import CopyRefused
from storage.format import data_file, encode_index
from storage.fs import FileMaps
from elastic.memory import NodeMemory, memory_root, sweep_abandoned
from elastic.replica_link import ReplicaClient, ReplicaServer
from elastic.messages import (
    Command, Copied, CopyOut, DumpStacks, Hurry, Pull, Pulled, RankState, RankStatus, Ready, Replicated, Reply, Request, Reset, StackDump,
    Start, StartFailed, StopAfter,
)
from elastic.sched import Background, batch_this_process
from elastic.zygote import ForkedRank, Zygote

ROOT = Path(__file__).resolve().parent.parent
STEP_REPORT_S = 0.25
"""Step records wake the controller's poll at most this often: the ranks' own cadence (`elastic.train.STEP_REPORT_S`,
not imported: that module brings the whole training stack into the agent)."""
GATHER_S = 0.02
"""Once a rank's step records wake a poll, how long the agent waits for its other ranks' before it answers."""
COMMAND_TIMEOUT_S = 10.0
"""How long the agent waits for a rank to answer a quick command (take its start, stop after a step)."""
ZYGOTE_START_S = 120.0
"""How long the agent waits for its rank fork server to import the training stack before it starts ranks without it."""
ZYGOTE_RESTARTS = 3
"""How many times an agent starts its rank fork server again after it died (its ranks died with it); then ranks start
afresh: a fork server that keeps dying is costing more than it saves."""
REPLICA_TIMEOUT_S = 60.0
"""How long the agent waits for its peer to take one replica of a memory snapshot."""
COPY_MAPS_KEPT = 64
"""Maps of its ranks' snapshot files the copier keeps (`storage.fs.FileMaps`): two per rank, for up to 32 ranks a node."""


@dataclass
class _Child:
    proc: subprocess.Popen | ForkedRank
    conn: Connection
    gpus: list[str]
    rank: int | None = None  # None: idle (a spare, or kept warm from an ended generation)
    last_rank: int | None = None  # the rank it trained last: its training thread's caches are that rank's
    ready: threading.Event = field(default_factory=threading.Event)
    failed: str | None = None  # why it could not start (its traceback), set once by its reader
    exit: str | None = None  # set once the process is gone, by its reader
    state: RankState | None = None  # the last state it pushed, without its records
    records: list = field(default_factory=list)  # records not yet polled, of generation `records_gen`
    records_gen: int = -1
    stepped_gen: int = -1  # the newest generation whose first step record it has pushed
    replies: queue.Queue = field(default_factory=queue.Queue)  # Reply, or None once the process is gone
    lock: threading.Lock = field(default_factory=threading.Lock)  # one command at a time
    send_lock: threading.Lock = field(default_factory=threading.Lock)  # a command and a replica's acknowledgement never interleave
    copy_heads: list[str] | None = None  # the rows heads of its last `CopyOut` that had them


@dataclass
class _Staged:
    """The memory step this node restores from: its rows, the agent holding each rank's whole file ({rank: agent}),
    and the byte ranges of other nodes' files fetched so far ({file: [(start, end)]})."""

    step: int
    generation: int
    rows: dict[int, list[dict]]
    sources: dict
    fetched: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


def _sticky(idle: list[_Child], ranks: list[int]) -> list[_Child]:
    """One of `idle` for each of `ranks`, in order: the child that trained a rank last takes it again (its training
    thread then keeps its warm caches, `elastic.rank_process._TrainingThread`); the others go in `idle`'s order."""
    wanted = set(ranks)
    by_rank = {c.last_rank: c for c in idle if c.last_rank in wanted}
    taken = {id(c) for c in by_rank.values()}
    rest = iter(c for c in idle if id(c) not in taken)
    return [by_rank[rank] if rank in by_rank else next(rest) for rank in ranks]


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank process killed by {signal.Signals(-code).name}"
    return f"rank process exited with code {code}"


def _stop(zygote: Zygote) -> None:
    """Kill a fork server and reap it (its forks die with it: their parent-death signal)."""
    zygote.proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        zygote.proc.wait(timeout=5)


@ray.remote(max_restarts=0, max_concurrency=8)
class NodeAgent:
    def __init__(self, cpus_per_rank: float, gpus_per_rank: float, working_dir: str = "", memory: dict | None = None, loopback: bool = False):
        batch_this_process()  # the agent's threads never preempt a rank's training thread (elastic.sched); children inherit it
        self._omp_threads = str(max(1, int(cpus_per_rank)))  # what Ray gives a worker with these CPUs
        self._loopback = loopback  # an embedded cluster: the ranks' collectives listen on 127.0.0.1 only, like the rest
        self._gpus_per_rank = int(gpus_per_rank)
        self._gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        # The job's working directory: where the driver imports the model's builder from. Ranks start in this actor's
        # directory (on a `ray job submit --working-dir` cluster, that node's copy of it), which `python -m` puts first
        # on their import path; the driver's directory follows, where this node has it (an embedded cluster, a shared disk).
        self._import_dirs = [str(ROOT)] + ([working_dir] if working_dir and os.path.isdir(working_dir) else [])
        self._children: list[_Child] = []
        self._lock = threading.Lock()  # guards _children and each child's rank, state and records
        self._closed = False  # `shutdown` was called: a spawn under way kills what it started, and nothing new starts
        self._spawning = threading.Lock()  # one caller at a time decides what to start and starts it (prepare, spare)
        self._changed = threading.Event()  # a child pushed records, ended, or died: wake the waiting poll
        self._last_wake = 0.0  # when step records last woke the poll (monotonic)
        self._request_ids = itertools.count(1)
        # The one thread that forks children: it lives as long as the agent, so their parent-death signal
        # fires when the agent ends and not before. A pool of one thread keeps its thread until shutdown.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        self._zygote: Zygote | None = None
        self._zygote_restarts = 0
        if not self._gpus_per_rank:
            self._spawner.submit(self._start_zygote)  # the first spawn waits for it, on the same thread
        # The memory tier (elastic.memory): this node's snapshots, and the peer node that holds their replicas.
        self._memory = None
        if memory is not None:
            node_id = ray.get_runtime_context().get_node_id()
            self._memory = NodeMemory(memory_root(memory["dir"]) / node_id / memory["job"])
            self._memory.claim()
            # What killed jobs left on this machine goes (elastic.memory.sweep_abandoned), off the agent's start.
            threading.Thread(target=sweep_abandoned, args=(memory_root(memory["dir"]),), name="memory-sweep", daemon=True).start()
        self._replicas = bool(memory and memory["replicas"])
        self._secret = bytes.fromhex(memory["secret"]) if self._replicas else b""
        # This node's end of the replication links (elastic.replica_link): its ring predecessor streams replicas here.
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        self._replica_server = ReplicaServer(self._memory, host, self._secret) if self._replicas else None
        self._peer: ReplicaClient | None = None
        self._peer_agent = None  # the agent at the other end of `_peer`, which a rank's `Hurry` reaches too
        self._peer_order = 0  # the newest set_peer call's number
        self._replicating = 0  # snapshots handed to the replicator and not yet answered
        self._replicator = Background("replicate")
        # The copies of CPU ranks' snapshots out of their memory (storage.copy_out), on SCHED_IDLE like the replicas
        # until a rank waits for one (`_hurry`).
        self._copier = Background("copy-out")
        self._copy_maps = FileMaps(keep=COPY_MAPS_KEPT)
        # A restore from memory (memory_stage): where each file of the staged step is, for the ranks' Pulls; one pull
        # at a time, so that two ranks reading the same file fetch it once.
        self._staged: _Staged | None = None
        self._puller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pull")
        if self._memory is not None:  # the first commit of a restore would import these (pandas, through pyarrow): 0.8 s
            threading.Thread(target=encode_index, args=([],), name="warm-up", daemon=True).start()

    def info(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": self._gpu_ids}

    # -- children ----------------------------------------------------------------------
    def _spawn(self) -> _Child:
        """Start one child (on the spawner thread) and add it; the caller holds `_spawning`, not `_lock`.

        The spawner may still be starting the fork server (seconds, importing
        torch on a busy node): a poll, or a rank's push, must not wait for it.
        """
        with self._lock:
            taken = {g for c in self._children for g in c.gpus}
        gpus = [g for g in self._gpu_ids if g not in taken][: self._gpus_per_rank]
        proc, conn = self._spawner.submit(self._popen, gpus).result()
        child = _Child(proc, conn, gpus)
        with self._lock:
            closed = self._closed
            if not closed:
                self._children.append(child)
        if closed:  # shut down while it started (the fork server may take seconds): nothing outlives shutdown
            proc.kill()
            conn.close()
            if isinstance(proc, ForkedRank):
                proc.wait()  # its fork server reaps it (or is dead, and took it along)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)  # reaped here: no zombie of it lives on in the agent
            raise RuntimeError("the node agent is shutting down")
        threading.Thread(target=self._read, args=(child,), name=f"read-{proc.pid}", daemon=True).start()
        return child

    def _popen(self, gpus: list[str]) -> tuple[subprocess.Popen | ForkedRank, Connection]:
        if self._closed:
            raise RuntimeError("the node agent is shutting down")
        if self._zygote is not None and not self._zygote.alive and self._zygote_restarts < ZYGOTE_RESTARTS:
            self._zygote_restarts += 1
            print(f"elastic: the rank fork server ended (status {self._zygote.proc.wait()}), its ranks with it; starting"
                  f" another ({self._zygote_restarts} of {ZYGOTE_RESTARTS})", file=sys.stderr, flush=True)
            self._start_zygote()
        if self._zygote is not None and self._zygote.alive:
            try:
                return self._zygote.fork()
            except OSError:
                pass  # it died: a fresh process, as without one
        ours, theirs = Pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "elastic.rank_process", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=self._child_env(gpus), cwd=os.getcwd(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return proc, ours

    def _child_env(self, gpus: list[str]) -> dict:
        env = dict(os.environ, OMP_NUM_THREADS=self._omp_threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*self._import_dirs, env.get("PYTHONPATH")]))
        if self._gpus_per_rank:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        if self._loopback:
            # gloo binds to the address the host name resolves to and NCCL to the first outward interface: pin both.
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = "lo"
        return env

    def _start_zygote(self) -> None:
        """Start the node's rank fork server (CPU ranks only, `elastic.zygote`); without it, ranks start afresh.

        One that fails to start is not tried again: its start may have taken `ZYGOTE_START_S`."""
        try:
            zygote = Zygote(self._child_env([]), ZYGOTE_START_S)
        except (OSError, RuntimeError, TimeoutError) as exc:
            self._zygote = None
            print(f"elastic: rank processes start without a fork server: {exc}", file=sys.stderr, flush=True)
            return
        with self._lock:
            self._zygote = zygote
            closed = self._closed
        if closed:  # `shutdown` came while it started
            _stop(zygote)

    def _read(self, c: _Child) -> None:
        """Everything a child sends: readiness, pushed state, command replies; and its end."""
        while True:
            try:
                message = c.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, RankState):
                snapshots = [r for r in message.records if r["kind"] == "mem_saved"]
                records = [r for r in message.records if r["kind"] != "mem_saved"]
                with self._lock:
                    if message.generation != c.records_gen:
                        c.records, c.records_gen = [], message.generation
                    c.records.extend(records)
                    c.state = replace(message, records=[])
                    first_step = c.stepped_gen != message.generation and any(r["kind"] == "step" for r in records)
                    if first_step:
                        c.stepped_gen = message.generation
                for rec in snapshots:  # held back until replicated: the controller hears of a snapshot once it is safe
                    self._take_snapshot(c, message.generation, rec)
                if message.finished or message.error or self._news(records, first_step):
                    self._changed.set()
            elif isinstance(message, CopyOut):
                self._copier.submit(self._copy_out, c, message)
            elif isinstance(message, Hurry):
                self._hurry()
            elif isinstance(message, Pull):
                self._puller.submit(self._pull, c, message)
            elif isinstance(message, Reply):
                c.replies.put(message)
            elif isinstance(message, Ready):
                c.ready.set()
            elif isinstance(message, StartFailed):
                c.failed = message.error
        how = _describe_exit(c.proc.wait())
        with self._lock:
            c.exit = how
        c.ready.set()
        c.replies.put(None)  # whoever waits on a reply learns at once that none will come
        self._changed.set()

    def _news(self, records: list[dict], first_step: bool = False) -> bool:
        """Whether `records` should wake the controller's poll now: any but step records at once, step records at most
        every `elastic.train.STEP_REPORT_S` (a rank whose memory snapshots make it push every step must not make the
        poll answer every step: each answer is CPU taken from training), except a generation's first step record
        (`first_step`: a recovery is timed, and its new generation's progress watched, from it)."""
        now = time.monotonic()
        if first_step or any(r["kind"] not in ("step", "eval") for r in records) or (records and now - self._last_wake >= STEP_REPORT_S):
            self._last_wake = now
            return True
        return False

    def _ask(self, requests: list[tuple[_Child, Command]], timeout_s: float) -> list[Reply | None]:
        """Send each child its command, then collect the replies (None: no reply in time, or it died), all within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        sent: list[tuple[_Child, int]] = []
        for c, command in requests:
            if not c.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                continue  # still busy with an earlier command that outlived its caller
            try:
                if c.exit is not None:
                    raise OSError("the rank process is gone")
                request = Request(next(self._request_ids), command)
                with c.send_lock:
                    c.conn.send(request)
                sent.append((c, request.id))
            except (OSError, ValueError):
                c.lock.release()
        replies = {}
        try:
            for c, request_id in sent:
                replies[id(c)] = self._reply(c, request_id, deadline)
        finally:
            for c, _ in sent:
                c.lock.release()
        return [replies.get(id(c)) for c, _ in requests]

    @staticmethod
    def _reply(c: _Child, request_id: int, deadline: float) -> Reply | None:
        """The child's reply to `request_id`; a late reply to an earlier request is dropped."""
        while True:
            try:
                reply = c.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if reply is None:
                c.replies.put(None)  # it died: so every later wait learns too
                return None
            if reply.id == request_id:
                return reply

    def _kill(self, children: list[_Child]) -> None:
        """Kill `children` and forget them; the caller holds `_lock`."""
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
            if c in self._children:
                self._children.remove(c)

    def _assign(self, c: _Child, rank: int | None, generation: int) -> None:
        """Give `c` a rank of `generation` (None, -1: idle), forgetting what it reported before; the caller holds `_lock`."""
        c.rank, c.state, c.records, c.records_gen = rank, None, [], generation
        if rank is not None:
            c.last_rank = rank

    def _ranks(self) -> list[_Child]:
        with self._lock:
            return sorted((c for c in self._children if c.rank is not None), key=lambda c: c.rank)

    # -- the controller's calls --------------------------------------------------------
    def prepare(self, n: int, keep_idle: int, timeout_s: float, spare: bool = False) -> list[int]:
        """Have `n` idle children up and ready (warm ones first), plus up to `keep_idle` more; kill the rest.

        With `spare`, also start one more now (not waited for), so that its
        start-up overlaps the others'. Returns the pids of the `n`.
        """
        with self._spawning:
            with self._lock:
                idle = [c for c in self._children if c.rank is None and c.exit is None]
                self._kill([c for c in self._children if c.exit is not None])
            while len(idle) < n + (1 if spare else 0):
                idle.append(self._spawn())
            with self._lock:
                self._kill(idle[n + keep_idle:])
        deadline = time.monotonic() + timeout_s
        for c in idle[:n]:
            if not c.ready.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a rank process did not start within {timeout_s}s")
            if c.failed or c.exit:
                raise RuntimeError(f"a rank process failed to start: {c.failed or c.exit}")
        return [c.proc.pid for c in idle[:n]]

    def start(self, assignments: list[tuple[int, dict]], store_host: str, store_port: int, timeout_s: float) -> dict[int, int]:
        """Give each ready idle child its rank and spec; return {rank: pid}. Raises if a rank cannot be handed over."""
        with self._lock:
            idle = [c for c in self._children if c.rank is None and c.exit is None and c.ready.is_set()]
            if len(idle) < len(assignments):
                raise RuntimeError(f"{len(assignments)} ranks to start and {len(idle)} rank processes ready: one ended since prepare")
            if self._memory is not None:
                memory = {"memory_dir": self._memory.uri, "memory_replicated": self._replicas}
                assignments = [(rank, {**spec, **memory}) for rank, spec in assignments]
            pairs = list(zip(_sticky(idle, [rank for rank, _ in assignments]), assignments))
            for c, (rank, spec) in pairs:
                self._assign(c, rank, spec["generation"])
        replies = self._ask([(c, Start(spec, store_host, store_port, timeout_s)) for c, (_, spec) in pairs], COMMAND_TIMEOUT_S)
        refused = {rank: (r.error if r else c.exit or "no answer") for (c, (rank, _)), r in zip(pairs, replies) if r is None or r.error}
        if refused:
            raise RuntimeError(f"rank processes did not take their start: {refused}")
        return {rank: c.proc.pid for c, (rank, _) in pairs}

    def spare(self) -> None:
        """Start one idle child if there is none (its start-up is not waited for: it comes up while the ranks train;
        but a node's first spare waits for the agent's fork server to start)."""
        with self._spawning:
            with self._lock:
                if any(c.rank is None and c.exit is None for c in self._children):
                    return
            self._spawn()

    @ray.method(enable_task_events=False)  # about one call a second: not worth a record in the GCS each
    def poll(self, generation: int, wait_s: float, memory_floor: tuple[int, int] | None = None) -> list[RankStatus]:
        """The node's ranks, alive with their state and new records or dead, after waiting up to `wait_s` for news.

        `memory_floor`: (generation, step) of the newest committed (or restored) memory step; every snapshot
        older than it, or of an earlier generation, held here is dropped.
        """
        if memory_floor is not None and self._memory is not None:
            self._memory.drop_below(*memory_floor)
        def ended() -> bool:
            return any(c.exit or (c.state and (c.state.finished or c.state.error)) for c in self._ranks())

        if wait_s > 0 and not ended() and self._changed.wait(wait_s) and not ended():
            time.sleep(GATHER_S)  # ranks in lockstep push within moments of each other: one answer for all of them
        self._changed.clear()  # before draining: a push after this wakes the next poll
        now = time.time()
        out = []
        with self._lock:
            for c in sorted((c for c in self._children if c.rank is not None), key=lambda c: c.rank):
                records = []
                if c.records_gen == generation:
                    records, c.records = c.records, []
                if c.exit is not None:  # what it pushed before it died still counts (its last steps' records)
                    state = replace(c.state or RankState(generation, -1, "start", now), records=records)
                    out.append(RankStatus(c.rank, False, state, error=c.exit))
                    continue
                state = c.state or RankState(generation, -1, "start", now)
                out.append(RankStatus(c.rank, True, replace(state, records=records)))
        return out

    def stop_after(self, step: int) -> list[int]:
        """Have every rank stop after `step`; returns the ranks that did not take it."""
        ranks = self._ranks()
        replies = self._ask([(c, StopAfter(step)) for c in ranks], COMMAND_TIMEOUT_S)
        return [c.rank for c, r in zip(ranks, replies) if r is None or r.error]

    def stacks(self, timeout_s: float) -> dict[int, StackDump]:
        ranks = self._ranks()
        replies = self._ask([(c, DumpStacks()) for c in ranks], timeout_s)
        return {c.rank: r.value if r and r.error is None else StackDump.missing(r.error if r else "no answer") for c, r in zip(ranks, replies)}

    def teardown(self, kill_ranks: list[int], grace_s: float) -> int:
        """End the generation here: kill `kill_ranks`, reset the others (kill any still stuck); how many stay warm."""
        with self._lock:
            self._kill([c for c in self._children if c.rank is not None and c.rank in set(kill_ranks)])
        rest = self._ranks()
        reset = Reset(grace_s)
        replies = self._ask([(c, reset) for c in rest], reset.longest_s + 0.5)
        kept = 0
        with self._lock:
            for c, r in zip(rest, replies):
                if r is not None and r.value is True:
                    self._assign(c, None, -1)
                    kept += 1
                else:
                    self._kill([c])
        return kept

    def shutdown(self) -> None:
        """Kill the ranks and the fork server, close the replication links, remove the node's memory-tier files.

        A spawn under way (a spare waiting for a slow fork server) kills what
        it starts once it has started it, and nothing starts after this.
        """
        with self._lock:
            self._closed = True
            self._kill(list(self._children))
            zygote = self._zygote
        if zygote is not None:
            _stop(zygote)
        for link in (self._peer, self._replica_server):
            if link is not None:
                link.close()
        self._copier.shutdown(wait=True)  # a copy under way ends (its rank is dead) before its directory goes
        self._copy_maps.close()
        if self._memory is not None:
            self._memory.destroy()

    # -- the memory tier ---------------------------------------------------------------
    def replica_address(self) -> tuple[str, int] | None:
        """Where this node takes its ring predecessor's replicas (None: the job keeps none)."""
        return self._replica_server.address if self._replica_server is not None else None

    def peer_address(self) -> tuple[str, int] | None:
        """Where this node's replicas go (None: to no node)."""
        peer = self._peer
        return peer.address if peer is not None else None

    def set_peer(self, peer, order: int) -> None:
        """The agent of the node that holds this node's replicas (None: none does, a job on one node). `order`: the
        worker group numbers its calls; one overtaken by a later call (it waited on a peer that was still starting)
        changes nothing."""
        with self._lock:
            if order < self._peer_order:
                return
            self._peer_order = order
        address = tuple(ray.get(peer.replica_address.remote(), timeout=COMMAND_TIMEOUT_S)) if peer is not None and self._replicas else None
        with self._lock:
            if order != self._peer_order:
                return
            old = self._peer if self._peer is not None and self._peer.address != address else None
            if old is not None:
                self._peer = None
            if address is not None and self._peer is None:
                self._peer = ReplicaClient(address, self._secret, REPLICA_TIMEOUT_S)
            self._peer_agent = peer if address is not None else None
        if old is not None:
            old.close()  # after a send under way on it (which holds the link): not under the agent's lock

    def _hurry(self) -> None:
        """A rank waits for its snapshot's copy or replica: lift this node's copier and replicator, and the receiving
        end on the peer, off SCHED_IDLE for a while (`elastic.sched.Background`)."""
        self._copier.hurry()
        self._replicator.hurry()
        peer = self._peer_agent
        if peer is not None:
            peer.hurry_replicas.remote()

    @ray.method(enable_task_events=False)
    def hurry_replicas(self) -> None:
        """The peer's rank waits for a replica this node is receiving (`_hurry`)."""
        if self._replica_server is not None:
            self._replica_server.hurry()

    def _copy_out(self, c: _Child, message: CopyOut) -> None:
        """On the copier's thread: write a rank's snapshot from its memory (`storage.copy_out`) the way the rank would
        (`elastic.train.Trainer._write_memory`): drop its older files, fill the file, mark it complete; answer the
        rank (it may change those tensors from then on), then replicate it like a snapshot the rank wrote."""
        if message.heads is not None:
            c.copy_heads = message.heads
        step, rank, generation = message.step, message.rank, message.generation
        error, refused = None, False
        try:
            self._memory.copy_in(c.proc.pid, message, c.copy_heads, self._copy_maps)
        except Exception as exc:  # noqa: BLE001 - the memory tier misses this step; the rank is told why
            error, refused = self._memory.describe_failure(exc), isinstance(exc, CopyRefused)
        try:
            with c.send_lock:
                c.conn.send(Copied(generation, step, error, refused))
        except (OSError, ValueError):
            return  # the rank is gone: its file, if complete, stays (a snapshot of a step it finished)
        if error is None:
            self._take_snapshot(c, generation, {"kind": "mem_saved", "t": time.time(), "step": step, "rank": rank,
                                                "bytes": message.size, "has_file": bool(message.size), "save_s": time.time() - message.t0})

    def _take_snapshot(self, c: _Child, generation: int, rec: dict) -> None:
        """A rank finished a memory snapshot. Where the job keeps replicas, the rank waits for an answer: the replica's,
        from the replicator (sends go one at a time, in order), or at once while this node has no peer and no send is
        under way (a job on one node, until a node to hold its replicas has an agent: `RayWorkerGroup._tend_ring`)."""
        if not self._replicas:
            self._pass_on(c, generation, rec, replicated=False)
            return
        with self._lock:
            queued = self._peer is not None or self._replicating > 0
            self._replicating += queued
        if queued:
            self._replicator.submit(self._replicate_queued, c, generation, rec)
        else:
            self._replicate(c, generation, rec, None)

    def _replicate_queued(self, c: _Child, generation: int, rec: dict) -> None:
        try:
            self._replicate(c, generation, rec, self._peer)  # the peer of the moment its turn comes
        finally:
            with self._lock:
                self._replicating -= 1

    def _replicate(self, c: _Child, generation: int, rec: dict, peer: ReplicaClient | None) -> None:
        """Copy a rank's finished snapshot to `peer` (None: no node holds this node's replicas), tell the rank, then
        pass the record on (replicated or not)."""
        step, rank = rec["step"], rec["rank"]
        error = None
        if peer is not None:
            try:
                body = self._memory.rows_body(step, rank, generation)
                path = self._memory.data_path(step, rank, generation) if rec["has_file"] else None
                peer.send(path, step, rank, generation, body)
            except Exception as exc:  # noqa: BLE001 - the peer is gone or slow: this step has no replica
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
        replicated = peer is not None and error is None
        try:
            with c.send_lock:
                c.conn.send(Replicated(generation, step, ok=replicated))  # the rank waits for this, either way
        except (OSError, ValueError):
            pass  # the rank is gone; its replica stays
        self._pass_on(c, generation, rec, replicated=replicated, error=error)

    def _pass_on(self, c: _Child, generation: int, rec: dict, replicated: bool, error: str | None = None) -> None:
        """Queue a snapshot's record for the controller. It does not wake the poll: it travels with the next step
        records (every `elastic.train.STEP_REPORT_S`), since a poll answer per rank and step costs training CPU."""
        out = rec | {"replicated": replicated}
        if error:
            out["replica_error"] = error
        with self._lock:
            if c.records_gen == generation:
                c.records.append(out)

    def memory_inventory(self) -> dict[tuple[int, int], dict[int, list[dict]]]:
        """{(generation, step): {rank: rows}} of every complete snapshot file this node holds (its own and replicas)."""
        return self._memory.inventory() if self._memory is not None else {}

    def memory_verify(self, step: int, rows_by_rank: dict[int, list[dict]]) -> dict[int, str]:
        """The files of `step` held here that do not match their rows (size, CRC-32), and why."""
        bad = {rank: self._memory.verify(step, rank, rows) for rank, rows in rows_by_rank.items()}
        return {rank: why for rank, why in bad.items() if why}

    def memory_records(self, generation: int, step: int, ranks: list[int]) -> dict[int, list[dict]]:
        """The step records that this node's files of `step` carry, for `ranks`."""
        held = self._memory.step_records(generation, step) if self._memory is not None else {}
        return {rank: held[rank] for rank in ranks if rank in held}

    def memory_read_ranges(self, step: int, rank: int, generation: int, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges of `rank`'s whole file of `step` held here: what another node's restoring ranks read of it."""
        if rank not in self._memory.complete_ranks(generation, step):
            raise RuntimeError(f"this node holds no whole file of rank {rank} for memory step {step}")
        return self._memory.read_ranges(step, data_file(rank, generation), ranges)

    def memory_stage(self, step: int, generation: int, rows_by_rank: dict[int, list[dict]], sources: dict, layout: dict, train_state: dict) -> dict:
        """Make memory step `step` loadable here: commit it locally, and keep where each of its files is (`sources`:
        {rank: agent}) for this node's ranks to pull from.

        The new ranks of this node then load it like any checkpoint
        (`storage.load_training_state` on this node's memory directory), each
        reading only its own pieces, every piece's checksum checked. Before it
        reads, a rank names the byte ranges it reads (`Pull`), and this agent
        fetches those the node lacks (`_pull`): a node takes what its ranks of
        the new layout read, not the whole step.
        """
        t0 = time.perf_counter()
        self._staged = _Staged(step, generation, rows_by_rank, sources)
        whole = self._memory.complete_ranks(generation, step)
        for rank, rows in rows_by_rank.items():
            if rows and rank not in whole:
                self._memory.hollow(step, rows[0]["file"], rows[0]["file_bytes"])
        rows = [row for rank in sorted(rows_by_rank) for row in rows_by_rank[rank]]
        commit(self._memory.uri, step, rows, generation=generation, layout=layout, train_state=train_state)
        return {"stage_s": time.perf_counter() - t0, "held_bytes": self._memory.nbytes()}

    def _pull(self, c: _Child, message: Pull) -> None:
        """Fetch the byte ranges of a rank's `Pull` that this node lacks from the nodes that hold them; answer `Pulled`.

        A file held here whole is read in place; of another node's file, only
        the ranges asked for travel, and land at their offsets in a partial
        copy (`NodeMemory.put_ranges`); what an earlier rank of this node had
        fetched is not fetched again.
        """
        fetched, nbytes, error = [], 0, None
        try:
            staged = self._staged
            if staged is None:
                raise RuntimeError("no memory step is staged on this node")
            by_file = {rows[0]["file"]: rank for rank, rows in staged.rows.items() if rows}
            unknown = sorted(set(message.ranges) - set(by_file))
            if unknown:
                raise RuntimeError(f"memory step {staged.step} has no files {unknown}")
            whole = self._memory.complete_ranks(staged.generation, staged.step)
            calls = {}
            for name, ranges in message.ranges.items():
                rank, have = by_file[name], staged.fetched.setdefault(name, [])
                todo = [(a, b) for a, b in ranges if not any(x <= a and b <= y for x, y in have)]
                if todo and rank not in whole:
                    calls[name] = (todo, staged.sources[rank].memory_read_ranges.remote(staged.step, rank, staged.generation, todo))
            for name, (todo, ref) in calls.items():
                parts = ray.get(ref, timeout=REPLICA_TIMEOUT_S)
                self._memory.put_ranges(staged.step, name, [(a, data) for (a, _), data in zip(todo, parts)])
                staged.fetched[name].extend(todo)
                fetched.append(name)
                nbytes += sum(map(len, parts))
        except Exception as exc:  # noqa: BLE001 - told to the rank, whose load then fails with it
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            with c.send_lock:
                c.conn.send(Pulled(message.id, tuple(fetched), nbytes, error))
        except (OSError, ValueError):
            pass  # the rank is gone

    def memory_corrupt(self, seed: int) -> int:
        return self._memory.corrupt(seed) if self._memory is not None else 0
