"""The training loop of one rank, independent of Ray.

It runs inside an initialised torch.distributed group and reports what it does
through a `Progress` sink (its rank process pushes it to the controller; a
plain torch.distributed program can print it). The model, its initial
weights and the optimizer come from `elastic.recipe`. The learning rate is a
pure function of the step (`elastic.schedule`) and the data position a pure
function of the step and the position the generation started at, so the
state that must survive a restart is the tensors plus two integers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import storage
from elastic.config import JobConfig
from elastic.data import DataInfo, GlobalSampler, batch_digest, describe, open_datasets
from elastic.faults import Fault
from elastic.layout import Layout
from elastic.memory import NodeMemory, SnapshotFailed
from elastic.messages import Copied, CopyOut
from storage.state import SnapshotPool
from storage.fs import FileMaps
from elastic.recipe import build_model, build_optimizer, build_parallel_model, initialize, model_vocab_size
from elastic.schedule import lr_at
from strategies import clip_grad_norm_and_count

PHASES = ("start", "load", "data", "forward_backward", "optimizer", "eval", "save", "done")
STEP_REPORT_S = 0.25
"""How often step records are pushed to the controller's waiting poll: fresh enough for progress,
deadlines and accounting, rare enough that polling takes little from training. Each rank keeps
its own clock: ranks in lockstep that pushed in the same instant (shared wall-clock slots) woke
their reporters together, and with four ranks to a core those bursts slowed the steps down more
than spread-out pushes did (bench/README.md)."""
MEMORY_RECORDS = 16
"""Step records each memory snapshot carries (its rank's newest): more than the steps the controller's copy of them
lags behind the ranks (`STEP_REPORT_S` plus a poll), which a node loss takes with it (`elastic.memory`)."""


class Progress:
    """Where a rank reports progress: current (step, phase) and a queue of records."""

    def __init__(self):
        self.step = -1
        self.phase = "start"
        self.phase_since = time.time()
        self.changed = threading.Event()  # set by every record: wakes a waiting long poll
        self._records: list[dict] = []
        self._last_wake = 0.0
        self._stepped = False  # whether the first step record is out: it wakes the poll at once (recovery is timed to it)
        self._lock = threading.Lock()

    def enter(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.phase = phase
        self.phase_since = time.time()

    def record(self, kind: str, **fields) -> None:
        now = time.time()
        with self._lock:
            self._records.append({"kind": kind, "t": now, **fields})
        # Step and eval-batch records wake the poll at most every STEP_REPORT_S (they travel in small batches); others,
        # and the generation's first step, at once.
        first_step = kind == "step" and not self._stepped
        self._stepped |= kind == "step"
        if first_step or kind not in ("step", "eval") or now - self._last_wake >= STEP_REPORT_S:
            self._last_wake = now
            self.changed.set()

    def drain(self) -> list[dict]:
        with self._lock:
            out, self._records = self._records, []
        return out


class Acks:
    """The newest memory step whose replica is in place on another node, as the node agent acknowledges it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.step = -1
        self._released = False

    def ack(self, step: int) -> None:
        with self._cond:
            self.step = max(self.step, step)
            self._cond.notify_all()

    def release(self) -> None:
        """The generation ends: a wait returns now (False), not once a peer that may be gone answers."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def wait(self, step: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.step >= step or self._released, timeout_s) and self.step >= step


@dataclass
class Control:
    """What the controller can ask of a running loop: stop now, or stop after a given step (a planned resize).

    `replicated` carries the agent's acknowledgements of memory snapshots replicated to another node; `copy_out`
    hands it a snapshot to copy out of the rank's memory; `pull` has the agent fetch the byte ranges of a staged
    memory step's files that a restoring rank reads and its node lacks (it returns the files it fetched from and the
    bytes; None: no agent, every file is where the load looks).
    """

    stop: threading.Event = field(default_factory=threading.Event)
    stop_at: int | None = None
    """Stop after this step, or (told later) after the step in progress; every rank stops after the same step, the
    first that any rank of the job was told of in time (they agree on it in each step's gradient-norm all-reduce)."""
    replicated: Acks = field(default_factory=Acks)
    pull: Callable[[dict[str, list[tuple[int, int]]]], tuple[list[str], int]] | None = None
    copy_out: Callable[[CopyOut], "Future[Copied]"] | None = None
    """Hand a memory snapshot to the agent to copy out of this process (`storage.copy_out`); returns the future of its
    answer. None: no agent, the rank writes its snapshots itself."""
    hurry: Callable[[int], None] | None = None
    """This rank is about to wait for its memory snapshot of a step (the copy or the replica): have the agent lift
    the idle work it waits on (`elastic.sched.Background`)."""


@dataclass
class RankSpec:
    """What one rank of one generation needs to know."""

    config: dict
    layout: dict
    rank: int
    generation: int
    resume_step: int | None = None
    data_position: int = 0
    """Samples of the global order consumed before the first step (the resumed checkpoint's position)."""
    data: dict | None = None
    """The driver's `DataInfo` as JSON (None: this rank resolves the data itself)."""
    faults: list[dict] = field(default_factory=list)
    device: str = "cpu"
    resume_tier: str = "durable"
    """Where `resume_step` is: "durable" (checkpoint.uri) or "memory" (this node's memory directory, staged by its agent)."""
    memory_dir: str = ""
    """This node's memory-tier directory (set by the node agent when checkpoint.memory is on)."""
    memory_replicated: bool = False
    """Whether the job keeps memory replicas: the agent answers each snapshot once it is replicated to another node,
    or at once while no node holds this node's replicas (a peer can join mid-generation)."""


def _fault_signal(store, fault: Fault, step: int) -> None:
    """Tell the controller, through the rendezvous store, that a fault fires now at `step` (before it makes us unreachable)."""
    if store is not None:
        store.set(f"fault/{fault.id}", json.dumps({"t": time.time(), "step": step}))


def _block_forever(stop: threading.Event) -> None:
    while not stop.wait(3600):
        pass


class Trainer:
    """One rank's model, optimizer and loop for one generation."""

    def __init__(self, spec: RankSpec, progress: Progress, fault_store=None, control: "Control | None" = None):
        self.spec = spec
        self.cfg = JobConfig.model_validate(spec.config)
        self.layout = Layout(**spec.layout)
        self.rank = spec.rank
        self.progress = progress
        self.fault_store = fault_store
        self.control = control or Control()
        self.stop = self.control.stop
        self.writer = storage.BackgroundWriter()
        self._pending = None  # the Future of the save in flight
        self._unsnapped = None  # (step, t0, background) of the save in flight while training has not waited for its copy
        self.faults = [Fault(**f) for f in spec.faults]
        self.memory = NodeMemory(spec.memory_dir) if self.cfg.checkpoint.memory and spec.memory_dir else None
        self._memory_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-writer") if self.memory else None
        self._memory_buffers = SnapshotPool()
        self._memory_maps = FileMaps()  # the maps of this rank's two memory files, overwritten in turn (storage.fs.FileMaps)
        self._memory_records: deque[dict] = deque(maxlen=MEMORY_RECORDS)  # this rank's newest step records, for its snapshots
        self._memory_layout: dict = {}  # storage.plan_writes' layout cache for the memory snapshots (this generation's layout)
        self._memory_pending = None  # (step, Future, what it reads) of the memory snapshot in flight, done once it is complete
        # A CPU rank's snapshots are copied out of its memory by its agent (storage.copy_out), off the rank's threads.
        self._copies_out = self.memory is not None and self.control.copy_out is not None and spec.device == "cpu"
        self._heads_sent = None  # the rows template whose heads the agent has (CopyOut.heads)
        self._memory_stall = 0.0  # what waiting for memory snapshots blocked training since the last step record
        self._memory_reuse = True  # whether the files that retention drops may be overwritten (no send of them is late)
        self._restore_pull: dict = {}  # what a restore from memory had its agent fetch from other nodes (the "ready" record)
        self.device = torch.device(spec.device)
        info = DataInfo.from_json(spec.data) if spec.data is not None else describe(self.cfg)
        self.data, self.eval_data = open_datasets(self.cfg, info, model_vocab_size(self.cfg.model) or self.cfg.model.vocab_size)
        self.sampler = GlobalSampler(
            info.train_samples, self.cfg.data.seed, self.cfg.training.global_batch, spec.resume_step or 0, spec.data_position
        )

    # -- set-up ------------------------------------------------------------------
    def build(self) -> None:
        cfg = self.cfg
        self.progress.enter("load")
        self.mesh = self.layout.build_mesh(self.device.type)
        self.pm = build_parallel_model(cfg, self.mesh, self.device)
        self.optimizer = build_optimizer(self.pm.parameters(), cfg.training)
        if self.spec.resume_step is None:
            initialize(self.pm, build_model(cfg.model)[0], cfg)
            self.start_step = 0
        else:
            from_memory = self.spec.resume_tier == "memory"
            uri = self.spec.memory_dir if from_memory else cfg.checkpoint.uri
            pull = self._pull if from_memory and self.control.pull is not None else None
            storage.load_training_state(uri, self.spec.resume_step, self.pm.model_parts, self.optimizer, before_read=pull)
            self.start_step = self.spec.resume_step

    def _pull(self, ranges: dict[str, list[tuple[int, int]]]) -> None:
        """Have the node agent fetch what this rank reads of the memory step that its node lacks (and only that)."""
        t0 = time.perf_counter()
        fetched, nbytes = self.control.pull(ranges)
        self._restore_pull = {"pulled_files": fetched, "pulled_bytes": nbytes, "pull_s": time.perf_counter() - t0}

    # -- faults --------------------------------------------------------------------
    def _faults_at(self, step: int, kinds: tuple[str, ...]) -> list[Fault]:
        """This rank's faults due at `step`; a kill during save fires at the first save at or after its step."""
        return [
            f for f in self.faults
            if f.rank == self.rank and f.kind in kinds and (f.step == step or (f.kind == "kill_during_save" and f.step <= step))
        ]

    def _inject_before_step(self, step: int) -> None:
        for fault in self._faults_at(step, ("kill", "node", "hang")):
            _fault_signal(self.fault_store, fault, step)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "node":
                # The controller removes our node; wait here until it does.
                self.progress.enter("data", step)
                _block_forever(self.stop)
            elif fault.where == "collective":
                # Enter a collective that no other rank joins: they block in the step's collectives.
                self.progress.enter("data", step)
                dist.barrier()
                _block_forever(self.stop)
            else:
                self.progress.enter("data", step)
                _block_forever(self.stop)

    # -- the loop ------------------------------------------------------------------
    def run(self) -> bool:
        """Train to the last step (True), or until stopped or paused for a resize (False).

        However the loop ends, the save in flight is finished before this
        returns (`BackgroundWriter.close`): a process kept warm for the next
        generation never writes behind it. A write that cannot finish keeps
        the loop from ending, and the process is then killed as stuck.
        """
        try:
            return self._run()
        finally:
            self.writer.close()
            if self._memory_pending is not None:  # a copy out of this process must end before its tensors go
                with contextlib.suppress(Exception):
                    self._memory_pending[1].result()
            if self._memory_pool is not None:
                self._memory_pool.shutdown(wait=True)  # a memory snapshot in flight ends in this generation's files
            self._memory_maps.close()

    def _run(self) -> bool:
        self.build()
        cfg, layout = self.cfg, self.layout
        t = cfg.training
        scale = layout.dp / (t.global_batch * cfg.data.seq_len)
        reporter = layout.is_data_reporter(self.rank)
        dp_rank = layout.dp_rank(self.rank)
        self.progress.record("ready", start_step=self.start_step, **self._restore_pull)
        for step in range(self.start_step, t.steps):
            if self.stop.is_set():
                self._snapshot_taken()
                return False
            self._inject_before_step(step)
            t0 = time.time()
            self.progress.enter("data", step)
            indices = self.sampler.rank_indices(step, dp_rank, layout.dp)
            inputs, labels = self.data.batch(indices)
            digest = batch_digest(inputs, labels) if reporter else None
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            self.progress.enter("forward_backward", step)
            loss_sum = self.pm.forward_backward(inputs, labels, scale)
            self.progress.enter("optimizer", step)
            # Before the all-reduce every rank joins: no rank starts its next memory snapshot (dropping its
            # older one) until every rank's last one is whole (elastic.memory).
            self._memory_settled()
            # A planned stop (`Control.stop_at`) reaches each rank at its own moment, perhaps a step apart; the ranks
            # agree on it in the norm's all-reduce, so all stop after the same step (none waits in the next one's
            # collectives for a rank that stopped).
            wants_stop = self.control.stop_at is not None and step + 1 >= self.control.stop_at
            grad_norm, stop_votes = clip_grad_norm_and_count(self.pm, t.grad_clip, wants_stop)
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            self._snapshot_taken()  # the save in flight copies the state while forward and backward run
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            record = {"step": step, "t_start": t0, "grad_norm": float(grad_norm)}
            if self.memory is not None:
                record["memory_stall_s"], self._memory_stall = self._memory_stall, 0.0
            if reporter:
                record.update(loss_sum=float(loss_sum), samples=indices, data_digest=digest)
            record["t_end"] = time.time()
            self.progress.record("step", **record)
            if self.memory is not None:
                self._memory_records.append({"kind": "step", **record})
            done = step + 1
            if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                self.evaluate(done, reporter, dp_rank)
            stop_here = stop_votes.item() > 0
            # At a planned stop too: the next generation can restore that step from memory should its durable save
            # break before it has a snapshot of its own (MemoryTier.begin_generation).
            if self.memory is not None and done < t.steps and (done % cfg.checkpoint.memory_every_steps == 0 or stop_here):
                self.memory_save(done)
            if done % cfg.checkpoint.every_steps == 0 or done == t.steps or stop_here:
                # The last save of a run (or before a planned resize) is synchronous: nothing may be lost.
                self.save(done, background=cfg.checkpoint.async_save and done != t.steps and not stop_here)
            if stop_here:
                self._memory_settled()
                self.progress.record("paused", step=done)
                return False
        self._wait_for_writer()
        self._memory_settled()
        self.progress.enter("done", t.steps)
        return True

    def evaluate(self, step: int, reporter: bool, dp_rank: int) -> None:
        """Forward the held-out split in whole global batches, each rank its slice; reporters record each batch's loss sum.

        It reads only the eval split, in index order, and changes neither the
        weights nor the training order: the run trains the same with or without it.
        """
        self.progress.enter("eval", step)
        gb, dp = self.cfg.training.global_batch, self.layout.dp
        per_rank, batches = gb // dp, len(self.eval_data) // gb
        for part in self.pm.model_parts:
            part.eval()
        try:
            for b in range(batches):
                first = b * gb + dp_rank * per_rank
                inputs, labels = (x.to(self.device) for x in self.eval_data.batch(list(range(first, first + per_rank))))
                loss_sum = self.pm.evaluate(inputs, labels)
                if reporter:
                    self.progress.record("eval", step=step, batch=b, batches=batches, samples=batches * gb, loss_sum=float(loss_sum))
        finally:
            for part in self.pm.model_parts:
                part.train()

    def _wait_for_writer(self) -> None:
        """Block until the save in flight is written; a failed write raises here, in the training thread."""
        self._snapshot_taken()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _snapshot_taken(self) -> None:
        """Block until the save in flight has copied the state (training may change it from here on).

        Its rows are reported once written, with the training stall: what this
        wait and the submit blocked, in the background case.
        """
        if self._unsnapped is None:
            return
        (step, t0, background), self._unsnapped = self._unsnapped, None
        stall = self.writer.wait_snapshot()

        def report(done) -> None:
            if done.exception() is None:
                self.progress.record("saved", step=step, rows=done.result(), save_s=time.time() - t0, stall_s=stall if background else None)

        self._pending.add_done_callback(report)

    def save(self, step: int, background: bool = False) -> None:
        """Snapshot this rank's shards of the state after `step` steps, write them, report the index rows.

        With `background`, the copy and the write run on the writer's thread
        (at most one save in flight) while training goes on; training waits
        for the copy only before its next optimizer step.
        """
        self.progress.enter("save", step)
        t0 = time.time()
        tensors = storage.state_tensors(self.pm.model_parts, self.optimizer)
        self._die_if_due(self.cfg.checkpoint.uri, step, tensors)
        self._wait_for_writer()
        self._pending = self.writer.submit(self.cfg.checkpoint.uri, step, self.rank, tensors, generation=self.spec.generation)
        self._unsnapped = (step, t0, background)
        if not background:
            self._wait_for_writer()

    def _die_if_due(self, uri: str, step: int, tensors: dict) -> None:
        """A `kill_during_save` fault due at this save (durable or memory): die part-way through writing it."""
        kill = self._faults_at(step, ("kill_during_save",))
        if not kill:
            return
        snap = storage.snapshot(tensors)
        threading.Thread(
            target=storage.write_shards, args=(uri, step, self.rank, snap), kwargs={"generation": self.spec.generation}, daemon=True,
        ).start()
        time.sleep(0.002 * (1 + kill[0].id % 4))
        _fault_signal(self.fault_store, kill[0], step)
        os.kill(os.getpid(), signal.SIGKILL)

    # -- the memory tier -------------------------------------------------------------
    def memory_save(self, step: int) -> None:
        """Snapshot this rank's shards after `step` steps into node memory, overlapping the next forward and backward.

        On the CPU the node agent copies the live tensors straight out of
        this process (`_copy_out`), which nothing changes before
        `_memory_settled` (the next optimizer step waits for it); where the
        kernel refuses, and on a GPU, the rank's writer thread writes them (on
        a GPU after a copy to pinned host memory on a side stream).
        """
        self._memory_settled()
        tensors = storage.state_tensors(self.pm.model_parts, self.optimizer)
        self._die_if_due(self.memory.uri, step, tensors)
        if self._copies_out:
            self._memory_pending = (step, *self._copy_out(step, tensors))
            return
        ready = storage.compute_done(tensors)  # here: after the optimizer step's kernels, before the next step's
        future = self._memory_pool.submit(self._write_memory, step, tensors, ready, list(self._memory_records), self._memory_reuse)
        self._memory_pending = (step, future, None)

    def _copy_out(self, step: int, tensors: dict) -> tuple[Future, tuple]:
        """Have the agent copy this snapshot out of this process's memory: the future of its answer (`Copied`), and
        what it reads, to hold until it is answered (nothing the copy reads may be freed before)."""
        plan = storage.plan_copy(tensors, self.rank, self.spec.generation, self._memory_layout)
        heads = None
        if plan is not None and plan.template is not self._heads_sent:
            heads, self._heads_sent = plan.template.heads(), plan.template
        answer = self.control.copy_out(CopyOut(
            self.spec.generation, step, self.rank, plan.size if plan else 0, plan.regions if plan else [], heads,
            list(self._memory_records), self._memory_reuse, time.time(),
        ))
        return answer, (tensors, plan)

    def _write_memory(self, step: int, tensors: dict, ready: "torch.cuda.Event | None", records: list[dict], reuse: bool) -> None:
        """On the memory writer's thread: drop the older files, write the pieces, mark them complete, tell the agent
        (which replicates them). Retention lists the node's directory: a millisecond kept off the training thread.
        `ready`: the training thread's `storage.compute_done` (None on the CPU)."""
        t0 = time.time()
        if self.device.type == "cuda":
            data = storage.snapshot(tensors, pool=self._memory_buffers, layout_cache=self._memory_layout, ready=ready)
        else:
            data = tensors
        self.memory.keep_two(self.rank, self.spec.generation, step, reuse=reuse)
        rows = storage.write_shards(self.memory.uri, step, self.rank, data, generation=self.spec.generation,
                                    layout_cache=self._memory_layout, durable=False, maps=self._memory_maps)
        self.memory.finish(step, self.rank, self.spec.generation, storage.rows_json(rows, self._memory_layout), records)
        self.progress.record("mem_saved", step=step, rank=self.rank, bytes=rows[0]["file_bytes"] if rows else 0,
                             has_file=bool(rows), save_s=time.time() - t0)

    def _hurry(self, step: int) -> None:
        """About to wait for the snapshot of `step`: have the agent lift the idle work this rank waits on."""
        if self.control.hurry is not None:
            self.control.hurry(step)

    def _memory_settled(self) -> None:
        """Wait for the memory snapshot in flight: written and complete, and replicated (up to its timeout) when it has a replica.

        A snapshot that failed, or whose replica did not come in time, is
        reported and training goes on: the memory tier loses that step, the
        durable tier is untouched.
        """
        if self._memory_pending is None:
            return
        (step, pending, held), self._memory_pending = self._memory_pending, None
        t0 = time.time()
        try:
            if held is not None and not pending.done():  # the agent's copy (held: what it reads)
                self._hurry(step)
            copied = pending.result()  # None: written by this rank
            if copied is not None and copied.error is not None:
                if copied.refused:
                    self._copies_out = False
                raise SnapshotFailed(copied.error + ("; this rank writes its memory snapshots itself from now on" if copied.refused else ""))
        except Exception as exc:  # noqa: BLE001 - the memory tier misses a step; training goes on
            self.progress.record("mem_failed", step=step, error=self.memory.describe_failure(exc))
            return
        # The agent sends its node's files one at a time, in order: once this one's replica is in, no send of an
        # older file is under way.
        if self.spec.memory_replicated and not self.control.replicated.wait(step, 0):
            self._hurry(step)  # again: the replica starts once the copy is done, behind its node's other ranks' files
        self._memory_reuse = not self.spec.memory_replicated or self.control.replicated.wait(step, self.cfg.checkpoint.memory_replica_timeout_s)
        if not self._memory_reuse:
            self.progress.record("mem_failed", step=step, error=f"no replica within checkpoint.memory_replica_timeout_s="
                                 f"{self.cfg.checkpoint.memory_replica_timeout_s}s")
        self._memory_stall += time.time() - t0
