"""The controller's checkpoint coordinator: commits have deadlines, and a job whose commits keep failing fails with the reason.

The stuck storage is real: the step's index file is a named pipe that nobody
reads, so the commit's write blocks in the kernel the way a write on a dead
mount does.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from test_controller_steps import _run, _setup

import storage
from elastic.checkpointing import CheckpointCoordinator
from elastic.config import load_config
from elastic.controller import State
from elastic.events import EventLog
from elastic.faults import Fault


def _stuck_index(uri: str, step: int) -> str:
    """Make the index file of `step` a FIFO: opening it for writing blocks until someone reads it."""
    path = os.path.join(uri, f"step_{step:08d}", "index.arrow")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    return path


def _unblock(path: str) -> None:
    """Let an abandoned commit thread finish: open the FIFO's reading end and drain it."""
    def drain():
        try:
            with open(path, "rb") as f:
                while f.read(1 << 16):
                    pass
        except FileNotFoundError:
            pass
    threading.Thread(target=drain, daemon=True).start()


def _saved(uri: str, step: int, rank: int) -> dict:
    rows = storage.write_shards(uri, step, rank, {f"model.r{rank}": torch.full((3,), float(step))}, generation=1)
    return {"kind": "saved", "step": step, "rows": rows, "save_s": 0.01}


def test_a_stuck_commit_is_abandoned_at_its_deadline(tmp_path):
    uri = str(tmp_path / "ckpt")
    cfg = load_config(None, [f"checkpoint.uri={uri}", "checkpoint.commit_timeout_s=0.5", "checkpoint.max_uncommitted_s=0.2"])
    events = EventLog(tmp_path / "events.jsonl")
    ckpt = CheckpointCoordinator(cfg, events, lambda step: {"step": step})
    fifo = _stuck_index(uri, 4)
    try:
        for rank in range(2):
            ckpt.on_saved(rank, _saved(uri, 4, rank), {"dp_shard": 2}, 2, 1)
        assert ckpt.in_progress() == {4}
        t0 = time.monotonic()
        assert ckpt.reap(wait=True) == []
        assert 0.4 < time.monotonic() - t0 < 5.0
        (failed,) = events.of("checkpoint_commit_failed")
        assert failed["step"] == 4 and "commit_timeout_s" in failed["error"]
        assert ckpt.in_progress() == set() and ckpt.last_committed is None
        _unblock(fifo)  # the abandoned thread may now finish; nothing waits for it
        time.sleep(0.3)
        assert "max_uncommitted_s" in (ckpt.overdue() or "")
        # The next commit runs on a fresh thread, not behind the stuck one, and clears the alarm.
        for rank in range(2):
            ckpt.on_saved(rank, _saved(uri, 8, rank), {"dp_shard": 2}, 2, 1)
        assert [c["step"] for c in ckpt.reap(wait=True)] == [8]
        assert ckpt.last_committed == 8 and ckpt.overdue() is None
    finally:
        _unblock(fifo)
        ckpt.close()


def test_a_job_whose_commits_keep_failing_fails_with_the_reason(tmp_path):
    ctrl, group, clock = _setup(tmp_path, **{"training.steps": 40, "checkpoint.commit_timeout_s": 0.3, "checkpoint.max_uncommitted_s": 0.1})
    fifos = [_stuck_index(ctrl.cfg.checkpoint.uri, step) for step in range(4, 41, 4)]
    try:
        for _ in range(400):
            if ctrl.step() is State.FAILED:
                break
            time.sleep(0.01)  # real time for the commit deadlines; the scripted clock moves on with each step
        assert ctrl.state is State.FAILED, ctrl.state
        assert "no checkpoint committed" in ctrl.failed_reason and "max_uncommitted_s" in ctrl.failed_reason
        assert "commit_timeout_s" in ctrl.failed_reason  # the last error says why
        assert ctrl.completed_step < 39  # it stopped training, not at the end
    finally:
        for fifo in fifos:
            _unblock(fifo)
        ctrl.checkpoints.close()


def test_a_run_whose_last_checkpoint_does_not_commit_is_not_finished(tmp_path):
    ctrl, group, _ = _setup(tmp_path, **{"checkpoint.commit_timeout_s": 0.3, "checkpoint.max_uncommitted_s": 0})
    fifo = _stuck_index(ctrl.cfg.checkpoint.uri, 12)
    try:
        assert _run(ctrl)[-1] is State.FAILED
        assert "final checkpoint" in ctrl.failed_reason and "12" in ctrl.failed_reason
        assert ctrl.last_committed == 8
    finally:
        _unblock(fifo)
        ctrl.checkpoints.close()


def _stall(monkeypatch, owner, name: str, when) -> tuple[threading.Event, threading.Event]:
    """Make `owner.name` block, the way a call on a dead mount does, when `when(*args)` holds, until the test releases it.

    Returns (stalled, release): set once a call is held, and what lets it go on (the storage comes back).
    """
    real = getattr(owner, name)
    stalled, release = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        if when(*args):
            stalled.set()
            release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return stalled, release


