"""The progress watchdog: deadlines calibrated from observed step times.

A worker that is alive but makes no progress is found by a missed deadline,
never by a collective timeout. There are separate budgets for start-up (and
the first steps, which include compilation and warm-up), for steps, and for
checkpoint saves. After warm-up the step deadline is a safety factor over
the slowest step seen, with a floor; an explicit timeout overrides it. A
restarted generation keeps the calibration: once every rank is in its
training loop (start-up over), its first step has the step deadline, or the
factor over the slowest first step of an earlier generation (communicators
and caches warm up there) where that is longer, so a hang right after a
recovery is caught in seconds, not after the start-up budget.
"""

from __future__ import annotations

from elastic.config import FaultConfig

WARMUP_STEPS = 3


class HangWatchdog:
    """Deadlines for one job; the calibration carries over from one generation to the next."""

    def __init__(self, cfg: FaultConfig):
        self.cfg = cfg
        self.slowest = 0.0
        self.slowest_first = 0.0  # the slowest first step of a generation
        self.reset(now=0.0)

    def reset(self, now: float) -> None:
        """A new generation: the start-up budget covers it until every rank is in its training loop."""
        self.last_progress = now
        self.steps_seen = 0
        self.in_loop = False

    def entered_loop(self, now: float) -> None:
        """Every rank of the generation is past its start-up (in its training loop): its first step is timed from now."""
        if not self.in_loop:
            self.in_loop = True
            self.last_progress = now

    def observe_step(self, duration_s: float, now: float) -> None:
        if self.steps_seen == 0:
            self.slowest_first = max(self.slowest_first, duration_s)
        self.steps_seen += 1
        if self.steps_seen > WARMUP_STEPS:
            self.slowest = max(self.slowest, duration_s)
        self.last_progress = now

    def touch(self, now: float) -> None:
        self.last_progress = now

    def deadline_s(self, phase: str) -> float:
        if phase == "save":
            return self.cfg.checkpoint_timeout_s
        if self.steps_seen == 0:
            if not self.in_loop or self.slowest_first == 0.0:
                return self.cfg.startup_timeout_s  # starting up, or the job's first step (compilation, warm-up)
            return max(self._step_deadline(), self.cfg.hang_factor * self.slowest_first)
        return self._step_deadline()

    def _step_deadline(self) -> float:
        if self.cfg.hang_timeout_s > 0:
            return self.cfg.hang_timeout_s
        if self.slowest == 0.0:
            return self.cfg.startup_timeout_s  # still warming up, nothing calibrated yet
        return max(self.cfg.hang_floor_s, self.cfg.hang_factor * self.slowest)

    def expired(self, now: float, phase: str) -> bool:
        return now - self.last_progress > self.deadline_s(phase)
