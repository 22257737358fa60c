"""`elastic report RUN_DIR`: what happened in a run and what it cost, as a table and PNG plots.

    elastic report runs/demo                # table, and loss.png, world_size.png, time_breakdown.png in runs/demo
    elastic report runs/demo --no-plots     # the table only

The table comes from `report.json` (written by the controller at the end of a
run); the plots and the time breakdown come from `events.jsonl`, which holds
every step, including the ones a recovery rolled back and ran again. A run
whose driver was killed left no report.json: its table is rebuilt from the
event log and says the run did not finish. Earlier invocations of the same
run (`attempts/N/`, `elastic.rundir`) are shown first, one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from elastic.errors import UsageError
from elastic.report import kept_step_s, memory_tier, training_goodput

REPORT_FIELDS = ("name", "state", "steps_completed", "steps_planned", "initial_loss", "final_loss", "world_sizes", "layouts",
                 "generations", "failures", "failures_detected", "faults_injected", "samples", "checkpoints_committed",
                 "checkpoints_skipped", "last_committed_step", "wall_s", "goodput")
"""The report.json fields the table reads; a file without them is not a report of this project."""

BREAKDOWN = ("training", "start-up", "checkpoint stall", "detection", "recovery", "lost work", "resizes", "shutdown", "other")
"""Where the wall time went, in the order the table and the plot show it."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="summarise a run: table of steps, failures and costs, plus PNG plots",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding report.json and events.jsonl (runs/<name>)")
    p.add_argument("--no-plots", action="store_true", help="print the table only; write no PNG files")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- loading
def _load_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: invalid JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(report, dict):
        raise UsageError(f"{path}: expected a JSON object")
    missing = [k for k in REPORT_FIELDS if k not in report]
    if missing:
        raise UsageError(f"{path}: not a run report, missing {', '.join(missing)}")
    return report


