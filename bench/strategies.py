"""Strategy benchmark: each parallel layout under the manager and as plain torch.distributed.

For every layout of the correctness matrix (issue 3) the same job config runs
for a fixed number of steps twice in this one run:

  (a) under the manager: `elastic.job.run_job` on an embedded Ray cluster
      (one node, one agent actor starting a process per rank, the controller
      polling the agent),
      with no faults and no checkpoint before the last step;
  (b) as plain torch.distributed: `bench/plain.py` spawns one process per
      rank, joins them with gloo on 127.0.0.1 and runs the same
      `elastic.train.Trainer` with the same config and layout.

Both sides are timed from the ranks' own `step` progress records with one
definition (`bench.plain.step_times`: the gap between consecutive step
completions of the slowest rank). The first `--warmup` steps and the last
step (it is followed by the run's final checkpoint save) are left out; the
median of the rest is `step_s` (manager) and `baseline_step_s` (plain).
Layouts alternate which side runs first, and `--rounds N` runs N rounds per
layout, each round flipping the order (a-b, b-a, a-b, ...), so slow drift of
the machine's speed (on this VM the same run varies by several percent within
minutes) cancels; `round_ratios` keeps each round's own ratio to show it. Both sides use the
same torch thread count (the worker's rule, `ELASTIC_TORCH_THREADS`, 1 by
default) and OMP_NUM_THREADS.

Where the CPU went: `bench/cpu.py` samples /proc once a second during each
run. Over the timed steps it reports the cores used by the ranks' training
and gloo threads, by the rest of the rank processes (Ray's in-process
threads, a warm spare), by the launcher (the controller with Ray's daemons,
or the plain parent), by the rest of the machine, and the idle cores
(`cores_used`, median over each side's runs). `job_cpu_ratio` is the CPU
seconds one step cost the job, manager / plain. It is less at the mercy of
the machine's drift than the step-time ratio.

Correctness: the manager's per-step losses (from its report) are compared
with a single-process reference that uses none of `strategies/` (plain
model, AdamW, clipping, the same LR schedule and the same samples):
`max_rel_diff_vs_reference` is max over steps of |loss - ref| / |ref|, which
bounds both the L2- and the max-norm relative difference of the loss vectors.

    make bench-strategies                 # or: python bench/strategies.py [--steps N] [--only NAME ...]

writes bench/results/strategies.json and prints a markdown table.

The memory tier's cost (`--memory-cost`, `make bench-memory`): per layout the
manager runs with `checkpoint.memory` off and on, alternating as above, on
two simulated nodes (so that every snapshot is also replicated to the other
node); `memory_step_ratio` is the median step time with the tier on / off.
It writes bench/results/memory_tier.json. Separate runs of one layout differ
by up to 15% on this machine whatever they run, more than the effect; so
`--interleaved` also measures it within single runs (a snapshot after every
other step: each step that overlaps one against the two around it, which do
not, and the same figure for a run with the tier off as the control) and adds
`interleaved_ratio` and `interleaved_control_ratio` to each layout. One such
run's figure spreads by about 0.02 from run to run, so `--repeat N` runs the
in-run measure N times over all selected layouts (pass after pass, so that
the machine's slow and fast spells fall on every layout) and reports each
run's figure (`interleaved_ratios`, `interleaved_control_ratios`) and their
median as `interleaved_ratio` and `interleaved_control_ratio`. With
`--busy N` the same in-run measure runs while N other processes spin on the
CPU (a node whose cores something else keeps busy, where the agent's idle
copies must be lifted: `elastic.sched`) and adds `busy_ratio` and
`busy_control_ratio` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # embedded Ray on loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path, and this file would shadow the `strategies` package.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

import ray  # noqa: E402
import torch  # noqa: E402

import elastic.job  # noqa: E402
from bench.cpu import CLASSES, CpuSampler  # noqa: E402
from bench.plain import layout_for, losses_from, run_plain, step_done_times, step_times, torch_threads  # noqa: E402
from elastic.config import JobConfig, load_config  # noqa: E402
from elastic.controller import Controller  # noqa: E402
from elastic.data import GlobalSampler, SyntheticTokens  # noqa: E402
from elastic.model import build_model, model_spec  # noqa: E402
from strategies import initial_state, token_loss_sum  # noqa: E402
from elastic.train import lr_at  # noqa: E402

BASE_CONFIG = ROOT / "deploy" / "examples" / "demo.yaml"
RESULTS = ROOT / "bench" / "results" / "strategies.json"
MEMORY_RESULTS = ROOT / "bench" / "results" / "memory_tier.json"

# The layouts of the issue-3 correctness matrix, as `--set` overrides of the demo config.
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("dp_shard=4", 4, ["parallel.dp_shard=4"]),
    ("hsdp 2x2", 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    ("tp=2", 2, ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=false"]),
    ("tp=2 +sp", 2, ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"]),
    ("pp=2 gpipe", 2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=gpipe"]),
    ("pp=2 1f1b", 2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b"]),
    ("pp=2 interleaved_1f1b", 2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=interleaved_1f1b"]),
    ("pp=2 x tp=2", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=1"]),
    ("pp=2 x dp_shard=2 x tp=2", 8, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"]),
]

# A small model (4 blocks, so interleaved 1F1B has 2 virtual stages per rank) with every degree divisible by 2.
MODEL = [
    "model.vocab_size=256", "model.dim=128", "model.n_layers=4", "model.n_heads=4",
    "model.ffn_dim=512", "model.max_seq_len=32", "data.seq_len=32",
    "training.global_batch=32", "training.micro_batch=8", "training.warmup_steps=5",
]


def job_config(name: str, world: int, layout_sets: list[str], steps: int, workdir: Path, memory: bool | None = None,
               memory_every: int = 1) -> JobConfig:
    """The layout's job; `memory` None: one node, no memory tier (against plain); else two nodes, the memory tier on
    (a snapshot every `memory_every` steps) or off."""
    tp = next((int(s.split("=")[1]) for s in layout_sets if s.startswith("parallel.tp=")), 1)
    per_node = world if memory is None else max(tp, world // 2)  # a TP group stays on one node
    sets = MODEL + layout_sets + [
        f"name=bench-{name.replace(' ', '_').replace('=', '').replace('+', '')}",
        f"run_root={workdir / 'runs'}",
        f"training.steps={steps}",
        f"scaling.num_workers={world}",
        f"scaling.min_workers={world}",
        "scaling.max_workers=0",
        f"scaling.workers_per_node={per_node}",  # one simulated node: the plain side is one machine too
        "fault.inject=[]",
        "fault.hang_floor_s=120",  # a loaded 2-core machine must not trip the calibrated hang deadline
        f"checkpoint.uri={workdir / 'ckpt'}",
        f"checkpoint.every_steps={steps + 1000}",  # no periodic save; the final step's save is not timed
        "checkpoint.resume=false",
        "checkpoint.async_save=false",
        f"checkpoint.memory={'true' if memory else 'false'}",
        f"checkpoint.memory_every_steps={memory_every}",
    ]
    return load_config(BASE_CONFIG, sets)


# -- (a) the manager, with every rank's step records captured ------------------------------------
class _RecordingController(Controller):
    """The controller unchanged, keeping a copy of every rank's step records of the current generation."""

    captured: dict[int, list[dict]] = {}

    def _absorb(self, rank: int, state, now: float) -> None:
        if state.generation == self.generation:
            _RecordingController.captured.setdefault(rank, []).extend(
                dict(r) for r in state.records if r["kind"] in ("ready", "step")
            )
        super()._absorb(rank, state, now)


