"""The controller: an explicit state machine that keeps one elastic job alive.

    SCHEDULING --layout chosen, workers started--> RUNNING
    RUNNING --all ranks done--> FINISHED
    RUNNING --dead rank / dead node / hang / worker error--> RECOVERING
    RUNNING --more workers available, at a checkpoint boundary--> RESIZING
    RECOVERING --policy retries--> SCHEDULING      (--policy gives up--> FAILED)
    RESIZING --checkpoint committed--> SCHEDULING
    SCHEDULING --below min_workers for too long--> FAILED

`step()` runs one iteration, so tests can drive it one transition at a time
with any worker group that has the `RayWorkerGroup` methods. Decisions come
from the injected `FailurePolicy` and `ScalingPolicy`. The controller hosts the
rendezvous store (it outlives every worker), learns of deaths from Ray and of
hangs from missed progress deadlines, and is the checkpoint coordinator:
ranks report their index rows, the controller writes the index and the
manifest (the commit) once every rank of the current generation has written.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field, replace

import storage
from elastic.checkpointing import CheckpointCoordinator
from elastic.config import ConfigError, JobConfig
from elastic.data import DataInfo, GlobalSampler, describe, resume_position
from elastic.events import EventLog
from elastic.faults import Fault
from elastic.layout import Layout
from elastic.ledger import SampleLedger
from elastic.messages import RankState, RankStatus, StackDump
from elastic.policies import Failure, FailurePolicy, ScalingPolicy
from elastic.rendezvous import parse_fault_signal
from elastic.train import RankSpec, lr_at
from elastic.watchdog import HangWatchdog
from elastic.worker_group import RanksUnreachable, StartError

_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|Connection refused", re.I)
PEER_LOSS_GRACE_S = 1.0
_COLLECTIVE_FRAMES = re.compile(r"all_reduce|all_gather|reduce_scatter|barrier|broadcast|_wait|recv|send")


class State(enum.Enum):
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


@dataclass
class _StepTally:
    loss_sum: float = 0.0
    reporters: int = 0
    samples: list[int] = field(default_factory=list)
    digest: int = 0  # sum of the samples' CRCs (elastic.data.batch_digest)
    duration: float = 0.0  # the slowest rank's time for the step, measured on the workers
    ended: float = 0.0  # when the last rank finished it (its wall clock)
    memory_stall: float = 0.0  # the longest any rank waited in it for its memory snapshot (part of `duration`)
    ranks: set[int] = field(default_factory=set)  # whose records are counted


class Controller:
    def __init__(
        self,
        cfg: JobConfig,
        group,
        events: EventLog,
        *,
        faults: list[Fault] = (),
        cluster=None,
        fault_store=None,
        scaling: ScalingPolicy | None = None,
        failure: FailurePolicy | None = None,
        data: DataInfo | None = None,
        clock=time.time,
    ):
        self.cfg = cfg
        self.group = group
        self.events = events
        self.cluster = cluster
        self.fault_store = fault_store
        self.scaling = scaling or ScalingPolicy(cfg)
        self.failure_policy = failure or FailurePolicy(cfg.fault.max_failures)
        self.watchdog = HangWatchdog(cfg.fault)
        self.clock = clock
        self.data = data or describe(cfg)
        self.sampler = GlobalSampler(self.data.train_samples, cfg.data.seed, cfg.training.global_batch)
        self.ledger = SampleLedger()
        self.faults = list(faults)
        self.fired: dict[int, float] = {}
        self._bad_signals: dict[str, bytes] = {}  # store keys whose value was garbage, and that value
        self.state = State.SCHEDULING
        self.generation = 0
        self.layout: Layout | None = None
        self.resume_step: int | None = None
        self.resume_tier = "durable"  # where resume_step is: "durable", or "memory" (then memory_restore is its plan)
        self.memory_restore: dict | None = None
        self.completed_step = -1  # last step every data slice reported in this generation
        self.last_step_ended: float | None = None  # when the last completed step ended (wall clock), of any generation
        self.pending_failure: Failure | None = None
        self.losses: dict[int, float] = {}
        self.tallies: dict[int, _StepTally] = {}
        self.eval_losses: dict[int, float] = {}  # held-out loss after the step count it is keyed by
        self.eval_tallies: dict[int, list] = {}  # step -> [loss sum, batch records] while an evaluation reports
        self.failures: list[dict] = []
        # Failures whose recovery has not trained a step yet: one detected while an earlier one's recovery was still
        # under way (a second fault before the first step after a restart) ends its recovery at the same step.
        self.open_failures: list[dict] = []
        self.finished_ranks: set[int] = set()
        self.waiting_since: float | None = None
        self.max_seen_step = -1
        self.last_polls: dict[int, RankState] = {}  # each rank's last reported state (without records)
        self.peer_errors_since: float | None = None
        self.spares_requested = False  # warm spares: with the job's first start, after that once per generation
        self.checkpoints = CheckpointCoordinator(cfg, events, self._train_state, clock)
        self.resize_target: int | None = None
        self.next_grow_check = 0.0
        self.node_returns: list[float] = []  # when removed nodes come back (node faults with back=)
        self.grow_seen_at: int | None = None  # completed step when more workers were first seen
        self.failed_reason: str | None = None
        self._abort_reason: str | None = None
        self.started_at = clock()

    # -- the loop ------------------------------------------------------------------
    def run(self) -> State:
        while self.state not in (State.FINISHED, State.FAILED):
            self.step()
        self.checkpoints.close()
        return self.state

    @property
    def last_committed(self) -> int | None:
        return self.checkpoints.last_committed

    def abort(self, reason: str) -> None:
        """Fail the job at the next iteration, from any thread (the lease renewer's, when another job took over)."""
        self._abort_reason = reason

    def step(self) -> State:
        if self._abort_reason and self.state not in (State.FINISHED, State.FAILED):
            self.failed_reason = self._abort_reason
            self._transition(State.FAILED, reason=self.failed_reason)
            return self.state
        self._return_nodes()
        handler = {
            State.SCHEDULING: self._schedule,
            State.RUNNING: self._run_once,
            State.RESIZING: self._run_once,
            State.RECOVERING: self._recover,
        }[self.state]
        handler()
        return self.state

    def _transition(self, state: State, **why) -> None:
        self.events.emit("state", state=state.value, previous=self.state.value, generation=self.generation, **why)
        self.state = state

    # -- SCHEDULING ------------------------------------------------------------------
    def _schedule(self) -> None:
        now = self.clock()
        self._check_fault_signals(now)  # a fault that fired as the last generation was torn down is not armed again
        available = self.group.capacity()
        decision = self.scaling.decide(available, self.layout)
        if decision.layout is None:
            if self.waiting_since is None:
                self.waiting_since = now
                self.events.emit("waiting_for_workers", available=available, reason=decision.reason)
            if now - self.waiting_since > self.cfg.scaling.wait_for_workers_s:
                self.failed_reason = f"gave up after {self.cfg.scaling.wait_for_workers_s}s: {decision.reason}"
                self._transition(State.FAILED, reason=self.failed_reason)
            else:
                time.sleep(self.cfg.fault.heartbeat_s)
            return
        self.waiting_since = None
        try:
            if self.resume_step is None:
                position = 0
            elif self.resume_tier == "memory":
                position = self.memory_restore["train_state"]["data"]["position"]
            else:
                position = resume_position(self.cfg.checkpoint.uri, self.resume_step, self.data)
        except ConfigError as exc:  # a checkpoint of other data: resuming would train on the wrong samples
            self.failed_reason = str(exc)
            self._transition(State.FAILED, reason=self.failed_reason)
            return
        self.sampler.rebase(self.resume_step or 0, position)
        self.generation += 1
        self.layout = decision.layout
        self.events.emit(
            "generation_start", generation=self.generation, world_size=self.layout.world_size,
            layout=self.layout.as_dict(), resume_step=self.resume_step, resume_tier=self.resume_tier if self.resume_step is not None else None,
            data_position=position, available=available, reason=decision.reason,
        )
        data = self.data.to_json()
        unfired = [f.as_dict() for f in self.faults if f.id not in self.fired and f.kind != "corrupt"]
        specs = [
            RankSpec(
                config=self.cfg.model_dump(mode="json"), layout=self.layout.as_dict(), rank=r, generation=self.generation,
                resume_step=self.resume_step, data_position=position, data=data, faults=unfired, device=self._device(),
                resume_tier=self.resume_tier,
            ).__dict__
            for r in range(self.layout.world_size)
        ]
        try:
            memory_restore = self.memory_restore if self.resume_tier == "memory" else None
            self.group.start(self.layout, specs, with_spares=self.generation == 1, memory_restore=memory_restore)
        except StartError as exc:
            self.group.shutdown()
            self._on_failure(Failure("start_failed", None, None, None, self.resume_step or 0, str(exc), exc.cause), now)
            return
        if memory_restore is not None:
            staged = self.group.memory_staged.values()
            self.events.emit("memory_restored", step=self.resume_step, nodes=len(staged),
                             stage_s=max((s["stage_s"] for s in staged), default=0.0), held_bytes=max((s["held_bytes"] for s in staged), default=0))
        if self.generation == 1:
            self.group.replenish()  # the nodes without ranks (those with ranks started theirs alongside them); not waited for
        self.tallies.clear()
        self.eval_tallies.clear()
        self.spares_requested = self.generation == 1  # else once this generation has trained a step (see replenish)
        self.peer_errors_since = None
        self.last_polls = {}
        self.max_seen_step = self.resume_step or 0
        self.checkpoints.begin_generation()
        origin = (self.memory_restore["generation"], self.resume_step) if self.resume_tier == "memory" else None
        self.checkpoints.memory.begin_generation(self.generation, self.layout.as_dict(), self.layout.world_size,
                                                 origin=origin, resume_step=self.resume_step)
        self.finished_ranks.clear()
        self.completed_step = (self.resume_step or 0) - 1
        self.grow_seen_at = None
        self.watchdog.reset(self.clock())
        self._transition(State.RUNNING, world_size=self.layout.world_size)

    def _device(self) -> str:
        if self.cfg.device != "auto":
            return self.cfg.device
        return "cuda" if self.cfg.scaling.gpus_per_worker > 0 else "cpu"

    # -- RUNNING --------------------------------------------------------------------
    def _run_once(self) -> None:
        statuses = self.group.poll(self.cfg.fault.heartbeat_s)
        now = self.clock()
        self._check_fault_signals(now)
        dead = [s for s in statuses if not s.alive]
        self._absorb_poll(statuses, now)
        for s in statuses:
            if s.alive:
                self.last_polls[s.rank] = replace(s.state, records=[])
        self._reap_commits(wait=self.state is State.RESIZING)  # a paused job waits for its commit anyway
        if reason := self.checkpoints.overdue():
            self.failed_reason = reason
            self._transition(State.FAILED, reason=reason)
            return
        if dead:
            self._on_ranks_lost([s.rank for s in dead], f"dead ranks {[s.rank for s in dead]}: {dead[0].error or ''}", now)
            return
        errors = [s for s in statuses if s.alive and s.state.error]
        if errors and all(_PEER_LOST.search(s.state.error) for s in errors):
            # A collective failing because a peer vanished: the peer's death is the failure, and
            # Ray reports it within moments. Blame the survivor only if no death shows up.
            self.peer_errors_since = self.peer_errors_since or now
            if now - self.peer_errors_since < PEER_LOSS_GRACE_S:
                errors = []
        if errors:
            s = errors[0]
            self._on_failure(
                Failure("worker_error", s.rank, self.group.node_of(s.rank), s.rank, self.completed_step + 1, s.state.error), now
            )
            return
        if self.layout and len(self.finished_ranks) == self.layout.world_size:
            self._reap_commits(wait=True)
            last = self.cfg.training.steps
            if self.last_committed != last:  # the trained model would exist nowhere: not a finished run
                self.failed_reason = f"the final checkpoint (step {last}) did not commit; the newest is step {self.last_committed}"
                self._transition(State.FAILED, reason=self.failed_reason)
            else:
                self._transition(State.FINISHED, steps=self.completed_step + 1)
            return
        if self.state is State.RESIZING and self.last_committed is not None and self.last_committed >= self.resize_target:
            self._resize()
            return
        if self.state is State.RUNNING and now >= self.next_grow_check:
            self.next_grow_check = now + 1.0
            self._maybe_grow()
            self._group_news()
        polls = self.last_polls.values()
        phases = {p.phase for p in polls}
        if not self.watchdog.in_loop and len(polls) == self.layout.world_size and \
                all(p.generation == self.generation and p.phase not in ("start", "load") for p in polls):
            self.watchdog.entered_loop(now)  # start-up is over: the first step has a step's deadline
        if self.watchdog.expired(now, "save" if "save" in phases else "step"):
            self._on_hang(now)

    def _absorb_poll(self, statuses: list[RankStatus], now: float) -> None:
        """Take in what a poll brought: every rank's new records, a dead rank's last ones too (a poll drains them)."""
        for s in statuses:
            if s.state is not None:
                self._absorb(s.rank, s.state, now)

    def _absorb(self, rank: int, state: RankState, now: float) -> None:
        if state.generation != self.generation:
            return  # fenced: a stale rank's reports count for nothing
        self.max_seen_step = max(self.max_seen_step, state.step)
        for rec in state.records:
            if rec["kind"] == "step":
                self._on_step_record(rank, rec, now)
            elif rec["kind"] == "saved":
                self._on_saved(rank, rec)
            elif rec["kind"] == "mem_saved":
                if (step := self.checkpoints.memory.on_saved(rank, rec)) is not None:
                    self.group.memory_floor = (self.generation, step)  # the agents drop older snapshots
            elif rec["kind"] == "mem_failed":
                self.checkpoints.memory.on_failed(rank, rec)
            elif rec["kind"] == "eval":
                self._on_eval_record(rec, now)
            elif rec["kind"] == "ready":
                self.watchdog.touch(now)
                if rec.get("pulled_files"):  # what a restore from memory fetched from other nodes for this rank
                    self.events.emit("memory_pulled", rank=rank, node=self.group.node_of(rank), step=rec["start_step"],
                                     files=rec["pulled_files"], pulled_bytes=rec["pulled_bytes"], pull_s=round(rec["pull_s"], 4))
        if state.finished:
            self.finished_ranks.add(rank)

    def _on_step_record(self, rank: int, rec: dict, now: float) -> None:
        step = rec["step"]
        tally = self.tallies.setdefault(step, _StepTally())
        if rank in tally.ranks:
            return  # already counted (a record filled in from a memory snapshot comes again)
        tally.ranks.add(rank)
        tally.duration = max(tally.duration, rec["t_end"] - rec["t_start"])
        tally.ended = max(tally.ended, rec["t_end"])
        tally.memory_stall = max(tally.memory_stall, rec.get("memory_stall_s", 0.0))
        if "loss_sum" not in rec:
            return
        tally.loss_sum += rec["loss_sum"]
        tally.reporters += 1
        tally.samples.extend(rec["samples"])
        tally.digest += rec["data_digest"]
        if tally.reporters < self.layout.dp:
            return
        del self.tallies[step]
        t = self.cfg.training
        loss = tally.loss_sum / (t.global_batch * self.cfg.data.seq_len)
        self.losses[step] = loss
        self.ledger.record(step, tally.samples, expected=self.sampler.global_indices(step))
        duration = tally.duration
        # What the step adds to kept time: the slowest rank's time, but never more than the wall time since the
        # step before ended. Each step's slowest rank is another, and a sum of their times outgrows the wall time.
        kept = duration if self.last_step_ended is None else max(0.0, min(duration, tally.ended - self.last_step_ended))
        self.last_step_ended = tally.ended
        self.completed_step = step
        self.watchdog.observe_step(duration, now)
        if not self.spares_requested:
            self.spares_requested = True
            self.group.replenish()  # not waited for: `_group_news` reports a node that could not start one
        self.events.emit(
            "step", step=step + 1, loss=loss, generation=self.generation, world_size=self.layout.world_size, step_s=duration, kept_s=kept,
            grad_norm=rec["grad_norm"], data_position=self.sampler.cursor(step), data_digest=tally.digest,
            **({"memory_stall_s": tally.memory_stall} if self.cfg.checkpoint.memory else {}),
        )
        for failure in self.open_failures:
            failure["recover_s"] = now - failure["detected_at"]
            self.events.emit("recovered", failure=failure["kind"], recover_s=failure["recover_s"], step=step + 1,
                             detected_at=failure["detected_at"])
        self.open_failures = []

    def _on_eval_record(self, rec: dict, now: float) -> None:
        """One data slice's loss sum over one eval batch; the eval event once every slice of every batch reported."""
        self.watchdog.touch(now)  # an evaluation is progress: its batches keep the step deadline away
        step = rec["step"]
        tally = self.eval_tallies.setdefault(step, [0.0, 0])
        tally[0] += rec["loss_sum"]
        tally[1] += 1
        if tally[1] < self.layout.dp * rec["batches"]:
            return
        del self.eval_tallies[step]
        loss = tally[0] / (rec["samples"] * self.cfg.data.seq_len)
        self.eval_losses[step] = loss
        self.events.emit("eval", step=step, loss=loss, samples=rec["samples"], generation=self.generation)

    def _on_saved(self, rank: int, rec: dict) -> None:
        self.checkpoints.on_saved(rank, rec, self.layout.as_dict(), self.layout.world_size, self.generation)

    def _train_state(self, step: int) -> dict:
        """The non-tensor state of the checkpoint of `step`, as JSON (layout-independent)."""
        return {
            "step": step,
            "data": {"position": self.sampler.cursor(step), "identity": self.data.identity},
            "model_seed": self.cfg.training.seed,
            "scheduler": {"name": self.cfg.training.schedule, "last_step": step, "lr": lr_at(step, self.cfg)},
            "model": self.cfg.model.model_dump(mode="json"),  # how `elastic ckpt export` rebuilds the model's spec
            "generation": self.generation,
        }

    def _reap_commits(self, wait: bool = False) -> None:
        """Take in the commits that ended (with `wait`, every one, each within its deadline)."""
        if self.checkpoints.reap(wait):
            self.watchdog.touch(self.clock())

    # -- RESIZING (planned, loses nothing) -------------------------------------------------
    def _maybe_grow(self) -> None:
        """More workers than we use: stop every rank at a common step a little ahead, save, restart larger."""
        available = self.group.capacity()
        if not self.scaling.should_grow(available, self.layout):
            self.grow_seen_at = None
            return
        if self.grow_seen_at is None or self.completed_step <= self.grow_seen_at:
            # Grow only once a step has completed since the workers appeared: the polls are fresh and the job
            # is moving. A stalled job is the watchdog's to judge first; a resize would hide a hang.
            self.grow_seen_at = self.completed_step if self.grow_seen_at is None else self.grow_seen_at
            return
        self.grow_seen_at = None
        target = min(self.max_seen_step + 2, self.cfg.training.steps)
        if target >= self.cfg.training.steps:
            return
        self.resize_target = target
        try:
            self.group.stop_after(target)
        except RanksUnreachable as exc:  # a node lost as the resize begins: a failure like any other
            self._on_ranks_lost(exc.ranks, str(exc), self.clock())
            return
        self.events.emit("resize_requested", available=available, world_size=self.layout.world_size, at_step=target)
        self._transition(State.RESIZING, at_step=target)

    def _resize(self) -> None:
        self.group.teardown()
        # Ranks already past the target when told stop at the first step after it: that is the save to resume from.
        self.resume_step, self.resume_tier = self.last_committed, "durable"
        self.resize_target = None
        self.events.emit("resized", resume_step=self.resume_step, lost_steps=0)
        self._transition(State.SCHEDULING, resume_step=self.resume_step)

    # -- faults ------------------------------------------------------------------------
    def _check_fault_signals(self, now: float) -> None:
        """Faults signal through the rendezvous store when they fire; node faults are carried out here."""
        if self.fault_store is None:
            return
        for fault in self.faults:
            if fault.id in self.fired or fault.kind == "corrupt":
                continue
            key = f"fault/{fault.id}"
            if not self.fault_store.check([key]):
                continue
            raw = self.fault_store.get(key)
            signal = parse_fault_signal(raw, self.cfg.training.steps)
            if signal is None:
                if self._bad_signals.get(key) != raw:  # once per distinct value: a rank's real signal overwrites it
                    self._bad_signals[key] = raw
                    self.events.emit("warning", kind="bad_store_value", key=key, value=repr(raw[:200]),
                                     message=f"rendezvous store key {key} holds a value that is not a fault signal; ignored")
                continue
            fired_at, at_step = signal
            node = self.group.node_of(fault.rank)
            if fault.kind == "node":
                fired_at = self.clock()
                holder = self.group.replica_holder(node) if fault.peer else None
                self.cluster.remove_node(node)
                if holder is not None:  # a correlated loss: the node and the one holding its memory replicas
                    self.cluster.remove_node(holder)
                if fault.back_s > 0:
                    self.node_returns.append(fired_at + fault.back_s)
            self.fired[fault.id] = fired_at
            if fault.kind != "node" and self.state in (State.RECOVERING, State.SCHEDULING) and self.failures \
                    and self.failures[-1]["recover_s"] is None:
                # Fired by a rank of the generation a failure is ending, heard of after that failure was recorded (two
                # ranks killed a moment apart): part of it, as if seen together (`_matching_faults`).
                self.failures[-1]["fault_ids"].append(fault.id)
            self.events.emit(
                "fault_injected", fault_id=fault.id, kind=fault.kind, rank=fault.rank, step=fault.step, at_step=at_step,
                node=node, t_fault=fired_at, where=fault.where,
            )
        for fault in self.faults:
            if fault.kind == "corrupt" and fault.id not in self.fired and self.completed_step + 1 >= fault.step:
                self.fired[fault.id] = -1.0  # armed: carried out before the next restore

    def _return_nodes(self) -> None:
        now = self.clock()
        for due in [t for t in self.node_returns if t <= now]:
            self.node_returns.remove(due)
            self.cluster.start_node()  # in the background: a failure meanwhile is still seen at once
        if self.cluster is not None:
            joined = self.cluster.joined()
            for node in joined:
                self.events.emit("node_added", node=node)
            if joined and self.state is State.RUNNING:
                # Its agent and warm spare now, not at the next generation's first step: a job left on one node keeps
                # its memory replicas there from then on (RayWorkerGroup._tend_ring), and a grow finds a spare.
                self.group.replenish()

    def _corrupt_newest(self) -> None:
        for fault in self.faults:
            # Armed by an earlier loop, or due now: the failed generation's last records may have arrived with its failure.
            due = self.fired.get(fault.id) == -1.0 or (fault.id not in self.fired and self.completed_step + 1 >= fault.step)
            if fault.kind == "corrupt" and due:
                if fault.where == "memory":
                    target = self.group.memory_corrupt(seed=fault.id)
                else:
                    target = self.checkpoints.call_bounded("corrupting the newest checkpoint (a corrupt fault)", storage.corrupt_newest,
                                                           self.cfg.checkpoint.uri, seed=fault.id)
                self.fired[fault.id] = self.clock()
                self.events.emit("fault_injected", fault_id=fault.id, kind="corrupt", rank=None, step=fault.step, node=None,
                                 t_fault=self.fired[fault.id], target=target, where=fault.where)

    def _matching_faults(self, failure: Failure) -> list[dict]:
        """The injected faults a new failure detects, not yet matched to one: its own first (the newest that hit its
        culprit, else the newest), then the others. Every fault that has fired is over once this recovery is, so two
        that fire together (two ranks killed at once, whose deaths one poll may see apart) end in one failure."""
        claimed = {i for f in self.failures for i in f["fault_ids"]}
        open_faults = [e for e in self.events.of("fault_injected") if e["fault_id"] not in claimed and e["kind"] != "corrupt"]
        if not open_faults:
            return []
        own = next((e for e in reversed(open_faults) if e["rank"] == failure.culprit), open_faults[-1])
        return [own] + [e for e in open_faults if e is not own]

    # -- failures ------------------------------------------------------------------------
    def _on_hang(self, now: float) -> None:
        stacks = self.group.stacks()
        statuses = self.group.poll(self.cfg.fault.heartbeat_s)
        self._absorb_poll(statuses, now)  # what the ranks that are not stuck did since the last poll still counts
        fresh = {s.rank: s.state for s in statuses if s.alive}
        states = {**self.last_polls, **fresh}  # a rank slow to answer this round keeps its last known position
        culprit = self._culprit(stacks, states)
        # The training thread first: truncation keeps it and drops the end of the other threads'.
        self.events.emit("hang_stacks", stacks={str(k): v.text()[:4000] for k, v in stacks.items()}, culprit=culprit)
        node = self.group.node_of(culprit) if culprit is not None else None
        self._on_failure(Failure("hang", culprit, node, culprit, self.completed_step + 1, "missed progress deadline"), now)

    @staticmethod
    def _culprit(stacks: dict[int, StackDump], states: dict[int, RankState]) -> int | None:
        """The rank furthest behind; among equals, the one whose training thread is not waiting in a collective."""
        from elastic.train import PHASES

        def behind(rank: int):
            s = states.get(rank)
            step, phase = (s.step, s.phase) if s else (-1, "start")
            in_collective = bool(_COLLECTIVE_FRAMES.search(stacks[rank].training or ""))
            return (step, PHASES.index(phase) if phase in PHASES else 0, in_collective)

        ranks = sorted(stacks)
        return min(ranks, key=behind) if ranks else None

    def _on_ranks_lost(self, ranks: list[int], detail: str, now: float) -> None:
        """Ranks dead or out of reach: a dead node if theirs is gone, else dead ranks; an injected fault's rank is the culprit."""
        injected = [f for f in self.faults if self.fired.get(f.id, -1) > 0 and f.rank in ranks]
        rank = injected[-1].rank if injected else ranks[0]
        node = self.group.node_of(rank)
        kind = "node_died" if node is not None and not self.group.node_alive(node) else "rank_died"
        self._on_failure(Failure(kind, rank, node, rank, self.completed_step + 1, detail), now)

    def _fill_step_records(self, records: dict[int, list[dict]], upto: int) -> bool:
        """Count the step records a memory snapshot carries ({rank: records}) that never reached this controller
        (they died with their node); True when every step before `upto` is then complete."""
        now = time.time()
        for rank, recs in sorted(records.items()):
            for rec in recs:
                if self.completed_step < rec["step"] < upto:
                    self._on_step_record(rank, rec, now)
        return self.completed_step >= upto - 1

    def _group_news(self) -> None:
        """What the worker group did on its own: warm spares that failed, memory replica ring changes."""
        for node, error in self.group.spare_errors().items():  # the job goes on: a rank lost there starts cold
            self.events.emit("warning", kind="spare_failed", node=node, message=f"no warm spare on node {node}: {error}")
        for change in self.group.ring_changes():
            self.events.emit("replica_ring", **change)

    def _on_failure(self, failure: Failure, now: float) -> None:
        faults = self._matching_faults(failure)
        fault = faults[0] if faults else None
        record = {
            "kind": fault["kind"] if fault else failure.kind,
            "detected_as": failure.kind,
            "rank": failure.rank,
            "node": failure.node,
            "culprit": failure.culprit,
            # Where the job was: the controller hears of completed steps in batches, a rank's own report
            # (its poll, or the fault's signal) may be ahead of it.
            "step": max(failure.step, self.max_seen_step, (fault.get("at_step") if fault else None) or 0),
            "fault_id": fault["fault_id"] if fault else None,
            "fault_ids": [e["fault_id"] for e in faults],
            "detected_at": now,
            "detect_s": (now - fault["t_fault"]) if fault else None,
            "fault_step": fault.get("at_step") if fault else None,  # steps the faulty rank had completed
            "recover_s": None,
            "lost_steps": None,
            "detail": failure.detail[-2000:],
        }
        self.failures.append(record)
        self.resize_target = None  # a planned resize in progress is overtaken by the recovery
        self.events.emit("failure_detected", **{k: v for k, v in record.items() if k != "detail"}, detail=failure.detail[-500:])
        self.pending_failure = failure
        self._transition(State.RECOVERING, failure=failure.kind)

    # -- RECOVERING -------------------------------------------------------------------------
    def _recover(self) -> None:
        failure = self.pending_failure
        self._absorb_poll(self.group.poll(self.cfg.fault.heartbeat_s), self.clock())  # the survivors' last steps and saves
        kept = self.group.teardown(kill_ranks=[failure.culprit] if failure.culprit is not None else [])
        self._reap_commits(wait=True)
        decision = self.failure_policy.decide(failure)
        record = self.failures[-1]
        if decision.exclude_node:
            self.group.excluded_nodes.add(decision.exclude_node)
        if not decision.retry:
            self.failed_reason = decision.reason
            self._transition(State.FAILED, reason=decision.reason)
            return
        self._corrupt_newest()
        known = self.completed_step
        point = self.checkpoints.restore_point(self.group, upto=self.completed_step + 1, fill=self._fill_step_records)
        resume = self.resume_step = point.step
        self.resume_tier, self.memory_restore = point.tier, point.memory
        record["restored_from"] = point.tier
        # What is older than a restored memory step is of no more use; after a durable restore, nothing the
        # agents hold is of use until the new generation commits (its steps may be lower than the floor was).
        self.group.memory_floor = (point.memory["generation"], resume) if point.tier == "memory" else None
        start = resume or 0
        done = max(self.completed_step + 1, self.max_seen_step, record["fault_step"] or 0)  # a rank at step k has done k
        record["lost_steps"] = max(0, done - start)
        record["resume_step"] = resume
        self.ledger.rollback(start)
        for step in [s for s in self.losses if s >= start]:
            del self.losses[step]
        for step in [s for s in self.eval_losses if s > start]:  # an evaluation after k steps is part of checkpoint k
            del self.eval_losses[step]
        self.open_failures.append(record)
        self.events.emit("recovering", resume_step=resume, restored_from=point.tier, lost_steps=record["lost_steps"],
                         reason=decision.reason, workers_kept=kept,
                         **({"steps_filled_from_memory": self.completed_step - known} if self.completed_step > known else {}))
        self._transition(State.SCHEDULING, resume_step=resume)
