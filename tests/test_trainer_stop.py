"""A rank told to stop while its background save is writing: `Trainer.run` returns only once that save's data file is whole.

A process kept warm for the next generation must never write behind it. The
real `Trainer` runs here on a gloo world of one (a TCPStore on 127.0.0.1);
the data file's write is held, the way slow storage holds it, and the stop
comes while it is held.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

import storage
from distributed import free_port, run_distributed
from elastic.config import load_config
from elastic.layout import Layout
from elastic.train import Progress, RankSpec, Trainer
from storage.format import step_dir


def test_run_waits_for_the_background_write_in_flight_when_told_to_stop(tmp_path, monkeypatch):
    uri = str(tmp_path / "ckpt")
    cfg = load_config(None, [f"checkpoint.uri={uri}", "checkpoint.async_save=true", "checkpoint.every_steps=2", "training.steps=50",
                             "training.global_batch=4", "training.micro_batch=4", "scaling.num_workers=1"])
    spec = RankSpec(config=cfg.model_dump(mode="json"), layout=Layout().as_dict(), rank=0, generation=1)
    progress = Progress()
    writing, release = threading.Event(), threading.Event()
    write = storage.fs.Store.write

    def held_write(self, rel, buffers, durable=True):  # the first data file: stop the trainer, then write once released
        if rel.endswith(".bin") and not writing.is_set():
            trainer.stop.set()
            writing.set()
            release.wait(30)
        return write(self, rel, buffers, durable=durable)

    monkeypatch.setattr(storage.fs.Store, "write", held_write)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        trainer = Trainer(spec, progress)
        returned = []
        runner = threading.Thread(target=lambda: returned.append(trainer.run()), daemon=True)
        runner.start()
        assert writing.wait(30)
        runner.join(0.5)
        assert runner.is_alive(), "run() returned with the save's write still held"
        release.set()  # the storage answers
        runner.join(30)
        assert returned == [False]  # stopped, not finished
    finally:
        release.set()
        dist.destroy_process_group()
    saved = [r for r in progress.drain() if r["kind"] == "saved"]
    assert saved and saved[0]["step"] == 2, saved
    for record in saved:  # every save reported by then is whole on disk
        (rel,) = {row["file"] for row in record["rows"]}
        size = os.path.getsize(os.path.join(uri, step_dir(record["step"]), rel))
        assert size == record["rows"][0]["file_bytes"] > 0


def _told_apart(rank: int, world: int, uri: str) -> dict:
    """A real Trainer on one rank of a gloo world of 2; only rank 0 is told to stop after step 3 (rank 1's message
    is late, as a planned resize's can be, reaching ranks at their own moments)."""
    cfg = load_config(None, [f"checkpoint.uri={uri}", "checkpoint.every_steps=100", "training.steps=50",
                             "training.global_batch=4", "training.micro_batch=2", f"scaling.num_workers={world}"])
    spec = RankSpec(config=cfg.model_dump(mode="json"), layout=Layout(dp_shard=world).as_dict(), rank=rank, generation=1)
    progress = Progress()
    trainer = Trainer(spec, progress)
    if rank == 0:
        trainer.control.stop_at = 3
    finished = trainer.run()
    records = progress.drain()
    return {"finished": finished, "paused": [r["step"] for r in records if r["kind"] == "paused"],
            "saved": [r["step"] for r in records if r["kind"] == "saved"]}


def test_ranks_told_to_stop_at_different_moments_stop_after_the_same_step(tmp_path):
    # Once, a rank that heard of a resize a step later than its peer went on into the next step and waited in its
    # collectives for 2 minutes (the process-group timeout) for a peer that had stopped and saved.
    results = run_distributed(_told_apart, 2, str(tmp_path / "ckpt"))
    assert results == [{"finished": False, "paused": [3], "saved": [3]}] * 2
