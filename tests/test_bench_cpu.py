"""The strategy benchmark's CPU accounting (bench/cpu.py): classes from hand-made snapshots, and a live sample."""

import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu import CLASSES, CpuSampler, classify  # noqa: E402


def _snap(t, busy, idle, tree, ranks):
    return {"t": t, "busy_s": busy, "idle_s": idle, "tree": tree, "ranks": ranks}


def test_classes_split_training_rank_overhead_launcher_and_the_rest():
    # Over 10 s: rank 11 trains (busiest thread 6 s, a gloo thread 1 s, its reporter thread 0.2 s);
    # process 12 is a warm spare (0.1 s, too little to be training); the launcher 10 used 0.5 s;
    # the machine was busy 9 s in all, so 9 - 7.8 = 1.2 s went to processes outside the tree.
    a = _snap(0.0, 100.0, 50.0, {10: 1.0, 11: 2.0, 12: 1.0},
              {11: {1: ("train", 1.0), 2: ("gloo_tcp_loop", 0.5), 3: ("reporter", 0.5)}, 12: {4: ("MainThread", 1.0)}})
    b = _snap(10.0, 109.0, 61.0, {10: 1.5, 11: 9.2, 12: 1.1},
              {11: {1: ("train", 7.0), 2: ("gloo_tcp_loop", 1.5), 3: ("reporter", 0.7)}, 12: {4: ("MainThread", 1.1)}})
    cores = classify(a, b)
    assert set(cores) == set(CLASSES)
    assert abs(cores["training"] - 0.7) < 1e-9
    assert abs(cores["rank_other"] - 0.03) < 1e-9
    assert abs(cores["launcher"] - 0.05) < 1e-9
    assert abs(cores["machine_other"] - 0.12) < 1e-9
    assert abs(cores["idle"] - 1.1) < 1e-9


def _spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


def test_a_live_spawned_child_counts_as_a_training_rank():
    ctx = multiprocessing.get_context("spawn")
    with CpuSampler(interval_s=0.3) as sampler:
        child = ctx.Process(target=_spin, args=(3.0,))
        child.start()
        child.join()
    t0 = sampler.snapshots[0]["t"]
    cores = sampler.window(t0, sampler.snapshots[-1]["t"])
    assert cores is not None
    assert any(child.pid in s["ranks"] for s in sampler.snapshots), "the spawned child was not seen as a rank process"
    assert cores["training"] > 0.3, cores  # the child spun one core for most of the window