_STALLS = {
    # where the commit of step 4 is when its deadline passes
    "writing the index": (storage.fs.Store, "write", lambda store, rel, *_: rel.endswith("index.arrow")),
    "writing the manifest": (storage.fs, "_write_local", lambda fd, name, *_: name.startswith(".manifest.json")),
    "syncing after the manifest": (storage.fs.Store, "sync_dir", lambda store, *_: True),
}


@pytest.mark.parametrize("where", list(_STALLS))
def test_an_abandoned_commit_changes_nothing_when_the_storage_comes_back(tmp_path, monkeypatch, where):
    """Storage that answers again after the deadline: the abandoned commit publishes no manifest it had not begun, and runs no retention.

    Retention with its stale view of the saves in progress (keep=1) would delete step 2, the newest checkpoint that committed.
    """
    uri = str(tmp_path / "ckpt")
    _commit_directly(uri, 2)
    cfg = load_config(None, [f"checkpoint.uri={uri}", "checkpoint.commit_timeout_s=0.5", "checkpoint.keep=1"])
    events = EventLog(tmp_path / "events.jsonl")
    ckpt = CheckpointCoordinator(cfg, events, lambda step: {"step": step})
    owner, name, when = _STALLS[where]
    stalled, release = _stall(monkeypatch, owner, name, when)
    try:
        for rank in range(2):
            ckpt.on_saved(rank, _saved(uri, 4, rank), {"dp_shard": 2}, 2, 1)
        abandoned = ckpt._commits[0].future
        assert stalled.wait(10)
        assert ckpt.reap(wait=True) == []
        (failed,) = events.of("checkpoint_commit_failed")
        assert failed["step"] == 4 and "abandoned" in failed["error"]
        release.set()  # the storage answers again
        error = abandoned.exception(timeout=10)
        steps = [c["step"] for c in storage.list_checkpoints(uri)]
        if where == "syncing after the manifest":  # published before the deadline; only its retention is fenced
            assert error is None and steps == [4, 2]
        else:
            assert "called off before its manifest was published" in str(error) and steps == [2]
        assert storage.latest_valid(uri) == (4 if where == "syncing after the manifest" else 2)
    finally:
        release.set()
        ckpt.close()


def _commit_directly(uri: str, step: int) -> None:
    rows = storage.write_shards(uri, step, 0, {"model.r0": torch.full((3,), float(step))}, generation=1)
    storage.commit(uri, step, rows, generation=1, layout={"dp_shard": 1}, train_state={"step": step})


def _stuck_manifest(uri: str, step: int) -> str:
    """A committed-looking step whose manifest is a FIFO: reading it blocks until someone writes, as on a dead mount."""
    path = os.path.join(uri, f"step_{step:08d}", "manifest.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    return path


def _release_reader(path: str) -> None:
    """Let a reader blocked on the FIFO go on: it reads an empty (garbled) manifest."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)


def test_the_restore_point_is_found_within_the_deadline_or_is_none(tmp_path):
    uri = str(tmp_path / "ckpt")
    _commit_directly(uri, 4)
    cfg = load_config(None, [f"checkpoint.uri={uri}", "checkpoint.commit_timeout_s=0.5"])
    events = EventLog(tmp_path / "events.jsonl")
    ckpt = CheckpointCoordinator(cfg, events, lambda step: {"step": step})
    fifo = _stuck_manifest(uri, 8)
    try:
        t0 = time.monotonic()
        assert ckpt.restore_point().tier == "none"
        assert 0.4 < time.monotonic() - t0 < 5.0
        (warning,) = events.of("warning")
        assert warning["kind"] == "checkpoint_unreachable" and "finding the restore point" in warning["message"]
        assert "commit_timeout_s=0.5" in warning["message"]
        _release_reader(fifo)
        os.unlink(fifo)
        with open(fifo, "w") as f:  # the storage answers again: step 8's manifest is garbled
            f.write("{")
        # The next search runs on a fresh thread; step 8 is skipped, with the reason, on the controller's thread.
        assert ckpt.restore_point().step == 4
        (skipped,) = events.of("checkpoint_skipped")
        assert skipped["step"] == 8 and "manifest" in skipped["reason"]
    finally:
        ckpt.close()


def test_a_corrupt_fault_on_storage_that_does_not_answer_does_not_wedge_the_recovery(tmp_path):
    ctrl, _, _ = _setup(tmp_path, **{"checkpoint.commit_timeout_s": 0.5})
    uri = ctrl.cfg.checkpoint.uri
    _commit_directly(uri, 4)
    fifo = _stuck_manifest(uri, 8)
    ctrl.faults = [Fault(id=0, kind="corrupt", step=0)]
    ctrl.completed_step = 4
    try:
        t0 = time.monotonic()
        ctrl._corrupt_newest()
        assert time.monotonic() - t0 < 5.0
        (injected,) = ctrl.events.of("fault_injected")
        assert injected["kind"] == "corrupt" and injected["target"] is None
        assert "corrupting the newest checkpoint" in ctrl.events.of("warning")[0]["message"]
    finally:
        _release_reader(fifo)
        ctrl.checkpoints.close()
