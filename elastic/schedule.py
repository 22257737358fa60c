"""Learning-rate schedules: the rate is a pure function of the step, so a resumed job needs no scheduler state."""

from __future__ import annotations

import math

from elastic.config import JobConfig


def lr_at(step: int, cfg: JobConfig) -> float:
    """The learning rate of `step` (counting from 0): linear warm-up to `training.lr`, then `training.schedule`.

    - cosine: half a cosine from lr down to `min_lr_ratio` x lr, reached after the last step;
    - linear: a straight line between the same two points;
    - constant: lr;
    - wsd (warm-up, stable, decay): lr until the last `decay_fraction` of the
      steps, then a straight line down to `min_lr_ratio` x lr.
    """
    t = cfg.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    floor = t.min_lr_ratio
    if t.schedule == "constant":
        return t.lr
    if t.schedule == "wsd":
        decay_start = max(t.warmup_steps, t.steps - max(1, round(t.decay_fraction * t.steps)))
        progress = max(0.0, (step - decay_start) / max(1, t.steps - decay_start))
        return t.lr * (1 - (1 - floor) * min(1.0, progress))
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    if t.schedule == "linear":
        return t.lr * (1 - (1 - floor) * progress)
    return t.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
