"""The memory tier benchmark's in-run estimate (bench/strategies.py `parity_ratio`): a snapshot's cost, read from
one run with a snapshot after every other step, survives the machine's drift over the run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.strategies import parity_ratio  # noqa: E402


def _drifting_run(cost: float, steps: int = 60) -> dict[int, float]:
    # A step that slows from 0.25 s to 0.35 s over the run (this machine's drift within minutes), each busy
    # step (even: a snapshot was taken after the step before it) `cost` slower than the steps around it.
    return {k: (0.25 + 0.1 * k / steps) * (1 + cost * (k % 2 == 0)) for k in range(20, steps)}


def test_the_in_run_ratio_reads_a_snapshots_cost_through_the_drift_and_the_control_reads_one():
    assert abs(parity_ratio(_drifting_run(0.06), 2) - 1.06) < 1e-3
    assert abs(parity_ratio(_drifting_run(0.0), 2) - 1.0) < 1e-3
