"""The controller state machine, driven one `step()` at a time with a scripted worker group: no Ray, no torch.distributed.

The scripted group plays every rank: each poll completes one training step on
all ranks (with the real sample indices of the layout), writes real checkpoint
files at the boundaries, and can be told to kill a rank, hang, or change its
capacity. The checkpoints it commits through the controller are real.
"""

from __future__ import annotations

import pytest
import torch

import storage
from elastic.commands.report import analyse, report_from_events
from elastic.config import load_config
from elastic.controller import Controller, State
from elastic.data import DataInfo, GlobalSampler
from elastic.events import EventLog, read_events
from elastic.faults import Fault, parse_faults
from elastic.messages import RankState, RankStatus, StackDump
from elastic.report import build_report
from elastic.train import _fault_signal
from elastic.worker_group import RanksUnreachable


class ScriptedGroup:
    def __init__(self, cfg, capacity: int):
        self.cfg = cfg
        self.cap = capacity
        self.excluded_nodes: set[str] = set()
        self.replica_ring: list[str] = []  # no memory tier: the scripted ranks write durable checkpoints only
        self.sampler = None  # the ranks' sampler, from the specs of each start
        self.kill_rank_at: dict[int, int | tuple[int, ...]] = {}  # step -> the rank (or ranks) that dies before it
        self.hang_at: int | None = None
        self.layout = None
        self.starts: list[tuple[int, int | None]] = []
        self.stop_at: int | None = None
        self.unreachable_at_stop: list[int] = []  # ranks whose node cannot be told to stop (lost as a resize begins)
        self.spare_failures: dict[str, str] = {}  # nodes whose agent cannot start a spare, and why
        self._spares_asked: dict[str, str] = {}
        # step -> rank that dies once the step is done, before the survivors' records of it reach a poll (`late`:
        # they come with the next poll)
        self.dies_before_survivors_report: dict[int, int] = {}
        self.late: list[RankStatus] | None = None
        self.step_times = lambda rank, step: (0.0, 0.01)  # a rank's (t_start, t_end) of a step, on its clock

    # the RayWorkerGroup surface the controller uses
    def capacity(self) -> int:
        return self.cap

    def start(self, layout, specs, *, with_spares: bool = False, memory_restore=None) -> None:
        self.layout, self.gen = layout, specs[0]["generation"]
        self.step = specs[0]["resume_step"] or 0
        info = DataInfo.from_json(specs[0]["data"])
        self.sampler = GlobalSampler(info.train_samples, self.cfg.data.seed, self.cfg.training.global_batch, self.step, specs[0]["data_position"])
        self.starts.append((layout.world_size, specs[0]["resume_step"]))
        self.stop_at = None
        self.late = None

    def stop_after(self, step: int) -> None:
        if self.unreachable_at_stop:
            raise RanksUnreachable(self.unreachable_at_stop, "ActorDiedError: the actor died unexpectedly")
        self.stop_at = step

    def replenish(self) -> None:
        self._spares_asked = dict(self.spare_failures)

    def spare_errors(self) -> dict[str, str]:
        errors, self._spares_asked = self._spares_asked, {}
        return errors

    def ring_changes(self) -> list[dict]:
        return []  # no memory tier here

    def node_of(self, rank: int) -> str:
        return f"node{rank // 2}"

    def node_alive(self, node: str) -> bool:
        return True

    def stacks(self) -> dict[int, StackDump]:
        # Every rank's reporter thread is in a pipe send; only the training threads tell the culprit apart.
        others = "--- thread reporter\n  conn.send(state)"
        return {r: StackDump("  dist.all_reduce(...)" if r != 1 else "  next(loader)", others) for r in range(self.layout.world_size)}

    def teardown(self, kill_ranks=(), grace_s: float = 1.0) -> int:
        self.killed = list(kill_ranks)
        return self.layout.world_size - len(self.killed)

    def shutdown(self) -> None:
        pass

    def poll(self, timeout_s: float) -> list[RankStatus]:
        if self.late is not None:
            out, self.late = self.late, None
            return out
        world, step = self.layout.world_size, self.step
        phase = "data" if self.hang_at == step else "forward_backward"
        base = RankState(self.gen, step, phase, 0.0)
        if step in self.kill_rank_at:
            dead = self.kill_rank_at.pop(step)
            dead = set(dead) if isinstance(dead, tuple) else {dead}
            out = [RankStatus(r, True, base) if r not in dead else RankStatus(r, False, error="died") for r in range(world)]
            self.late = out  # the survivors wait in a collective for the dead rank: no progress until the next start
            return out
        if self.hang_at == step or step >= self.cfg.training.steps or (self.stop_at is not None and step >= self.stop_at):
            # hung, done or paused: no new records
            finished = step >= self.cfg.training.steps
            return [
                RankStatus(r, True, RankState(self.gen, step - 1 if step else 0, "forward_backward" if r != 1 else phase, 0.0, finished=finished))
                for r in range(world)
            ]
        out = []
        done = step + 1
        for r in range(world):
            t_start, t_end = self.step_times(r, step)
            rec = {"kind": "step", "step": step, "t_start": t_start, "t_end": t_end, "grad_norm": 1.0}
            if self.layout.is_data_reporter(r):
                rec.update(loss_sum=1.0, samples=self.sampler.rank_indices(step, self.layout.dp_rank(r), self.layout.dp), data_digest=0)
            records = [rec]
            if done % self.cfg.checkpoint.every_steps == 0 or done == self.cfg.training.steps or done == self.stop_at:
                rows = storage.write_shards(self.cfg.checkpoint.uri, done, r, {f"model.r{r}": torch.full((3,), float(done))}, generation=self.gen)
                records.append({"kind": "saved", "step": done, "rows": rows, "save_s": 0.01})
            out.append(RankStatus(r, True, RankState(self.gen, step, phase, 0.0, records, finished=done >= self.cfg.training.steps)))
        self.step = done
        if step in self.dies_before_survivors_report:
            dead = self.dies_before_survivors_report.pop(step)
            self.late = [s for s in out if s.rank != dead]
            return [RankStatus(r, False, out[r].state, error="died") if r == dead else RankStatus(r, True, RankState(self.gen, step, phase, 0.0))
                    for r in range(world)]
        return out


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


