"""Checkpoint coordination for the controller: commits, their deadlines, retention, and the restore point.

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
    def restore_point(self) -> int | None:
        """The newest committed checkpoint that verifies; every newer one that does not is a `checkpoint_skipped` event.

        None also when the storage does not answer within the deadline (`call_bounded`).
        """
        skipped: list[tuple[int, str]] = []  # filled on the committer thread, emitted on this one
        step = self.call_bounded("finding the restore point", storage.latest_valid, self.uri, on_skip=lambda *skip: skipped.append(skip))
        for skip_step, reason in list(skipped):
            self.events.emit("checkpoint_skipped", step=skip_step, reason=str(reason))
        if self.last_committed is None:
            self.last_committed = step  # a job that resumes starts from a committed checkpoint
        return step

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


def _wait_future(future: Future, timeout_s: float) -> None:
    try:
        future.exception(timeout=timeout_s)
    except TimeoutError:
        pass
