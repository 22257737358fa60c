"""The worker: a Ray actor per rank that hosts the training loop in a thread.

The loop runs in its own thread so the actor keeps answering `poll` and
`stacks` while a step runs or is stuck in a collective. The controller never
waits on a collective: it polls, and tears workers down itself.

`poll(wait_s)` is a long poll: it answers as soon as the loop reports a record
or ends, and otherwise after `wait_s`. Answering at once every time made the
controller re-poll each rank hundreds of times a second, and serving those
calls took CPU and the GIL from the training thread (steps ran ~2x slower on
a 2-core machine).

A worker outlives its generation when it can: after a failure the controller
asks each survivor to `reset`. A survivor whose loop has ended (its collective
failed when the peer died, or it was between steps) drops its process group
and is reused by the next generation, warm: no new process, no imports. One
still stuck after the grace period is killed and replaced.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import ray

from elastic.sched import batch_this_process, normal_this_thread


@ray.remote(max_restarts=0, max_concurrency=4)
class Worker:
    def __init__(self):
        # Everything a generation needs is imported now, while the actor is created, not on the recovery path.
        import torch

        import elastic.train  # noqa: F401

        torch.set_num_threads(max(1, int(os.environ.get("ELASTIC_TORCH_THREADS", "1"))))
        batch_this_process()  # Ray's threads here never preempt the training thread (elastic.sched)
        self._thread: threading.Thread | None = None
        self._control = None
        self._progress = None
        self._error: str | None = None
        self._finished = False
        self._generation = -1

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "gpu_ids": ray.get_gpu_ids(),
        }

    def start(self, spec_dict: dict, store_host: str, store_port: int, timeout_s: float) -> None:
        """Join the generation's process group and train in a background thread."""
        from elastic.train import Control, Progress, RankSpec

        spec = RankSpec(**spec_dict)
        self._generation = spec.generation
        self._control = Control()
        self._progress = Progress()
        self._error, self._finished = None, False
        self._thread = threading.Thread(
            target=self._main, args=(spec, store_host, store_port, timeout_s), name=f"train-g{spec.generation}-r{spec.rank}", daemon=True
        )
        self._thread.start()

    def _main(self, spec, store_host: str, store_port: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        from elastic.train import Trainer

        normal_this_thread()  # started by a Ray thread, which is on SCHED_BATCH
        try:
            store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
            gen_store = dist.PrefixStore(f"gen{spec.generation}", store)
            if spec.device == "cuda":
                torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            backend = "nccl" if spec.device == "cuda" else "gloo"
            world = 1
            for v in spec.layout.values():
                world *= v
            dist.init_process_group(backend, store=gen_store, rank=spec.rank, world_size=world, timeout=timedelta(seconds=timeout_s))
            completed = Trainer(spec, self._progress, fault_store=store, control=self._control).run()
            if not self._control.stop.is_set():
                dist.barrier()
                dist.destroy_process_group()
            self._finished = completed
        except BaseException:  # reported to the controller through poll()
            self._error = traceback.format_exc()
        finally:
            self._progress.changed.set()  # a waiting poll reports the end at once

    @ray.method(enable_task_events=False)  # several calls a second per rank: not worth a record in the GCS each
    def poll(self, wait_s: float = 0.0) -> dict:
        """Current step and phase, new records, and whether the loop ended (finished or failed).

        With `wait_s`, first wait up to that long for a new record or the end of the loop.
        """
        p = self._progress
        if p is not None and wait_s > 0 and not (self._finished or self._error):
            p.changed.wait(wait_s)
        if p is not None:
            p.changed.clear()  # before draining: a record added after this wakes the next poll
        return {
            "generation": self._generation,
            "step": p.step if p else -1,
            "phase": p.phase if p else "idle",
            "phase_s": time.time() - p.phase_since if p else 0.0,
            "records": p.drain() if p else [],
            "finished": self._finished,
            "error": self._error,
        }

    def reset(self, grace_s: float) -> bool:
        """End this generation here: stop the loop, drop the process group. False if the loop is stuck."""
        import torch.distributed as dist

        if self._control is not None:
            self._control.stop.set()
        if self._thread is not None:
            self._thread.join(grace_s)
            if self._thread.is_alive():
                return False
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is what we are leaving behind
                return False
        self._thread = self._control = self._progress = None
        self._error, self._finished, self._generation = None, False, -1
        gc.collect()  # the old model still holds the old groups; freeing them closes their connections, releasing peers
        return True

    def stacks(self) -> str:
        """The Python stack of every thread of this process, for naming the culprit of a hang."""
        frames = sys._current_frames()
        parts = []
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if frame is not None:
                parts.append(f"--- thread {thread.name}\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(parts)

    def stop_after(self, step: int) -> None:
        """Finish `step` (counting completed steps), save, and end the loop: a planned resize loses nothing."""
        self._control.stop_at = step