def _setup(tmp_path, capacity=4, **sets):
    base = {"training.steps": 12, "checkpoint.every_steps": 4, "training.global_batch": 8, "fault.heartbeat_s": 0.001,
            "checkpoint.uri": str(tmp_path / "ckpt"), "run_root": str(tmp_path), "scaling.wait_for_workers_s": 0,
            "checkpoint.memory": "false", **sets}  # the scripted ranks write durable checkpoints only
    cfg = load_config("deploy/examples/demo.yaml", [f"{k}={v}" for k, v in base.items()] + ["fault.inject=[]"])
    group = ScriptedGroup(cfg, capacity)
    clock = Clock()
    ctrl = Controller(cfg, group, EventLog(tmp_path / "events.jsonl"), clock=clock)
    return ctrl, group, clock


def _run(ctrl, limit=200) -> list[State]:
    seen = []
    for _ in range(limit):
        seen.append(ctrl.step())
        if seen[-1] in (State.FINISHED, State.FAILED):
            return seen
    raise AssertionError(f"no end state after {limit} steps: {seen[-5:]}")


def _ledger_clean(ctrl):
    expected = [i for s in range(ctrl.cfg.training.steps) for i in ctrl.sampler.global_indices(s)]
    assert ctrl.ledger.summary(expected) == {"expected": len(expected), "seen_once": len(expected), "duplicated": 0, "missing": 0}


def test_happy_path_one_transition_at_a_time(tmp_path):
    ctrl, group, _ = _setup(tmp_path)
    assert ctrl.state is State.SCHEDULING
    assert ctrl.step() is State.RUNNING and ctrl.layout.world_size == 4
    assert ctrl.step() is State.RUNNING and ctrl.completed_step == 0
    assert _run(ctrl)[-1] is State.FINISHED
    assert [e["step"] for e in ctrl.events.of("checkpoint_committed")] == [4, 8, 12]
    assert [c["step"] for c in storage.list_checkpoints(ctrl.cfg.checkpoint.uri)] == [12, 8, 4]
    _ledger_clean(ctrl)