def run_manager(cfg: JobConfig) -> tuple[list[list[dict]], dict]:
    _RecordingController.captured = {}
    original = elastic.job.Controller
    elastic.job.Controller = _RecordingController  # the only thing swapped: run_job builds its controller from this name
    try:
        report = elastic.job.run_job(cfg, quiet=True, fresh=True)
    finally:
        elastic.job.Controller = original
    if report["state"] != "FINISHED" or report["generations"] != 1 or report["failures_detected"]:
        raise RuntimeError(f"manager run did not finish cleanly in one generation: {report['state']} {report['reason']}, "
                           f"{report['generations']} generations, failures {report['failures']}")
    captured = _RecordingController.captured
    return [captured.get(r, []) for r in range(len(captured))], report


# -- the single-process reference (no strategies code) ----------------------------------------------
def reference_losses(cfg: JobConfig) -> list[float]:
    torch.set_num_threads(torch_threads())
    model = build_model(cfg.model, device="cpu")
    model.load_state_dict(initial_state(build_model(cfg.model), model_spec(cfg.model), cfg.training.seed), strict=True)
    t = cfg.training
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, foreach=True)
    data = SyntheticTokens(cfg.data, cfg.model.vocab_size)
    sampler = GlobalSampler(len(data), cfg.data.seed, t.global_batch)
    tokens = t.global_batch * cfg.data.seq_len
    losses = []
    for step in range(t.steps):
        inputs, labels = data.batch(sampler.global_indices(step))
        loss_sum = token_loss_sum(model(inputs), labels)
        (loss_sum / tokens).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum.item() / tokens)
    return losses


