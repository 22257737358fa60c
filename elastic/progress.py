"""The live progress line, printed from the controller's events.

On a terminal it is one line that `rich` redraws in place: step / total with a
bar, loss, grad norm, tokens/s, world size and generation, the last committed
checkpoint and the failures so far. Anywhere else (a pipe, a file, `ray job
logs`, `kubectl logs`) a redrawn line would turn into a wall of carriage
returns, so the same numbers come as plain lines every `every_s` seconds.
Either way each generation start, fault, failure, recovery, skipped checkpoint
and warning gets a line of its own at once (on a terminal, above the live line).
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text


class ProgressPrinter:
    def __init__(self, total_steps: int, tokens_per_step: int, every_s: float = 2.0, console: Console | None = None):
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.every_s = every_s
        self.console = console or Console()
        self.live_mode = self.console.is_terminal
        self._live: Live | None = None
        self._last_print: float | None = None  # event time of the last drawing; the first step is always shown
        self._last_step: dict | None = None
        self._world = 0
        self._generation = 0
        self._ckpt = None
        self._failures = 0
        self._recent: list[float] = []

    # -- output ---------------------------------------------------------------------
    def _note(self, line: str) -> None:
        """A line of its own: above the live line on a terminal, else a plain line."""
        if self.live_mode:
            self.console.print(Text(line), soft_wrap=True)
        else:
            print(line, file=self.console.file, flush=True)

    def _numbers(self, e: dict) -> list[str]:
        step_s = statistics.median(self._recent)
        return [
            f"loss {e['loss']:.4f}",
            f"grad {e['grad_norm']:.3f}",
            f"tok/s {self.tokens_per_step / max(step_s, 1e-9):,.0f}",
            f"world {self._world}",
            f"gen {self._generation}",
            f"ckpt {self._ckpt if self._ckpt is not None else '-'}",
            f"failures {self._failures}",
        ]

    def _render(self) -> Table:
        e = self._last_step
        done = e["step"]
        row = Table.grid(padding=(0, 1))
        row.add_row(
            Text(f"step {done:>5}/{self.total}", style="bold"),
            ProgressBar(total=self.total, completed=done, width=24),
            Text("  ".join(self._numbers(e)), style="red" if self._failures else ""),
        )
        return row

    def _show_step(self, e: dict) -> None:
        self._last_step = e
        interval = 0.1 if self.live_mode else self.every_s  # a live line is redrawn at most ten times a second
        due = self._last_print is None or e["t"] - self._last_print >= interval or e["step"] == self.total
        if due:
            self._last_print = e["t"]
        if self.live_mode:
            if self._live is None:
                self._live = Live(self._render(), console=self.console, auto_refresh=False, transient=False)
                self._live.start(refresh=True)
            else:
                self._live.update(self._render(), refresh=due)
        elif due:
            print(f"step {e['step']:>5}/{self.total}  " + "  ".join(self._numbers(e)), file=self.console.file, flush=True)

    def close(self) -> None:
        """Leave the live line on the screen as it last was."""
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.stop()
            self._live = None

    # -- events ---------------------------------------------------------------------
    def __call__(self, e: dict) -> None:
        kind = e["event"]
        if kind == "step":
            self._recent = (self._recent + [e["step_s"]])[-20:]
            self._show_step(e)
        elif kind == "generation_start":
            self._world, self._generation = e["world_size"], e["generation"]
            self._note(f"[gen {e['generation']}] {e['world_size']} workers, layout {e['layout']}, {_starting_from(e['resume_step'])}: {e['reason']}")
        elif kind == "checkpoint_committed":
            self._ckpt = e["step"]
        elif kind == "fault_injected":
            self._note(f"[fault] injected {e['kind']} at rank {e['rank']} step {e['step']}")
        elif kind == "failure_detected":
            self._failures += 1
            detect = f" in {e['detect_s']:.3f}s" if e.get("detect_s") is not None else ""
            if e.get("rank") is None:  # the workers did not start: no rank to name, the error says what
                self._note(f"[failure] {e['detected_as']}: {e.get('detail', '')}")
            else:
                self._note(f"[failure] {e['detected_as']} rank {e['rank']} (culprit {e['culprit']}) detected{detect}")
        elif kind == "recovering":
            tier = f" ({e['restored_from']} tier)" if e.get("restored_from") in ("memory", "durable") else ""
            self._note(f"[recover] {_starting_from(e['resume_step']).replace('start', 'resume', 1)}{tier}, lost {e['lost_steps']} steps")
        elif kind in ("memory_restore_unavailable", "memory_snapshot_skipped", "replica_ring"):
            self._note(f"[memory] {e['reason']}" + (f" (step {e['step']}, rank {e['rank']})" if "rank" in e else ""))
        elif kind == "checkpoint_skipped":
            self._note(f"[checkpoint] skipped step {e['step']}: {e['reason']}")
        elif kind == "waiting_for_workers":
            self._note(f"[wait] {e['reason']}")
        elif kind == "metrics_endpoint" and e["url"]:
            self._note(f"[metrics] Prometheus format at {e['url']} (series ray_elastic_*)")
        elif kind == "warning":
            self._note(f"[warning] {e['kind']}: {e['message']}")
        elif kind == "state" and e["state"] in ("FINISHED", "FAILED"):
            self.close()
            # The last step line was drawn before the final save committed: say where the run ended.
            ckpt = f"last checkpoint at {self._ckpt} steps" if self._ckpt is not None else "no checkpoint"
            self._note(f"[{e['state'].lower()}] {ckpt}" + (f": {e['reason']}" if e.get("reason") else ""))
        elif kind == "job_end":
            self.close()


def _starting_from(step: int | None) -> str:
    """Where a generation starts: "start from step N", or "start from scratch" when no checkpoint exists."""
    return "start from scratch" if step is None else f"start from step {step}"