def test_kept_time_never_outgrows_the_wall_time_when_each_step_has_another_slowest_rank(tmp_path):
    # Every rank's steps follow one another on its clock, one a second, but at each step another rank leaves the
    # last collective 0.3 s early: it starts its next step early and waits out 1.3 s in it. The slowest rank's
    # time is then 1.3 s at every step, over 1 s of wall time per step.
    ctrl, group, _ = _setup(tmp_path)

    def end(rank, step):
        return -1.0 if step < 0 else step + 1 - (0.3 if rank == step % 4 else 0.0)

    group.step_times = lambda rank, step: (end(rank, step - 1), end(rank, step))
    assert _run(ctrl)[-1] is State.FINISHED
    steps = ctrl.events.of("step")
    assert [round(e["step_s"], 6) for e in steps] == [2.0] + [1.3] * 11  # each step's slowest rank
    assert [round(e["kept_s"], 6) for e in steps] == [2.0] + [1.0] * 11  # capped by the wall time since the step before
    assert sum(e["kept_s"] for e in steps) == pytest.approx(13.0)  # what the ranks spanned: from -1 s to 12 s


def test_a_node_without_a_spare_is_a_warning_not_a_failure(tmp_path):
    ctrl, group, _ = _setup(tmp_path)
    group.spare_failures = {"node1": "no answer within 5.0s"}
    assert _run(ctrl)[-1] is State.FINISHED and not ctrl.failures
    (warning,) = ctrl.events.of("warning")  # once: spares are asked for once per generation
    assert warning["kind"] == "spare_failed" and warning["node"] == "node1" and "no answer" in warning["message"]


def test_dead_rank_recovers_from_last_commit(tmp_path):
    ctrl, group, _ = _setup(tmp_path)
    group.kill_rank_at[6] = 2
    states = _run(ctrl)
    assert State.RECOVERING in states and states[-1] is State.FINISHED
    (failure,) = ctrl.failures
    assert failure["detected_as"] == "rank_died" and failure["rank"] == 2 and failure["culprit"] == 2
    assert failure["resume_step"] == 4 and failure["lost_steps"] == 2 and failure["recover_s"] > 0
    assert group.starts == [(4, None), (4, 4)]
    _ledger_clean(ctrl)


def test_a_failure_before_the_first_step_of_a_recovery_ends_both_recoveries_at_that_step(tmp_path):
    # Rank 2 dies before step 7; the job restarts from checkpoint 4, and rank 1 dies before the restart's first
    # step. Both failures are recovered by the first step that completes after them: each gets its recover_s, from
    # its own detection, and a `recovered` event naming it; the report's recovery time counts that stretch once.
    ctrl, group, _ = _setup(tmp_path)
    group.kill_rank_at[6] = 2
    while not ctrl.failures:
        ctrl.step()
    group.kill_rank_at[4] = 1
    assert _run(ctrl)[-1] is State.FINISHED
    first, second = ctrl.failures
    assert first["recover_s"] > second["recover_s"] > 0
    recovered = ctrl.events.of("recovered")
    assert [e["detected_at"] for e in recovered] == [first["detected_at"], second["detected_at"]]
    assert [e["step"] for e in recovered] == [5, 5] and [e["recover_s"] for e in recovered] == [first["recover_s"], second["recover_s"]]
    events = read_events(tmp_path / "events.jsonl")
    assert [f["recover_s"] for f in report_from_events(events)["failures"]] == [first["recover_s"], second["recover_s"]]
    run = analyse(report_from_events(events), events)
    first_step = next(e["step_s"] for e in events if e["event"] == "step" and e["step"] == 5 and e["generation"] == 3)
    assert run.breakdown["recovery"] == pytest.approx(first["recover_s"] - first_step)  # not the sum of both
    _ledger_clean(ctrl)


def test_what_survivors_report_after_a_death_still_counts(tmp_path):
    # Rank 2 saves step 4 and dies; the survivors' step and save records of step 4 reach the agent only after the
    # poll that saw the death. The recovery's poll brings them: checkpoint 4 commits and nothing is lost.
    ctrl, group, _ = _setup(tmp_path)
    group.dies_before_survivors_report[3] = 2
    assert _run(ctrl)[-1] is State.FINISHED
    (failure,) = ctrl.failures
    assert failure["resume_step"] == 4 and failure["lost_steps"] == 0, failure
    assert [e["step"] for e in ctrl.events.of("checkpoint_committed")] == [4, 8, 12]
    _ledger_clean(ctrl)


