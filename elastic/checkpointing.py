"""Checkpoint coordination for the controller: commits, their deadlines, retention, the memory tier, and the restore point.

Each rank writes its own shards and reports its index rows; once every rank
of the current generation has reported a step, the coordinator commits it
(index, then manifest) off the controller's loop and applies retention. A
commit runs on a daemon thread and has a deadline (`checkpoint.commit_timeout_s`):
a commit stuck on a dead mount is abandoned with its thread, reported, and
never wedges the controller, whose deadlines must keep running. An abandoned
commit is fenced: should the storage come back, it publishes no manifest and
runs no retention (its view of the saves in progress is stale by then). The
recovery path's storage work (the restore point, a corrupt fault) has the same
deadline (`call_bounded`). When commits
keep failing and no checkpoint has committed for
`checkpoint.max_uncommitted_s`, `overdue()` names the reason the job must
fail rather than train on with nothing to fall back to.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import storage
from elastic.config import JobConfig
from elastic.events import EventLog


@dataclass
class _Commit:
    """Storage work for the committer thread: a commit, or a call of the recovery path (`call_bounded`)."""

    info: dict
    future: Future
    started: float | None = None  # when the committer thread began it (monotonic)
    abandoned: bool = False  # set at its deadline: from then on it must change nothing in the storage


class _SerialRunner:
    """Runs calls one at a time, in order, on a daemon thread; a call that overruns is abandoned with its thread.

    A stuck thread (a write on a dead mount) cannot be stopped, only left
    behind: `abandon(commit)` fences the call it is stuck in and hands the
    queue to a fresh thread; the stuck one, should it ever return, takes
    nothing more from the queue.
    """

    def __init__(self, name: str):
        self._name = name
        self._queue: collections.deque[tuple[_Commit, Callable, tuple]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._epoch = 0
        self._closed = False
        self._start_thread()

    def _start_thread(self) -> None:
        threading.Thread(target=self._loop, args=(self._epoch,), name=f"{self._name}-{self._epoch}", daemon=True).start()

    def submit(self, commit: _Commit, fn: Callable, *args) -> None:
        with self._lock:
            self._queue.append((commit, fn, args))
            self._wake.notify()

    def abandon(self, commit: _Commit) -> None:
        """Give up on `commit`, the call running now: mark it abandoned (its own checks fence it) and carry on without it."""
        with self._lock:
            commit.abandoned = True
            self._epoch += 1
            self._start_thread()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    def _loop(self, epoch: int) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed and epoch == self._epoch:
                    self._wake.wait()
                if epoch != self._epoch or not self._queue:
                    return
                commit, fn, args = self._queue.popleft()
                commit.started = time.monotonic()
            if not commit.future.set_running_or_notify_cancel():
                continue
            try:
                commit.future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reaps the commit
                commit.future.set_exception(exc)


class CheckpointCoordinator:
    """The durable tier of one job: rows in, commits out, with deadlines and retention."""

    def __init__(self, cfg: JobConfig, events: EventLog, train_state: Callable[[int], dict], clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.uri = cfg.checkpoint.uri
        self.events = events
        self.train_state = train_state
        self.clock = clock
        self.last_committed: int | None = None
        self._rows: dict[int, dict[int, dict]] = {}  # step -> rank -> its "saved" record
        self._commits: list[_Commit] = []  # submitted, oldest first
        self._runner = _SerialRunner("commit")
        self._last_success = clock()
        self._failing_since: float | None = None  # the first failed commit since the last success
        self._last_error = ""
        self.memory = MemoryTier(cfg, events)

    # -- rows in -----------------------------------------------------------------------
    def begin_generation(self) -> None:
        """A new generation: rows reported by the previous one can never complete a commit."""
        self._rows.clear()

    def on_saved(self, rank: int, rec: dict, layout: dict, world_size: int, generation: int) -> None:
        """One rank's rows of a step; the last rank of the generation to report submits the commit."""
        step = rec["step"]
        ranks = self._rows.setdefault(step, {})
        ranks[rank] = rec
        if len(ranks) < world_size:
            return
        del self._rows[step]
        rows = [row for r in sorted(ranks) for row in ranks[r]["rows"]]
        stalls = [r["stall_s"] for r in ranks.values() if r.get("stall_s") is not None]
        save_s = max(r["save_s"] for r in ranks.values())
        info = {"step": step, "save_s": save_s, "stall_s": max(stalls) if stalls else save_s, "generation": generation,
                "bytes": sum(row["nbytes"] for row in rows)}
        commit = _Commit(info, Future())
        self._commits.append(commit)
        self._runner.submit(commit, self._commit, commit, rows, layout, self.train_state(step), self.in_progress())

    def in_progress(self) -> set[int]:
        """Steps whose save is under way: rows still arriving, or a commit not yet done."""
        return set(self._rows) | {c.info["step"] for c in self._commits}

    def _commit(self, commit: _Commit, rows: list[dict], layout: dict, train_state: dict, in_progress: set[int]) -> float:
        """Runs on the committer thread: everything it needs was taken on the controller's thread when the rows came in.

        Once abandoned (its deadline passed, the step is reported failed) it is
        fenced: no manifest is published, and no retention runs with an
        `in_progress` that may no longer name the saves under way.
        """
        t0 = time.perf_counter()
        step = commit.info["step"]
        storage.commit(self.uri, step, rows, generation=commit.info["generation"], layout=layout, train_state=train_state,
                       publish_if=lambda: not commit.abandoned)
        if not commit.abandoned:
            storage.retain(self.uri, self.cfg.checkpoint.keep, in_progress=in_progress - {step})
        return time.perf_counter() - t0

    # -- commits out ---------------------------------------------------------------------
    def reap(self, wait: bool = False) -> list[dict]:
        """Record the commits that ended, oldest first (with `wait`, each gets until its deadline); returns the committed ones."""
        done = []
        while self._commits:
            commit = self._commits[0]
            if wait and not commit.future.done():
                self._wait(commit)
            if commit.future.done():
                self._commits.pop(0)
                done += self._finish(commit)
            elif self._overran(commit):
                self._commits.pop(0)
                self._runner.abandon(commit)
                self._failed(commit, f"did not finish within checkpoint.commit_timeout_s={self.cfg.checkpoint.commit_timeout_s}s "
                                     "(the checkpoint storage is not answering); abandoned")
            else:
                break
        return done

    def _wait(self, commit: _Commit) -> None:
        limit = self.cfg.checkpoint.commit_timeout_s
        while not commit.future.done():
            if commit.started is not None:
                left = limit - (time.monotonic() - commit.started)
                if left <= 0:
                    return
                _wait_future(commit.future, left)
            else:  # still queued behind an earlier commit that is itself bounded
                _wait_future(commit.future, 0.05)

    def _overran(self, commit: _Commit) -> bool:
        return commit.started is not None and time.monotonic() - commit.started > self.cfg.checkpoint.commit_timeout_s

    def _finish(self, commit: _Commit) -> list[dict]:
        try:
            commit_s = commit.future.result()
        except Exception as exc:  # noqa: BLE001 - the job goes on with the previous checkpoint
            self._failed(commit, f"{type(exc).__name__}: {exc}")
            return []
        self.last_committed = commit.info["step"]
        self._last_success, self._failing_since = self.clock(), None
        info = {**commit.info, "commit_s": commit_s}
        self.events.emit("checkpoint_committed", **info)
        return [info]

    def _failed(self, commit: _Commit, error: str) -> None:
        self._failing_since = self._failing_since or self.clock()
        self._last_error = error
        self.events.emit("checkpoint_commit_failed", step=commit.info["step"], error=error)

    def overdue(self) -> str | None:
        """Why the job must fail: commits have failed and none has succeeded for `checkpoint.max_uncommitted_s`; else None."""
        limit = self.cfg.checkpoint.max_uncommitted_s
        if not limit or self._failing_since is None or self.clock() - self._last_success <= limit:
            return None
        return (f"no checkpoint committed for {self.clock() - self._last_success:.0f}s (checkpoint.max_uncommitted_s={limit}); "
                f"last error: {self._last_error}")

    # -- restoring -------------------------------------------------------------------------
    def restore_point(self, group=None, upto: int | None = None, fill: Callable | None = None) -> RestorePoint:
        """Where a recovery resumes: the newest memory step that survives whole (with the memory tier, asking `group`'s
        agents), unless the newest durable checkpoint that verifies is newer; every newer one that does not is a
        `checkpoint_skipped` event. No durable checkpoint counts when the storage does not answer within the deadline
        (`call_bounded`)."""
        skipped: list[tuple[int, str]] = []  # filled on the committer thread, emitted on this one
        step = self.call_bounded("finding the restore point", storage.latest_valid, self.uri, on_skip=lambda *skip: skipped.append(skip))
        for skip_step, reason in list(skipped):
            self.events.emit("checkpoint_skipped", step=skip_step, reason=str(reason))
        if self.last_committed is None:
            self.last_committed = step  # a job that resumes starts from a committed checkpoint
        if self.memory.enabled and group is not None:
            point = self.memory.find(group, step, self.train_state, upto, fill)
            if point is not None:
                return point
        return RestorePoint(step, "none" if step is None else "durable")

    def call_bounded(self, what: str, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` on the committer thread, given `checkpoint.commit_timeout_s` from now; None when it overran.

        For the storage work of the recovery path, which the controller's
        thread waits for: a dead mount must not wedge it there either. A call
        that overruns is abandoned like a commit, and a `warning` event (kind
        `checkpoint_unreachable`) names `what` and why; the caller goes on as
        if no checkpoint were reachable. Its errors are raised here.
        """
        call = _Commit({"call": what}, Future())
        self._runner.submit(call, functools.partial(fn, *args, **kwargs))
        limit = self.cfg.checkpoint.commit_timeout_s
        _wait_future(call.future, limit)
        if call.future.done():
            return call.future.result()
        if not call.future.cancel():  # it is running: left behind on its thread
            self._runner.abandon(call)
        self.events.emit("warning", kind="checkpoint_unreachable",
                         message=f"{what} did not finish within checkpoint.commit_timeout_s={limit}s (the checkpoint storage is not "
                                 "answering); abandoned: going on as if no checkpoint were reachable")
        return None

    def close(self) -> None:
        """Give the commits in flight until their deadlines, then stop (a stuck one is left behind on its daemon thread)."""
        self.reap(wait=True)
        self._runner.close()
        self.memory.close()


def _wait_future(future: Future, timeout_s: float) -> None:
    try:
        future.exception(timeout=timeout_s)
    except TimeoutError:
        pass


@dataclass
class RestorePoint:
    """Where a (re)start resumes: a step of a tier, or nothing (from scratch)."""

    step: int | None
    tier: str  # "memory", "durable" or "none"
    memory: dict | None = None  # a memory restore's plan for the worker group (`MemoryTier.find`)


class MemoryTier:
    """The memory tier of one job, on the controller's side: which memory steps are whole, and what a restore gathers.

    Ranks snapshot into their node's memory (`elastic.memory`) and the
    agents replicate each file to the next node; a rank's record of a
    snapshot reaches the controller once its replica is in place. A step is
    committed once every rank of the generation has reported it: the agents
    then drop older snapshots (`RayWorkerGroup.memory_floor`). A restore does
    not trust that view, which a lost record can leave behind: it asks the
    surviving agents what they hold, takes the newest step whose every rank's
    file survives somewhere (on its own node or as a replica), checks those
    files' checksums, and plans which node pulls what.
    """

    def __init__(self, cfg: JobConfig, events: EventLog):
        self.enabled = cfg.checkpoint.memory
        self.replicas = cfg.checkpoint.memory_replicas
        self.events = events
        self.committed: int | None = None  # of the current generation
        self.worlds: dict[int, int] = {}  # generation -> world size
        self.layouts: dict[int, dict] = {}
        self._saved: dict[int, dict[int, dict]] = {}  # step -> rank -> record
        self._generation = 0
        self._origin: tuple[int, int] | None = None
        self._failing: dict[int, dict] = {}  # rank -> its current run of failed snapshots (`on_failed`)

    def begin_generation(self, generation: int, layout: dict, world_size: int, origin: tuple[int, int] | None = None,
                         resume_step: int | None = None) -> None:
        """A new generation; `origin` is the (generation, step) of the memory snapshot it was restored from, if it was.

        A generation resumed from the durable checkpoint of step s (`resume_step`)
        has the generation before's memory snapshot of s as its origin: where
        that is whole, that generation got to s on the same history (a planned
        resize stops every rank at s, saves it and restarts there), so it is
        the same state, and a restore point when the checkpoint of s breaks
        before the new generation has a snapshot of its own.
        """
        self.close()
        if origin is None and resume_step is not None:
            origin = (self._generation, resume_step)
        self._generation, self._origin = generation, origin
        self.worlds[generation], self.layouts[generation] = world_size, layout
        self._saved.clear()
        self.committed = None

    def on_failed(self, rank: int, rec: dict) -> None:
        """A rank's snapshot that failed, or whose replica did not come in time.

        The first of a run of failures is a warning; the rest are counted,
        and the run's end (the rank's next snapshot, a new generation, the
        job's end) is one `memory_snapshots_failed` event with the count: a
        full memory directory fails every snapshot of every rank, which must
        not be a warning per rank and step.
        """
        run = self._failing.get(rank)
        if run is not None:
            run["last_step"], run["failed"] = rec["step"], run["failed"] + 1
            return
        self._failing[rank] = {"first_step": rec["step"], "last_step": rec["step"], "failed": 1, "error": rec["error"]}
        self.events.emit("warning", kind="memory_snapshot_failed", rank=rank, step=rec["step"],
                         message=f"rank {rank}'s memory snapshot of step {rec['step']}: {rec['error']} (the same rank's "
                                 "failures that follow are counted in one memory_snapshots_failed event, not repeated)")

    def _end_failures(self, rank: int) -> None:
        if (run := self._failing.pop(rank, None)) is not None:
            self.events.emit("memory_snapshots_failed", rank=rank, generation=self._generation, **run)

    def close(self) -> None:
        """End every rank's run of failed snapshots (the generation or the job ends)."""
        for rank in sorted(self._failing):
            self._end_failures(rank)

    def on_saved(self, rank: int, rec: dict) -> int | None:
        """One rank's snapshot of a step (replicated or not); returns the step when this record commits it."""
        self._end_failures(rank)
        step = rec["step"]
        ranks = self._saved.setdefault(step, {})
        ranks[rank] = rec
        if len(ranks) < self.worlds[self._generation]:
            return None
        del self._saved[step]
        for older in [s for s in self._saved if s < step]:
            del self._saved[older]  # a step whose records never all came is overtaken
        failed = sorted(r for r, rec in ranks.items() if rec.get("replica_error"))
        self.committed = step
        self.events.emit(
            "memory_committed", step=step, generation=self._generation, bytes=sum(r["bytes"] for r in ranks.values()),
            replicated=all(rec.get("replicated") for rec in ranks.values()), save_s=max(r["save_s"] for r in ranks.values()),
            **({"unreplicated_ranks": failed} if failed else {}),
        )
        return step

    def find(self, group, newer_than: int | None, train_state: Callable[[int], dict], upto: int | None = None,
             fill: Callable[[dict[int, list[dict]], int], bool] | None = None) -> RestorePoint | None:
        """The newest memory step newer than (or as new as) `newer_than` that survives whole and verifies, with its
        staging plan.

        `upto` is the newest step whose every record (losses, samples) the controller holds: a snapshot can be
        whole before the step's records reach the controller (a node loss takes its ranks' last ones with it),
        and restoring past them would leave those steps out of the report and the sample ledger. A step past
        `upto` is taken only when `fill(records, step)` completes the controller's records of the steps before
        it from the records its files carry (`NodeMemory.step_records`).
        """
        held: dict[tuple[int, int], dict[int, dict[str, list[dict]]]] = {}  # (generation, step) -> rank -> node -> rows
        for node, inventory in group.memory_inventory().items():
            for key, ranks in inventory.items():
                for rank, rows in ranks.items():
                    held.setdefault(key, {}).setdefault(rank, {})[node] = rows
        # Only this generation's snapshots, and the one it was restored from, are on the history the ledger
        # and the data position follow (a snapshot of a generation that a durable fallback rolled back is not).
        ours = [key for key in held if key[0] == self._generation or key == self._origin]
        whole = sorted((key for key in ours if len(held[key]) == self.worlds[key[0]]), key=lambda k: (k[1], k[0]), reverse=True)
        for generation, step in whole:
            if newer_than is not None and step < newer_than:
                return None  # the durable checkpoint is newer
            holders = self._verified_holders(group, step, held[(generation, step)])
            if holders is None:
                continue
            if upto is not None and step > upto and (fill is None or not fill(group.memory_records(generation, step, holders), step)):
                continue
            ranks = held[(generation, step)]
            return RestorePoint(step, "memory", {
                "step": step, "generation": generation, "holders": holders,
                "rows": {rank: next(iter(by_node.values())) for rank, by_node in ranks.items()},
                "layout": self.layouts[generation], "train_state": train_state(step),
            })
        self.events.emit("memory_restore_unavailable", reason=self._why_none(held, ours, whole))
        return None

    def _why_none(self, held: dict, ours: list, whole: list) -> str:
        if whole:
            return f"no memory step survives whole with every file intact (tried steps {[s for _, s in whole]}); using the durable tier"
        partial = [(s, g) for g, s in ours]
        if not partial:
            return "no node holds a memory snapshot; using the durable tier"
        step, generation = max(partial)
        missing = sorted(set(range(self.worlds[generation])) - set(held[(generation, step)]))
        return (f"the newest memory step, {step}, lacks ranks {missing} on every node left (lost with their node and the node "
                "holding its replicas); using the durable tier")

    def _verified_holders(self, group, step: int, ranks: dict[int, dict[str, list[dict]]]) -> dict[int, str] | None:
        """A node per rank whose copy of the file verifies; None (and an event per bad copy) when some rank has none."""
        bad = group.memory_verify(step, _by_node(ranks))
        for (node, rank), why in sorted(bad.items()):
            self.events.emit("memory_snapshot_skipped", step=step, rank=rank, node=node, reason=why)
        holders = {}
        for rank, by_node in ranks.items():
            good = [node for node in sorted(by_node) if (node, rank) not in bad]
            if not good:
                return None
            holders[rank] = good[0]
        return holders


def _by_node(ranks: dict[int, dict[str, list[dict]]]) -> dict[str, dict[int, list[dict]]]:
    out: dict[str, dict[int, list[dict]]] = {}
    for rank, by_node in ranks.items():
        for node, rows in by_node.items():
            out.setdefault(node, {})[rank] = rows
    return out