def max_rel_diff(got: list[float], ref: list[float]) -> float:
    if len(got) != len(ref):
        raise RuntimeError(f"{len(got)} losses vs {len(ref)} reference losses")
    return max(abs(g - r) / max(abs(r), 1e-30) for g, r in zip(got, ref))


# -- the benchmark ---------------------------------------------------------------------------------
def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "torch_threads_per_rank": torch_threads(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def bench_layout(name: str, world: int, sets: list[str], args, index: int, workdir: Path) -> dict:
    cfg = job_config(name, world, sets, args.steps, workdir)
    layout = layout_for(cfg)
    if layout.world_size != world:
        raise RuntimeError(f"{name}: the manager would run {layout} ({layout.world_size} ranks), not {world}")
    first, last = args.warmup, args.steps - 2  # leave out warm-up and the last step (the final save follows it)
    pair = ["manager", "plain"] if index % 2 == 0 else ["plain", "manager"]
    order = [side for r in range(args.rounds) for side in (pair if r % 2 == 0 else pair[::-1])]
    samples: dict[str, list[float]] = {"manager": [], "plain": []}
    run_medians: list[float] = []
    manager_losses = plain_losses = None
    cores: dict[str, list[dict[str, float]]] = {"manager": [], "plain": []}
    for side in order:
        t0 = time.time()
        with CpuSampler() as sampler:
            if side == "manager":
                records, report = run_manager(cfg)
                manager_losses = report["losses"]
            else:
                with tempfile.TemporaryDirectory(prefix="plain-ckpt-", dir=workdir) as ckpt:
                    plain_cfg = cfg.model_copy(deep=True)
                    plain_cfg.checkpoint.uri = ckpt
                    records = run_plain(plain_cfg, layout)
                plain_losses = losses_from(records, cfg)
        times = step_times(records, first, last)
        samples[side] += list(times.values())
        run_medians.append(statistics.median(times.values()))
        done = step_done_times(records)
        if (window := sampler.window(done.get(first - 1, done[first]), done[last])) is not None:
            cores[side].append(window)
        print(f"  {name:28s} {side:7s} median {statistics.median(times.values()):.4f}s over {len(times)} steps ({time.time() - t0:.1f}s wall)", flush=True)
    ref = reference_losses(cfg)
    step_s = statistics.median(samples["manager"])
    base_s = statistics.median(samples["plain"])
    # Cores used by each class over the timed steps, median over each side's runs (None: no window long enough).
    cpu = {
        side: {k: statistics.median(w[k] for w in windows) for k in CLASSES} if windows else None
        for side, windows in cores.items()
    }
    return {
        "layout": name,
        "world": world,
        "mesh": layout.as_dict(),
        "max_rel_diff_vs_reference": max_rel_diff(manager_losses, ref),
        "plain_max_rel_diff_vs_reference": max_rel_diff(plain_losses, ref),
        "step_s": step_s,
        "baseline_step_s": base_s,
        "overhead_ratio": step_s / base_s,
        # Each round's own ratio (its two runs back to back): how much the machine's drift moved the figure.
        "round_ratios": [
            run_medians[i] / run_medians[i + 1] if order[i] == "manager" else run_medians[i + 1] / run_medians[i]
            for i in range(0, len(order), 2)
        ],
        # Cores used per class over the timed steps (bench/cpu.py), median over the side's runs.
        "cores_used": cpu,
        # CPU seconds per step the job itself used (all classes but machine_other and idle), manager / plain.
        "job_cpu_ratio": _job_cpu(cpu["manager"], step_s) / _job_cpu(cpu["plain"], base_s) if cpu["manager"] and cpu["plain"] else None,
        "steps_timed_per_run": last - first + 1,
        "order": order,
    }


def bench_memory_cost(name: str, world: int, sets: list[str], args, index: int, workdir: Path) -> dict:
    """The layout's median step time under the manager with the memory tier on and off, alternating, on two nodes."""
    first, last = args.warmup, args.steps - 2
    pair = [False, True] if index % 2 == 0 else [True, False]
    order = [on for r in range(args.rounds) for on in (pair if r % 2 == 0 else pair[::-1])]
    samples: dict[bool, list[float]] = {False: [], True: []}
    run_medians, stalls, held = [], [], []
    for on in order:
        cfg = job_config(name, world, sets, args.steps, workdir, memory=on)
        records, report = run_manager(cfg)
        times = step_times(records, first, last)
        samples[on] += list(times.values())
        run_medians.append(statistics.median(times.values()))
        if on:
            stalls += [r.get("memory_stall_s", 0.0) for rs in records for r in rs if r["kind"] == "step" and first <= r["step"] <= last]
            held.append(report["memory_tier"])
        print(f"  {name:28s} memory {'on ' if on else 'off'} median {run_medians[-1]:.4f}s", flush=True)
    on_s, off_s = statistics.median(samples[True]), statistics.median(samples[False])
    return {
        "layout": name,
        "world": world,
        "nodes": cfg.scaling.num_workers // cfg.scaling.workers_per_node,  # one node: no replica to write
        "step_s_memory_on": on_s,
        "step_s_memory_off": off_s,
        "memory_step_ratio": on_s / off_s,
        "round_ratios": [
            run_medians[i + 1] / run_medians[i] if not order[i] else run_medians[i] / run_medians[i + 1]
            for i in range(0, len(order), 2)
        ],
        "memory_stall_s_median": statistics.median(stalls) if stalls else None,
        "state_bytes": held[-1]["state_bytes"] if held else None,
        "held_bytes_bound": held[-1]["held_bytes_bound"] if held else None,
        "order": ["on" if on else "off" for on in order],
    }


def parity_ratio(times: dict[int, float], every: int) -> float:
    """The median, over the steps that ran while a snapshot was taken (step k, when one was taken after step k - 1:
    k % every == 0), of its time over the mean of its two neighbours' (which did not): each busy step is compared
    with the steps right around it, so the machine's drift over a run (tens of percent here) cancels."""
    return statistics.median(
        t / ((times[k - 1] + times[k + 1]) / 2) for k, t in times.items() if k % every == 0 and k - 1 in times and k + 1 in times
    )


def bench_memory_interleaved(name: str, world: int, sets: list[str], args, index: int, workdir: Path) -> dict:
    """The layout's memory-tier cost within one run: a snapshot after every other step, the steps that overlap one
    against those that do not; and the same split of a run with the tier off, which should give 1 (the control)."""
    first, last = args.warmup, args.steps - 2
    key = "busy" if args.busy else "interleaved"
    out = {"layout": name}
    for on in (True, False) if index % 2 == 0 else (False, True):
        records, _ = run_manager(job_config(name, world, sets, args.steps, workdir, memory=on, memory_every=2))
        times = step_times(records, first, last)
        if on:
            out[f"{key}_ratio"] = parity_ratio(times, 2)
            out[f"{key}_stall_s_median"] = statistics.median(
                r.get("memory_stall_s", 0.0) for rs in records for r in rs if r["kind"] == "step" and first <= r["step"] <= last)
        else:
            out[f"{key}_control_ratio"] = parity_ratio(times, 2)
        print(f"  {name:28s} memory {'on, every 2 steps' if on else 'off'}: parity ratio {parity_ratio(times, 2):.3f}", flush=True)
    return out


def _median_of_runs(runs: list[dict]) -> dict:
    """One layout's in-run figures over repeated runs: each run's ratios (`<key>s`) and their medians."""
    if len(runs) == 1:
        return runs[0]
    return {**{k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "layout"},
            **{f"{k}s": [r[k] for r in runs] for k in runs[0] if k.endswith("ratio")}}


def memory_busy_markdown(result: dict) -> str:
    """The `--interleaved --busy N` figures of the layouts that have them, as a markdown table."""
    lines = ["| layout | world | in-run ratio, cores busy | in-run control, cores busy |", "|---|---:|---:|---:|"]
    for r in result["layouts"]:
        if r.get("busy_ratio") is not None:
            lines.append(f"| {r['layout']} | {r['world']} | {r['busy_ratio']:.3f} | {r['busy_control_ratio']:.3f} |")
    return "\n".join(lines)


def memory_cost_markdown(result: dict) -> str:
    """The --memory-cost result as a markdown table (its JSON is not strategies.json, whose tables tests/test_docs.py checks)."""
    repeated = any(len(r.get("interleaved_ratios") or []) > 1 for r in result["layouts"])
    inrun_head = ("| in-run ratio (median) | in-run runs | in-run control (median) | in-run control runs |", "---:|---|---:|---|") if repeated \
        else ("| in-run ratio | in-run control |", "---:|---:|")
    lines = ["| layout | world | step_s memory off | step_s memory on | memory_step_ratio | round_ratios " + inrun_head[0],
             "|---|---:|---:|---:|---:|---|" + inrun_head[1]]
    for r in result["layouts"]:
        inrun = []
        for k in ("interleaved_ratio", "interleaved_control_ratio"):
            inrun.append(f"{r[k]:.3f}" if r.get(k) is not None else "—")
            if repeated:
                inrun.append(" ".join(f"{x:.3f}" for x in r.get(f"{k}s") or []) or "—")
        lines.append(f"| {r['layout']} | {r['world']} | {r['step_s_memory_off']:.4f} | {r['step_s_memory_on']:.4f} | "
                     f"{r['memory_step_ratio']:.3f} | {' '.join(f'{x:.2f}' for x in r['round_ratios'])} | {' | '.join(inrun)} |")
    return "\n".join(lines)


def _job_cpu(cores: dict[str, float], step_s: float) -> float:
    return step_s * (cores["training"] + cores["rank_other"] + cores["launcher"])


def table(result: dict) -> str:
    lines = [
        "| layout | world | step_s (manager) | step_s (plain) | overhead_ratio | max_rel_diff_vs_reference | round_ratios |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["layouts"]:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['step_s']:.4f} | {r['baseline_step_s']:.4f} | "
            f"{r['overhead_ratio']:.3f} | {r['max_rel_diff_vs_reference']:.1e} | {' '.join(f'{x:.2f}' for x in r['round_ratios'])} |"
        )
    return "\n".join(lines)


def cpu_table(result: dict) -> str:
    """Cores used per class over the timed steps (manager / plain), and the job's CPU per step, manager / plain."""
    lines = [
        "| layout | training (m / p) | rank other (m / p) | launcher (m / p) | rest of machine (m / p) | idle (m / p) | job_cpu_ratio |",
        "|---|---|---|---|---|---|---:|",
    ]
    for r in result["layouts"]:
        m, p = r["cores_used"]["manager"], r["cores_used"]["plain"]
        if not (m and p):
            continue
        cells = [f"{m[k]:.3f} / {p[k]:.3f}" for k in ("training", "rank_other", "launcher", "machine_other", "idle")]
        lines.append(f"| {r['layout']} | " + " | ".join(cells) + f" | {r['job_cpu_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Each parallel layout under the manager vs plain torch.distributed.")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run (default 80)")
    parser.add_argument("--warmup", type=int, default=20, help="leading steps left out of the median: start-up transients (default 20)")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="runs of each side per layout: a-b, then b-a, a-b, ... (default 1; the first side alternates between layouts)",
    )
    parser.add_argument("--only", action="append", default=[], help="run only layouts with this name (repeatable)")
    parser.add_argument("--memory-cost", action="store_true", help="measure the memory tier on vs off instead (bench/results/memory_tier.json)")
    parser.add_argument("--interleaved", action="store_true",
                        help="with --memory-cost: measure it within single runs instead, and add that to the layouts of --out")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --interleaved: run the in-run measure this many times over the layouts and report each run and the median")
    parser.add_argument("--busy", type=int, default=0,
                        help="with --interleaved: other processes that spin on the CPU meanwhile (busy_ratio, busy_control_ratio)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.out = args.out or (MEMORY_RESULTS if args.memory_cost else RESULTS)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.steps < args.warmup + 3:
        parser.error("--steps must leave at least 2 timed steps after --warmup and before the last step")
    selected = [(n, w, s) for n, w, s in LAYOUTS if not args.only or n in args.only]
    if not selected:
        parser.error(f"--only matches no layout; layouts: {[n for n, _, _ in LAYOUTS]}")
    t0 = time.time()
    result = {"machine": machine(), "steps": args.steps, "warmup_steps": args.warmup, "rounds": args.rounds, "layouts": []}
    if args.busy and not args.interleaved:
        parser.error("--busy goes with --interleaved")
    if args.repeat < 1 or (args.repeat > 1 and (not args.interleaved or args.busy)):
        parser.error("--repeat is at least 1 and goes with --interleaved (not --busy)")
    if args.interleaved:
        if not args.memory_cost:
            parser.error("--interleaved goes with --memory-cost")
        return add_interleaved(args, selected)
    bench = bench_memory_cost if args.memory_cost else bench_layout
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        for i, (name, world, sets) in enumerate(selected):
            result["layouts"].append(bench(name, world, sets, args, i, Path(tmp)))
    result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    result["wall_s"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.memory_cost:
        print(memory_cost_markdown(result))
    else:
        print(table(result))
        print()
        print(cpu_table(result))
    print(f"\nwrote {args.out} in {result['wall_s']:.0f}s")
    return 0


def add_interleaved(args, selected: list) -> int:
    """`--memory-cost --interleaved`: the in-run measure of each selected layout, merged into the layouts of `--out`."""
    t0 = time.time()
    result = json.loads(args.out.read_text())
    by_name = {r["layout"]: r for r in result["layouts"]}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in selected}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
            for rep in range(args.repeat):
                for i, (name, world, sets) in enumerate(selected):
                    runs[name].append(bench_memory_interleaved(name, world, sets, args, i + rep, Path(tmp)))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    for name, world, _ in selected:
        entry = by_name.setdefault(name, {"layout": name, "world": world})
        for stale in [k for k in entry if k.endswith("ratios") and k[:-1] in runs[name][0]]:
            del entry[stale]  # the runs of an earlier repeated pass
        entry.update(_median_of_runs(runs[name]))
    result["layouts"] = list(by_name.values())
    run = {"machine": machine(), "steps": args.steps, "warmup_steps": args.warmup, "repeat": args.repeat, "wall_s": time.time() - t0}
    if args.busy:
        result["busy"] = {**run, "spinning_processes": args.busy}
    else:
        result["interleaved"] = run
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(memory_busy_markdown(result) if args.busy else memory_cost_markdown(result))
    print(f"\nadded the in-run measure to {args.out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