def test_shrinks_when_capacity_drops(tmp_path):
    ctrl, group, _ = _setup(tmp_path)
    group.kill_rank_at[5] = 3
    for _ in range(8):
        ctrl.step()
    group.cap = 3  # a node's worth of slots is gone; 3 does not divide the batch of 8
    assert _run(ctrl)[-1] is State.FINISHED
    assert [w for w, _ in group.starts] == [4, 2]
    _ledger_clean(ctrl)


def test_hang_names_the_culprit(tmp_path):
    ctrl, group, clock = _setup(tmp_path, **{"fault.hang_floor_s": 1.0, "fault.hang_factor": 2.0})
    group.hang_at = 9
    while ctrl.completed_step < 8:
        ctrl.step()
    group.hang_at = 9
    clock.now += 0.5
    assert ctrl.step() is State.RUNNING  # within the deadline
    clock.now += 1.0
    assert ctrl.step() is State.RECOVERING
    failure = ctrl.failures[-1]
    assert failure["detected_as"] == "hang" and failure["culprit"] == 1
    (event,) = ctrl.events.of("hang_stacks")
    assert event["culprit"] == 1 and event["stacks"]["1"].startswith("--- training thread\n  next(loader)")
    group.hang_at = None
    assert _run(ctrl)[-1] is State.FINISHED
    _ledger_clean(ctrl)


def test_waits_then_fails_below_min_workers(tmp_path):
    ctrl, group, _ = _setup(tmp_path, capacity=1, **{"scaling.min_workers": 2})
    assert _run(ctrl)[-1] is State.FAILED
    assert "min_workers" in ctrl.failed_reason
    assert ctrl.events.of("waiting_for_workers")


def test_gives_up_after_max_failures(tmp_path):
    ctrl, group, _ = _setup(tmp_path, **{"fault.max_failures": 1})
    group.kill_rank_at.update({2: 0, 3: 1})
    assert _run(ctrl)[-1] is State.FAILED
    assert "max_failures" in ctrl.failed_reason


def test_grows_at_a_boundary_without_losing_a_step(tmp_path):
    ctrl, group, _ = _setup(tmp_path, capacity=2, **{"training.steps": 16})
    while ctrl.completed_step < 5:
        ctrl.step()
    group.cap = 4
    states = []
    while State.RESIZING not in states:  # a grow check every step
        ctrl.next_grow_check = 0.0
        states.append(ctrl.step())
    assert states[0] is State.RUNNING  # the first check only notes the new workers; a completed step confirms
    states += _run(ctrl)
    assert states[-1] is State.FINISHED
    assert [w for w, _ in group.starts] == [2, 4]
    resized = ctrl.events.of("resized")[0]
    assert resized["lost_steps"] == 0 and group.starts[1][1] == resized["resume_step"]
    assert not ctrl.failures
    _ledger_clean(ctrl)


def test_no_grow_while_hung(tmp_path):
    # Workers come back just as the job stops moving: the watchdog names the hang first, no resize hides it.
    ctrl, group, clock = _setup(tmp_path, capacity=2, **{"training.steps": 16, "fault.hang_floor_s": 2.0, "fault.hang_factor": 2.0})
    while ctrl.completed_step < 8:
        ctrl.step()
    group.hang_at = 9
    clock.now += 1.5
    group.cap = 4
    ctrl.next_grow_check = 0.0
    assert ctrl.step() is State.RUNNING  # neither grown nor yet past the deadline
    clock.now += 1.0
    assert ctrl.step() is State.RECOVERING
    assert ctrl.failures[-1]["detected_as"] == "hang" and not ctrl.events.of("resize_requested")
    group.hang_at = None
    assert _run(ctrl)[-1] is State.FINISHED
    assert [w for w, _ in group.starts] == [2, 4]  # the recovery picks up the returned workers
    _ledger_clean(ctrl)


