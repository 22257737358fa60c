"""The controller's checkpoint coordinator: commits have deadlines, and a job whose commits keep failing fails with the reason.

The stuck storage is real: the step's index file is a named pipe that nobody
reads, so the commit's write blocks in the kernel the way a write on a dead
mount does.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from test_controller_steps import _run, _setup

import storage
from elastic.checkpointing import CheckpointCoordinator
from elastic.config import load_config
from elastic.controller import State
from elastic.events import EventLog


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
