"""The progress watchdog: deadlines calibrated from observed step times.

A worker that is alive but makes no progress is found by a missed deadline,
never by a collective timeout. There are separate budgets for start-up (and
the first steps, which include compilation and warm-up), for steps, and for
checkpoint saves. After warm-up the step deadline is a safety factor over
the slowest step seen, with a floor; an explicit timeout overrides it. A
restarted generation keeps the calibration, so a hang right after a
recovery is caught as fast as any other.
"""

from __future__ import annotations

from elastic.config import FaultConfig

WARMUP_STEPS = 3


class HangWatchdog:
    """Deadlines for one job; the calibration carries over from one generation to the next."""

    def __init__(self, cfg: FaultConfig):
        self.cfg = cfg
        self.slowest = 0.0
        self.reset(now=0.0)

    def reset(self, now: float) -> None:
        """A new generation: the start-up budget covers its first step."""
        self.last_progress = now
        self.steps_seen = 0

    def observe_step(self, duration_s: float, now: float) -> None:
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
            return self.cfg.startup_timeout_s
        if self.cfg.hang_timeout_s > 0:
            return self.cfg.hang_timeout_s
        if self.slowest == 0.0:
            return self.cfg.startup_timeout_s  # still warming up, nothing calibrated yet
        return max(self.cfg.hang_floor_s, self.cfg.hang_factor * self.slowest)

    def expired(self, now: float, phase: str) -> bool:
        return now - self.last_progress > self.deadline_s(phase)
