"""Alert rules over the run's vital signs, raised as `warning` events.

A divergence shows in the global gradient norm a few steps before it shows in
the loss: one step's gradient comes out many times larger than usual, the
optimizer takes a step far too large, and the loss climbs after it. The rule
here watches the global gradient norm (before clipping) that every `step`
event carries and warns at the first such step, so an operator (or a policy)
can act while the last checkpoint is still a good one.

The other classic vital sign, the count of steps skipped by an fp16 loss
scaler, does not apply: jobs here train in fp32 or bf16, which need no loss
scaling, so no step is ever skipped for overflow.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable


class GradSpikeRule:
    """Event sink: warn when the grad norm exceeds `factor` x the median of the last `window` steps.

    The median, not the mean, so one earlier spike does not raise the bar for
    the next; no judgement before `warmup` steps have been seen, since the first
    steps of training have large and fast-falling gradients. A non-finite norm
    is always a spike. Each warning is `emit("warning", kind="grad_spike",
    step, value, threshold, median, factor, message)`; `emit` is the run's
    `EventLog.emit`, so the warning lands in `events.jsonl` and reaches the
    other sinks (progress line, metrics).
    """

    def __init__(self, emit: Callable[..., dict], factor: float, window: int = 20, warmup: int = 10):
        if factor <= 1:
            raise ValueError(f"a spike factor must exceed 1, got {factor}")
        self.emit = emit
        self.factor = factor
        self.warmup = warmup
        self.recent: deque[float] = deque(maxlen=window)
        self.seen = 0

    def __call__(self, e: dict) -> None:
        if e["event"] != "step":
            return
        value = e["grad_norm"]
        self.seen += 1
        if self.seen > self.warmup and self.recent:
            median = statistics.median(self.recent)
            threshold = self.factor * median
            if not math.isfinite(value) or value > threshold:
                self.emit(
                    "warning", kind="grad_spike", step=e["step"], value=value, threshold=threshold, median=median, factor=self.factor,
                    message=f"grad norm {value:.4g} at step {e['step']} exceeds {self.factor:g} x the recent median {median:.4g}",
                )
        if math.isfinite(value):
            self.recent.append(value)
