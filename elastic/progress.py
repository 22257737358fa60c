"""The live progress line, printed from the controller's events.

Plain periodic lines (they read well in `ray job logs` too): every
`every_s` seconds a step line, and at once a line for each failure,
recovery, resize and checkpoint.
"""

from __future__ import annotations

import sys
import time


class ProgressPrinter:
    def __init__(self, total_steps: int, tokens_per_step: int, every_s: float = 2.0, stream=None):
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.every_s = every_s
        self.stream = stream or sys.stdout
        self._last_print = 0.0
        self._world = 0
        self._generation = 0
        self._ckpt = None
        self._failures = 0
        self._recent: list[float] = []

    def _out(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def __call__(self, e: dict) -> None:
        kind = e["event"]
        if kind == "step":
            self._recent = (self._recent + [e["step_s"]])[-20:]
            if e["t"] - self._last_print >= self.every_s or e["step"] + 1 == self.total:
                self._last_print = e["t"]
                step_s = sorted(self._recent)[len(self._recent) // 2]
                self._out(
                    f"step {e['step'] + 1:>5}/{self.total}  loss {e['loss']:.4f}  grad {e['grad_norm']:.3f}  "
                    f"tok/s {self.tokens_per_step / max(step_s, 1e-9):,.0f}  world {self._world}  gen {self._generation}  "
                    f"ckpt {self._ckpt if self._ckpt is not None else '-'}  failures {self._failures}"
                )
        elif kind == "generation_start":
            self._world, self._generation = e["world_size"], e["generation"]
            self._out(f"[gen {e['generation']}] {e['world_size']} workers, layout {e['layout']}, resume from step {e['resume_step']}: {e['reason']}")
        elif kind == "checkpoint_committed":
            self._ckpt = e["step"]
        elif kind == "fault_injected":
            self._out(f"[fault] injected {e['kind']} at rank {e['rank']} step {e['step']}")
        elif kind == "failure_detected":
            self._failures += 1
            detect = f" in {e['detect_s']:.3f}s" if e.get("detect_s") is not None else ""
            self._out(f"[failure] {e['detected_as']} rank {e['rank']} (culprit {e['culprit']}) detected{detect}")
        elif kind == "recovering":
            self._out(f"[recover] resuming from step {e['resume_step']}, lost {e['lost_steps']} steps")
        elif kind == "checkpoint_skipped":
            self._out(f"[checkpoint] skipped step {e['step']}: {e['reason']}")
        elif kind == "waiting_for_workers":
            self._out(f"[wait] {e['reason']}")
        elif kind == "state" and e["state"] in ("FINISHED", "FAILED"):
            self._out(f"[{e['state'].lower()}] {e.get('reason') or ''}".rstrip())
        self._last_event = time.time()