def test_node_lost_as_a_resize_begins_is_a_failure_the_policy_decides(tmp_path):
    ctrl, group, _ = _setup(tmp_path, capacity=2, **{"training.steps": 16})
    while ctrl.completed_step < 5:
        ctrl.step()
    group.cap = 4
    group.unreachable_at_stop = [0, 1]
    states = []
    while State.RECOVERING not in states:
        ctrl.next_grow_check = 0.0
        states.append(ctrl.step())
    assert State.RESIZING not in states and not ctrl.events.of("resize_requested")
    (failure,) = ctrl.failures
    assert failure["detected_as"] == "rank_died" and failure["rank"] == 0 and "ActorDiedError" in ctrl.events.of("failure_detected")[0]["detail"]
    group.unreachable_at_stop = []
    assert _run(ctrl)[-1] is State.FINISHED
    _ledger_clean(ctrl)


class SignalStore:
    """What fault signals use of the rendezvous store: a rank sets `fault/ID`, the controller checks and reads it."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


class FaultingGroup(ScriptedGroup):
    """Scripted ranks that carry out the kill faults of their specs as `elastic.train.Trainer` does.

    Before running the step at loop index S (S steps done), the faulty rank
    signals the store with `elastic.train._fault_signal`, then dies.
    """

    def __init__(self, cfg, capacity: int, store: SignalStore):
        super().__init__(cfg, capacity)
        self.store = store
        self.faults: list[Fault] = []

    def start(self, layout, specs, **kwargs) -> None:
        super().start(layout, specs, **kwargs)
        self.faults = [Fault(**f) for f in specs[0]["faults"] if f["kind"] == "kill"]

    def poll(self, timeout_s: float) -> list[RankStatus]:
        due = [f for f in self.faults if f.step == self.step]
        for fault in due:
            _fault_signal(self.store, fault, self.step)
            self.faults.remove(fault)
        if due:
            self.kill_rank_at[self.step] = tuple(f.rank for f in due)
        return super().poll(timeout_s)


def test_faults_that_kill_two_ranks_at_once_are_one_failure_that_names_both(tmp_path):
    scripted, _, clock = _setup(tmp_path, **{"training.steps": 16, "checkpoint.every_steps": 8})
    scripted.checkpoints.close()  # only its config, event log and clock are used
    store = SignalStore()
    faults = parse_faults(["kill:rank=1,step=10", "kill:rank=2,step=10"], steps=16, max_world=4)
    ctrl = Controller(scripted.cfg, FaultingGroup(scripted.cfg, 4, store), scripted.events, faults=faults, fault_store=store, clock=clock)
    assert _run(ctrl)[-1] is State.FINISHED
    (failure,) = build_report(ctrl)["failures"]
    by_rank = {e["rank"]: e["fault_id"] for e in ctrl.events.of("fault_injected")}
    assert failure["fault_id"] == by_rank[failure["culprit"]]  # its own fault: the one that hit its culprit
    assert sorted(failure["fault_ids"]) == sorted(by_rank.values()) and failure["fault_ids"][0] == failure["fault_id"]


class TornDownAsItFires(FaultingGroup):
    """The first teardown finds `firing`'s rank firing it: its signal lands in the store as the generation ends."""

    def __init__(self, cfg, capacity: int, store: SignalStore, firing: Fault):
        super().__init__(cfg, capacity, store)
        self.firing, self.armed = firing, []

    def start(self, layout, specs, **kwargs) -> None:
        super().start(layout, specs, **kwargs)
        self.armed.append([f["id"] for f in specs[0]["faults"]])

    def teardown(self, kill_ranks=(), grace_s: float = 1.0) -> int:
        if self.firing is not None:
            _fault_signal(self.store, self.firing, self.step)
            self.firing = None
        return super().teardown(kill_ranks, grace_s)


