"""The memory tier benchmark's in-run estimate (bench/strategies.py `parity_ratio`): a snapshot's cost, read from
one run with a snapshot after every other step, survives the machine's drift over the run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.strategies import _median_of_runs, memory_cost_markdown, parity_ratio  # noqa: E402


def _drifting_run(cost: float, steps: int = 60) -> dict[int, float]:
    # A step that slows from 0.25 s to 0.35 s over the run (this machine's drift within minutes), each busy
    # step (even: a snapshot was taken after the step before it) `cost` slower than the steps around it.
    return {k: (0.25 + 0.1 * k / steps) * (1 + cost * (k % 2 == 0)) for k in range(20, steps)}


def test_the_in_run_ratio_reads_a_snapshots_cost_through_the_drift_and_the_control_reads_one():
    assert abs(parity_ratio(_drifting_run(0.06), 2) - 1.06) < 1e-3
    assert abs(parity_ratio(_drifting_run(0.0), 2) - 1.0) < 1e-3


def test_repeated_in_run_passes_report_every_run_and_their_median():
    runs = [{"layout": "x", "interleaved_ratio": r, "interleaved_control_ratio": c, "interleaved_stall_s_median": 0.01}
            for r, c in ((1.06, 0.99), (1.02, 1.01), (1.04, 1.00))]
    merged = _median_of_runs(runs)
    assert merged["interleaved_ratio"] == 1.04 and merged["interleaved_ratios"] == [1.06, 1.02, 1.04]
    assert merged["interleaved_control_ratio"] == 1.00 and merged["interleaved_control_ratios"] == [0.99, 1.01, 1.00]
    assert _median_of_runs(runs[:1]) == runs[0]
    row = {"layout": "x", "world": 2, "step_s_memory_off": 0.1, "step_s_memory_on": 0.1, "memory_step_ratio": 1.0, "round_ratios": [1.0]}
    table = memory_cost_markdown({"layouts": [{**row, **merged}]})
    assert "in-run runs" in table and "| 1.040 | 1.060 1.020 1.040 | 1.000 | 0.990 1.010 1.000 |" in table