def _load_events(path: Path) -> list[dict]:
    """Parse events.jsonl, naming the bad line; a cut-off last line (the driver died mid-write) is dropped."""
    text = path.read_text()
    lines = text.splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise UsageError(f"{path}: line {number} is not JSON") from None
        if not isinstance(event, dict) or "t" not in event or "event" not in event:
            raise UsageError(f"{path}: line {number} is not an event (needs 't' and 'event')")
        events.append(event)
    if not events:
        raise UsageError(f"{path}: no events")
    return events


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """report.json and events.jsonl of a run directory, or a one-line UsageError saying what is wrong."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such run directory")
    report_path, events_path = run_dir / "report.json", run_dir / "events.jsonl"
    if not events_path.is_file():
        raise UsageError(f"{run_dir}: no events.jsonl" + ("" if report_path.is_file() else " and no report.json: not a run directory"))
    events = _load_events(events_path)
    if not report_path.is_file():  # the driver was killed (or is still running): what the log says is all there is
        return report_from_events(events), events
    return _load_report(report_path), events


def report_from_events(events: list[dict]) -> dict:
    """A report rebuilt from the event log of a run that wrote no report.json: its state says it did not finish.

    What the log does not hold is left out (`None`): the sample ledger, and
    the failures' lost steps where no recovery followed.
    """
    start = next((e for e in events if e["event"] == "job_start"), {})
    config = start.get("config") or {}
    checkpoint = config.get("checkpoint") or {}
    kept: dict[int, dict] = {}
    for e in events:
        if e["event"] == "step":
            kept[e["step"]] = e  # a step run again after a rollback replaces the earlier run
    steps = sorted(kept)
    generations = [e for e in events if e["event"] == "generation_start"]
    recovering = [e for e in events if e["event"] == "recovering"]
    detections = [e for e in events if e["event"] == "failure_detected"]
    failures = []
    for i, e in enumerate(detections):
        fields = {k: e.get(k) for k in ("kind", "detected_as", "rank", "node", "culprit", "step", "fault_id", "detect_s")}
        recovery = recovering[i] if i < len(recovering) else {}
        fields.update(recover_s=None, lost_steps=recovery.get("lost_steps"), resume_step=recovery.get("resume_step"),
                      restored_from=recovery.get("restored_from"), error=e.get("detail", ""))
        failures.append(fields)
    recovered = [e for e in events if e["event"] == "recovered"]
    if all("detected_at" in e for e in recovered):  # each names the failure it ends: one may end several
        by_detection = {e["detected_at"]: e.get("recover_s") for e in recovered}
        for f, e in zip(failures, detections):
            f["recover_s"] = by_detection.get(e.get("detected_at"))
    else:  # an older log: one recovered event per failure, in order
        for f, e in zip(failures, recovered):
            f["recover_s"] = e.get("recover_s")
    ended = [e for e in events if e["event"] == "state" and e.get("state") in ("FINISHED", "FAILED")]
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    wall = events[-1]["t"] - events[0]["t"] + float(start.get("cluster_s") or 0.0)
    kept_time = sum(kept_step_s(kept[s]) for s in steps)
    return {
        "name": config.get("name") or start.get("name") or "?",
        "attempt": start.get("attempt", 1),
        "state": ended[-1]["state"] if ended else "UNFINISHED",
        "reason": "no report.json: " + ("the driver ended before writing it" if ended else
                                        "the run did not finish (its driver was killed) or is still going; rebuilt from events.jsonl"),
        "steps_completed": len(steps),
        "steps_planned": (config.get("training") or {}).get("steps"),
        "initial_loss": kept[steps[0]]["loss"] if steps else None,
        "final_loss": kept[steps[-1]]["loss"] if steps else None,
        "losses": [kept[s]["loss"] for s in steps],
        "world_sizes": [e["world_size"] for e in generations],
        "layouts": [e["layout"] for e in generations],
        "generations": len(generations),
        "failures": failures,
        "failures_detected": len(failures),
        "faults_injected": sum(e["event"] == "fault_injected" for e in events),
        "samples": None,
        "checkpoints_committed": committed,
        "checkpoints_skipped": [{"step": e["step"], "reason": e["reason"]} for e in events if e["event"] == "checkpoint_skipped"],
        "last_committed_step": committed[-1] if committed else None,
        "checkpoint_stall_s": sum(e.get("stall_s") or 0.0 for e in events if e["event"] == "checkpoint_committed"),
        "checkpoint_commit_s": sum(e.get("commit_s") or 0.0 for e in events if e["event"] == "checkpoint_committed"),
        "memory_tier": memory_tier(bool(checkpoint.get("memory")), int(checkpoint.get("memory_replicas", 1)), events),
        "wall_s": wall,
        "goodput": kept_time / wall if wall > 0 else 0.0,
        "goodput_training": training_goodput([e for e in events if e["event"] == "step"], kept_time),
    }


# --------------------------------------------------------------------------- analysis
@dataclass
class Marker:
    """Something to draw on a plot: where (step and seconds since start) and what."""

    step: int | None
    t: float
    label: str


@dataclass
class RunTimeline:
    """What the plots and the time breakdown need, derived from the event log once.

    Times are seconds since `job_start`. A step that a recovery rolled back
    appears twice in the log; the later run is kept, the earlier is in `rolled_back`.
    """

    kept_steps: list[int] = field(default_factory=list)
    kept_losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    rolled_back: list[tuple[int, float]] = field(default_factory=list)
    failures: list[Marker] = field(default_factory=list)
    resizes: list[Marker] = field(default_factory=list)
    world: list[tuple[float, int]] = field(default_factory=list)
    end_t: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0


def analyse(report: dict, events: list[dict]) -> RunTimeline:
    """The plots' series from the event log, and the run's wall time split into where it went.

    The parts: training (the kept steps, less the checkpoint stall inside
    them: goodput counts whole steps); start-up (Ray's start, the workers',
    up to the first step); checkpoint stall (the ranks' waits for their
    saves, not the controller's background commits: an async save's wait
    for its copy, inside the next step, a synchronous save's whole write,
    between steps; see `_stall_in_steps`), counted once; detection and
    recovery (the controller's own `detect_s`, and `recover_s` less the first
    step it waited for, which is training); lost work (the
    rolled-back steps times the median step time); resizes (a planned
    resize's restart up to its first step); shutdown (after the end state:
    teardown, report, last metrics); and what is left ("other": scheduling
    and the waits between steps). They add up to the wall time, with "other"
    what is left; where parts overlap (a step's time is its slowest rank's,
    and ranks in lockstep overlap a little), "other" is 0 and the parts add
    up to a little more.
    """
    start = next((e for e in events if e["event"] == "job_start"), events[0])
    cluster_s = float(start.get("cluster_s") or 0.0)  # Ray's start, before the first event
    t0 = start["t"]
    out = RunTimeline(world=[(0.0, 0)])  # nobody trains until the first generation starts
    last_run: dict[int, dict] = {}
    last_eval: dict[int, float] = {}  # an evaluation run again after a recovery overwrites the earlier one
    step_times = []
    starting: tuple[float, int] | None = None  # a generation counts as training from its first step, not its start-up
    for e in events:
        kind, t = e["event"], e["t"] - t0
        if kind == "step":
            if starting is not None:
                out.world.append((max(starting[0], t - e["step_s"]), starting[1]))
                starting = None
            if e["step"] in last_run:
                out.rolled_back.append((e["step"], last_run[e["step"]]["loss"]))
            last_run[e["step"]] = e
            step_times.append(e["step_s"])
        elif kind == "eval":
            last_eval[e["step"]] = e["loss"]
        elif kind == "generation_start":
            trained = _last_training_size(out.world)
            if trained is not None and e["world_size"] != trained:
                out.resizes.append(Marker(e.get("resume_step"), t, f"{trained} -> {e['world_size']} workers"))
            starting = (t, e["world_size"])
        elif kind == "failure_detected":
            rank = "" if e.get("rank") is None else f" rank {e['rank']}"
            out.failures.append(Marker(e.get("step"), t, f"{e.get('kind', '?')}{rank}"))
            out.world.append((t, 0))
            starting = None
    out.kept_steps = sorted(last_run)
    out.kept_losses = [last_run[s]["loss"] for s in out.kept_steps]
    out.eval_steps = sorted(last_eval)
    out.eval_losses = [last_eval[s] for s in out.eval_steps]
    out.end_t = events[-1]["t"] - t0
    out.wall_s = float(report.get("wall_s") or out.end_t)

    median_step = statistics.median(step_times) if step_times else 0.0
    lost_steps = sum(e.get("lost_steps") or 0 for e in events if e["event"] == "recovering")
    parts = {
        "training": sum(kept_step_s(last_run[s]) for s in out.kept_steps) - _stall_in_steps(events, last_run),
        "start-up": _startup_s(events, t0, cluster_s),
        # The ranks' own wait for a save, not the controller's commit, which runs in the background
        # (summary_rows shows it apart).
        "checkpoint stall": sum(e.get("stall_s") or 0.0 for e in events if e["event"] == "checkpoint_committed"),
        "detection": sum(e.get("detect_s") or 0.0 for e in events if e["event"] == "failure_detected"),
        "recovery": _recovery_s(events),
        "lost work": lost_steps * median_step,
        "resizes": _restart_s(events, "resized"),
        "shutdown": _shutdown_s(events),
    }
    parts["other"] = max(0.0, out.wall_s - sum(parts.values()))
    out.breakdown = parts
    return out


def _stall_in_steps(events: list[dict], kept: dict[int, dict]) -> float:
    """The part of the ranks' checkpoint stall that kept step times already hold, so that it is counted once.

    An async save of step k is copied while step k+1 runs, and the ranks wait
    for the copy inside that step (before its optimizer step): its stall is in
    step k+1's time when that step ran in the save's generation and was kept.
    A synchronous save (the last one, one before a resize, every one without
    checkpoint.async_save) runs between steps; the ranks report no stall of
    their own for it, and the commit's stall_s is its save_s.
    """
    inside = 0.0
    for e in events:
        if e["event"] != "checkpoint_committed" or not e.get("stall_s") or e.get("stall_s") == e.get("save_s"):
            continue
        after = kept.get(e["step"] + 1)
        if after is not None and after.get("generation") == e.get("generation"):
            inside += min(e["stall_s"], after["step_s"])  # its stall_s also holds the submit's wait, between the steps
    return inside


def _recovery_s(events: list[dict]) -> float:
    """The controller's `recover_s` (detection to the first completed step) less that first step, which counts as training.

    Failures whose recoveries end at the same step (one came while the job was still recovering from another) are
    one stretch of time: the longest of their `recover_s`, counted once."""
    last_step: dict[int, float] = {}
    longest: dict[tuple[int, int], float] = {}  # (generations started, step) -> the longest recovery that step ended
    generations = 0
    for e in events:
        if e["event"] == "generation_start":
            generations += 1
        elif e["event"] == "step":
            last_step[e["step"]] = e["step_s"]
        elif e["event"] == "recovered":
            key = (generations, e.get("step"))
            longest[key] = max(longest.get(key, 0.0), (e.get("recover_s") or 0.0) - last_step.get(e.get("step"), 0.0))
    return sum(max(0.0, s) for s in longest.values())


def _first_step_start(events: list[dict], after: float) -> float | None:
    """When the first step after time `after` began (its event's time less its duration)."""
    return next((e["t"] - e["step_s"] for e in events if e["event"] == "step" and e["t"] > after), None)


def _startup_s(events: list[dict], t0: float, cluster_s: float) -> float:
    """From the start of the run (Ray's start included) to its first step, or to its first failure if that came first."""
    first = _first_step_start(events, t0)
    failed = next((e["t"] for e in events if e["event"] == "failure_detected"), None)
    ends = [t for t in (first, failed) if t is not None]
    return max(0.0, min(ends) - t0) + cluster_s if ends else cluster_s


def _restart_s(events: list[dict], kind: str) -> float:
    """For each `kind` event (a planned resize's teardown), the time until the next generation's first step began."""
    total = 0.0
    for e in events:
        if e["event"] == kind and (start := _first_step_start(events, e["t"])) is not None:
            total += max(0.0, start - e["t"])
    return total


def _shutdown_s(events: list[dict]) -> float:
    """From the end state (FINISHED or FAILED) to the end of the job: teardown, the report, the metrics' last export."""
    end = next((e["t"] for e in reversed(events) if e["event"] == "state" and e.get("state") in ("FINISHED", "FAILED")), None)
    last = next((e["t"] for e in reversed(events) if e["event"] == "job_end"), None)
    return max(0.0, last - end) if end is not None and last is not None else 0.0


def _last_training_size(world: list[tuple[float, int]]) -> int | None:
    """The world size of the last generation that trained (a failure's 0 is not a size)."""
    return next((w for _, w in reversed(world) if w), None)


# --------------------------------------------------------------------------- table
def _num(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _layout(layout: dict) -> str:
    parts = [f"{axis}={degree}" for axis, degree in layout.items() if degree > 1]
    return "x".join(parts) or "single"


def summary_rows(report: dict) -> list[tuple[str, str]]:
    """The run at a glance: one (label, value) row per line of the summary table."""
    sizes = [f"{w} ({_layout(layout)})" for w, layout in zip(report["world_sizes"], report["layouts"])]
    samples = report["samples"] or {}  # None: a report rebuilt from the event log has no ledger
    skipped = report["checkpoints_skipped"]
    state = report["state"] + (f": {report['reason']}" if report.get("reason") else "")
    return [
        ("run", f"{report['name']} ({state})"),
        ("steps", f"{report['steps_completed']} / {report['steps_planned']}"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("goodput", f"{report['goodput']:.1%} of wall time in kept training steps" + (
            f"; {report['goodput_training']:.1%} of the training window (first step to last)"
            if report.get("goodput_training") is not None else "")),
        ("loss", f"{_num(report['initial_loss'], '{:.4f}')} -> {_num(report['final_loss'], '{:.4f}')}"),
        *([("eval loss", f"{_num(report['final_eval_loss'], '{:.4f}')} after {report['eval_losses'][-1]['step']} steps "
                         f"({len(report['eval_losses'])} evaluations)")] if report.get("eval_losses") else []),
        ("world sizes", " -> ".join(sizes) or "-"),
        ("generations", str(report["generations"])),
        ("failures", f"{report['failures_detected']} detected, {report['faults_injected']} faults injected"),
        ("samples", (f"{samples.get('expected', '-')} expected: {samples.get('seen_once', '-')} seen once, "
                     f"{samples.get('duplicated', '-')} duplicated, {samples.get('missing', '-')} missing")),
        ("checkpoints", (f"{len(report['checkpoints_committed'])} committed (last step {_num(report['last_committed_step'], '{}')}), "
                         f"{len(skipped)} skipped")),
        ("checkpoint time", (f"ranks stalled {_num(report.get('checkpoint_stall_s'))} s for their saves; "
                             f"commits took {_num(report.get('checkpoint_commit_s'))} s in the background")),
        *([("memory tier", _memory_line(report["memory_tier"]))] if report.get("memory_tier") else []),
    ]


def _memory_line(m: dict) -> str:
    return (f"{m['snapshots_committed']} snapshots committed ({m.get('snapshots_replicated', 0)} also on another node; "
            f"last step {_num(m['last_committed_step'], '{}')}), "
            f"{m['restores']} restores from memory; ranks waited {_num(m['stall_s'])} s for them (inside step times); "
            f"state {m['state_bytes'] / 2**20:.1f} MiB, nodes hold at most {m['held_bytes_bound'] / 2**20:.1f} MiB"
            + (f"; {m['snapshots_failed']} rank snapshots failed (warnings)" if m.get("snapshots_failed") else ""))



FAILURE_COLUMNS = ("#", "kind", "detected as", "rank", "node", "culprit", "step", "detect s", "recover s", "lost steps", "resume step",
                   "from")


def failure_rows(report: dict) -> list[list[str]]:
    """One row per detected failure; node ids are Ray's 56-hex ids, so only their head is shown."""
    rows = []
    for i, f in enumerate(report["failures"], 1):
        node = f.get("node")
        rows.append([str(i), str(f.get("kind")), str(f.get("detected_as") or "-"), _num(f.get("rank"), "{}"),
                     node[:8] if isinstance(node, str) else "-", _num(f.get("culprit"), "{}"), _num(f.get("step"), "{}"),
                     _num(f.get("detect_s"), "{:.3f}"), _num(f.get("recover_s"), "{:.3f}"), _num(f.get("lost_steps"), "{}"),
                     _num(f.get("resume_step"), "{}"), str(f.get("restored_from") or "-")])
    return rows


def breakdown_rows(timeline: RunTimeline) -> list[list[str]]:
    wall = timeline.wall_s or 1.0
    return [[name, f"{timeline.breakdown[name]:.2f}", f"{timeline.breakdown[name] / wall:.1%}"] for name in BREAKDOWN]


def _plain(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [list(columns)] + rows) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [list(columns)] + rows)


def render_plain(report: dict, timeline: RunTimeline) -> str:
    """The report as aligned plain text, for pipes, `ray job logs` and CI logs."""
    width = max(len(k) for k, _ in summary_rows(report))
    out = [f"{k.ljust(width)}  {v}" for k, v in summary_rows(report)]
    failures = failure_rows(report)
    out += ["", "failures:", _plain(FAILURE_COLUMNS, failures) if failures else "none"]
    out += ["", "time breakdown:", _plain(("part", "seconds", "of wall"), breakdown_rows(timeline))]
    return "\n".join(out)


def print_rich(report: dict, timeline: RunTimeline) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    summary = Table(title=f"run {report['name']}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    for label, value in summary_rows(report):
        summary.add_row(label, value, style="red" if label == "run" and report["state"] != "FINISHED" else None)
    console.print(summary)
    failures = failure_rows(report)
    if failures:
        table = Table(title="failures", padding=(0, 0), collapse_padding=True)
        for col in FAILURE_COLUMNS:
            table.add_column(col, justify="left" if col in ("kind", "detected as", "node") else "right")
        for row in failures:
            table.add_row(*row)
        console.print(table)
    else:
        console.print("failures: none")
    breakdown = Table(title="time breakdown")
    for col in ("part", "seconds", "of wall"):
        breakdown.add_column(col, justify="left" if col == "part" else "right")
    for row in breakdown_rows(timeline):
        breakdown.add_row(*row)
    console.print(breakdown)


def run(args: argparse.Namespace) -> int:
    """Every attempt of the run (earlier invocations under attempts/N first), then the plots of the latest."""
    from elastic.rundir import attempts

    run_dir = Path(args.run_dir)
    earlier = attempts(run_dir) if run_dir.is_dir() else []
    for number, directory in enumerate([*earlier, run_dir], 1):
        report, events = load_run(directory)
        timeline = analyse(report, events)
        if earlier:
            print(f"{'' if number == 1 else chr(10)}== attempt {number} of {len(earlier) + 1} ({directory})")
        if sys.stdout.isatty():
            print_rich(report, timeline)
        else:
            print(render_plain(report, timeline))
    if not args.no_plots:
        from elastic.plots import write_plots

        paths = write_plots(report, timeline, Path(args.run_dir))
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0