def test_a_fault_that_fires_as_its_generation_is_torn_down_is_not_armed_again(tmp_path):
    # The chaos run's seed 16: two faults due at the same step, one rank's death tore the generation down while the
    # other rank was firing its own; the next generation got that fault again and it fired twice.
    scripted, _, clock = _setup(tmp_path, **{"training.steps": 16, "checkpoint.every_steps": 8})
    scripted.checkpoints.close()  # only its config, event log and clock are used
    store = SignalStore()
    faults = parse_faults(["kill:rank=1,step=10", "kill:rank=2,step=12"], steps=16, max_world=4)
    group = TornDownAsItFires(scripted.cfg, 4, store, firing=faults[1])
    ctrl = Controller(scripted.cfg, group, scripted.events, faults=faults, fault_store=store, clock=clock)
    assert _run(ctrl)[-1] is State.FINISHED
    assert group.armed == [[faults[0].id, faults[1].id], []]
    assert sorted(e["fault_id"] for e in ctrl.events.of("fault_injected")) == sorted(f.id for f in faults)
    # Heard of after rank 1's failure was recorded, rank 2's fault is part of it (make chaos seed 34: it was left to
    # the next failure, 1.6 s on, and read as detected that late).
    (failure,) = build_report(ctrl)["failures"]
    assert failure["fault_ids"] == [faults[0].id, faults[1].id]


def test_a_fault_injected_at_step_20_is_reported_at_step_20(tmp_path):
    """The README's convention: a fault at step 20 fires once 20 steps are done, and every record of it says 20."""
    scripted, _, clock = _setup(tmp_path, **{"training.steps": 24, "checkpoint.every_steps": 8})
    scripted.checkpoints.close()  # only its config, event log and clock are used
    store = SignalStore()
    faults = parse_faults(["kill:rank=1,step=20"], steps=24, max_world=4)
    ctrl = Controller(scripted.cfg, FaultingGroup(scripted.cfg, 4, store), scripted.events, faults=faults, fault_store=store, clock=clock)
    assert _run(ctrl)[-1] is State.FINISHED
    first_generation = [e["step"] for e in ctrl.events.of("step") if e["generation"] == 1]
    assert first_generation == list(range(1, 21))  # 20 steps done when rank 1 died
    (injected,) = ctrl.events.of("fault_injected")
    assert injected["step"] == injected["at_step"] == 20
    report = build_report(ctrl)
    assert [(f["step"], f["rank"]) for f in report["faults"]] == [(20, 1)]
    (failure,) = report["failures"]
    assert (failure["kind"], failure["step"], failure["fault_step"]) == ("kill", 20, 20)
    assert (failure["resume_step"], failure["lost_steps"]) == (16, 4)
    # The scripted ranks save synchronously (no stall of their own): each commit's stall is its 0.01 s save.
    assert report["checkpoints_committed"] == [8, 16, 24]
    assert report["checkpoint_stall_s"] == pytest.approx(0.03)
    assert report["checkpoint_commit_s"] > 0
    _ledger_clean(ctrl)


def test_step_records_a_memory_snapshot_carries_complete_the_steps_a_lost_node_took_with_it(tmp_path):
    # Ranks 2 and 3's records of steps 3 and 4 died with their node; their snapshot of step 5 carries them. Counting
    # them completes those steps once each (records the controller already counted are not counted again).
    ctrl, group, _ = _setup(tmp_path)
    ctrl.step()  # start
    for _ in range(3):
        ctrl.step()  # steps 0-2 complete on every rank
    assert ctrl.completed_step == 2
    carried = {}
    for r in range(4):
        recs = []
        for s in (2, 3, 4):
            rec = {"kind": "step", "step": s, "t_start": 0.0, "t_end": 0.01, "grad_norm": 1.0}
            if ctrl.layout.is_data_reporter(r):
                rec.update(loss_sum=1.0, samples=group.sampler.rank_indices(s, ctrl.layout.dp_rank(r), ctrl.layout.dp), data_digest=0)
            recs.append(rec)
        carried[r] = recs
    for r in (0, 1):  # the surviving node's ranks reported step 3 already
        ctrl._on_step_record(r, carried[r][1], 0.0)
    assert not ctrl._fill_step_records({r: carried[r][:2] for r in range(4)}, upto=5)  # step 4's records are not all there
    assert ctrl.completed_step == 3
    assert ctrl._fill_step_records(carried, upto=5) and ctrl.completed_step == 4
    assert sorted(ctrl.losses) == [0, 1, 2, 3, 4]
    expected = [i for s in range(5) for i in ctrl.sampler.global_indices(s)]
    assert ctrl.ledger.summary(expected) == {"expected": len(expected), "seen_once": len(expected), "duplicated": 0, "missing": 0}
