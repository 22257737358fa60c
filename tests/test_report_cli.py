"""`elastic report`: the table from a run directory, and PNG plots that are real images of a sensible size.

The run directory is synthesised here in the controller's format: 4 workers,
a node failure at step 36 detected 0.3 s later, a rollback to the checkpoint
of step 30 (steps 30-35 run twice), and the job finishing on 2 workers.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from elastic.cli import main
from elastic.commands.report import analyse, load_run, summary_rows

T0 = 1_700_000_000.0
STEP_S = 0.1
LAYOUT4 = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
LAYOUT2 = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
NODE = "f3a1c2d4e5b6a7980112233445566778899aabbccddeeff001122334"


def _loss(step: int) -> float:
    return 4.2 * 0.98 ** step


def make_run(run_dir: Path, steps: int = 60) -> Path:
    """Write events.jsonl and report.json of a run with one node failure and a shrink from 4 to 2 workers."""
    run_dir.mkdir(parents=True)
    events: list[dict] = []
    t = T0

    def emit(event: str, dt: float = 0.0, **fields) -> None:
        nonlocal t
        t += dt
        events.append({"t": t, "event": event, **fields})

    def run_steps(first: int, last: int, generation: int, world: int) -> None:
        for s in range(first, last):
            # Step events count completed steps: step index s is step s + 1.
            emit("step", STEP_S, step=s + 1, loss=_loss(s) + 0.01 * generation, generation=generation, world_size=world,
                 step_s=STEP_S, grad_norm=1.0)
            if (s + 1) % 10 == 0:
                # A synchronous save: the ranks waited 0.01 s between steps (their stall, its whole save); the
                # controller's commit took 0.05 s in the background.
                emit("checkpoint_committed", 0.01, step=s + 1, save_s=0.01, stall_s=0.01, commit_s=0.05, generation=generation)

    emit("job_start", config={"name": "synthetic"}, faults=[{"kind": "node", "rank": 3, "step": 36}])
    emit("state", state="SCHEDULING", previous="SCHEDULING", generation=0)
    emit("generation_start", 1.0, generation=1, world_size=4, layout=LAYOUT4, resume_step=None, available=4, reason="start")
    emit("state", state="RUNNING", previous="SCHEDULING", generation=1)
    run_steps(0, 36, 1, 4)
    emit("fault_injected", fault_id="f0", kind="node", rank=3, step=36, node=NODE, t_fault=t)
    emit("failure_detected", 0.3, kind="node", detected_as="dead", rank=3, node=NODE, culprit=3, step=36, fault_id="f0",
         detect_s=0.3, recover_s=None, lost_steps=None, detail="actor died")
    emit("state", state="RECOVERING", previous="RUNNING", generation=1)
    emit("recovering", 0.2, resume_step=30, restored_from="durable", lost_steps=6, reason="shrink to the 2 workers left")
    emit("generation_start", 1.5, generation=2, world_size=2, layout=LAYOUT2, resume_step=30, available=2, reason="shrink")
    run_steps(30, 31, 2, 2)
    emit("recovered", failure="node", recover_s=1.8, step=30)
    run_steps(31, steps, 2, 2)
    emit("state", state="FINISHED", previous="RUNNING", generation=2)
    emit("job_end", 0.1, state="FINISHED")
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    wall = t - T0
    report = {
        "name": "synthetic", "state": "FINISHED", "reason": None, "steps_completed": steps, "steps_planned": steps,
        "initial_loss": _loss(0) + 0.01, "final_loss": _loss(steps - 1) + 0.02,
        "losses": [_loss(s) for s in range(steps)], "world_sizes": [4, 2], "layouts": [LAYOUT4, LAYOUT2], "generations": 2,
        "failures": [{"kind": "node", "detected_as": "dead", "rank": 3, "node": NODE, "culprit": 3, "step": 36, "fault_id": "f0",
                      "detect_s": 0.3, "recover_s": 1.8, "lost_steps": 6, "resume_step": 30, "restored_from": "durable"}],
        "failures_detected": 1, "faults_injected": 1,
        "faults": [{"fault_id": "f0", "kind": "node", "rank": 3, "step": 36, "node": NODE, "t_fault": T0 + 5}],
        "samples": {"expected": steps * 32, "seen_once": steps * 32, "duplicated": 0, "missing": 0},
        "checkpoints_committed": list(range(10, steps + 1, 10)), "checkpoints_skipped": [], "last_committed_step": steps,
        "wall_s": wall, "goodput": steps * STEP_S / wall,
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    return run_dir


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk; fails on anything that is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path.name} has no IHDR chunk first"
    return struct.unpack(">II", head[16:24])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "runs" / "synthetic")


def test_table_lists_steps_goodput_failures_and_world_sizes(run_dir: Path, capsys) -> None:
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "synthetic (FINISHED)" in lines[0]
    assert any(line.split()[:4] == ["steps", "60", "/", "60"] for line in lines)
    report = json.loads((run_dir / "report.json").read_text())
    assert f"{report['goodput']:.1%}" in out and f"{report['wall_s']:.1f} s" in out
    assert "4 (dp_shard=4) -> 2 (dp_shard=2)" in out
    header = next(i for i, line in enumerate(lines) if line.startswith("#") and "detect s" in line)
    row = lines[header + 1].split()
    assert row == ["1", "node", "dead", "3", NODE[:8], "3", "36", "0.300", "1.800", "6", "30", "durable"]
    assert "1 detected, 1 faults injected" in out
    assert "1920 expected: 1920 seen once, 0 duplicated, 0 missing" in out
    assert not list(run_dir.glob("*.png"))


def test_time_breakdown_is_derived_from_events(run_dir: Path) -> None:
    report, events = load_run(run_dir)
    tl = analyse(report, events)
    parts = tl.breakdown
    assert parts["training"] == pytest.approx(60 * STEP_S)
    assert parts["checkpoint stall"] == pytest.approx(0.01 * (3 + 3))  # the ranks' stalls, not the 0.05 s background commits
    assert parts["start-up"] == pytest.approx(1.0)  # job start to the first step's start
    assert parts["shutdown"] == pytest.approx(0.1)  # the end state to job_end
    assert parts["detection"] == pytest.approx(0.3)
    assert parts["recovery"] == pytest.approx(1.8 - STEP_S)  # its first step after the restart is training
    assert parts["lost work"] == pytest.approx(6 * STEP_S)
    assert sum(parts.values()) == pytest.approx(report["wall_s"])
    assert tl.kept_steps == list(range(1, 61)) and sorted(s for s, _ in tl.rolled_back) == list(range(31, 37))
    assert [(m.step, m.label) for m in tl.failures] == [(36, "node rank 3")]
    assert [(m.step, m.label) for m in tl.resizes] == [(30, "4 -> 2 workers")]
    assert [w for _, w in tl.world] == [0, 4, 0, 2]


def _async_run() -> list[dict]:
    """Events of 8 one-second steps with an async save at step 4 and the final, synchronous save at step 8.

    The ranks wait 0.5 s for the async save's copy inside step 5 (1.5 s); the final save writes for 1 s after
    step 8; the controller then commits it in 0.2 s, which nothing else accounts for ("other").
    """
    events: list[dict] = []

    def emit(t: float, event: str, **fields) -> None:
        events.append({"t": T0 + t, "event": event, **fields})

    emit(0.0, "job_start", cluster_s=0.0, config={"name": "async"})
    emit(0.0, "generation_start", generation=1, world_size=2, layout=LAYOUT2, resume_step=None, available=2, reason="start")
    t = 1.0  # start-up: the first step starts here
    for step in range(1, 9):
        t += 1.5 if step == 5 else 1.0
        emit(t, "step", step=step, loss=_loss(step), generation=1, world_size=2, step_s=1.5 if step == 5 else 1.0, grad_norm=1.0)
        if step == 5:  # the async save of step 4, committed in the background while step 6 runs
            emit(t + 0.3, "checkpoint_committed", step=4, save_s=1.2, stall_s=0.5, commit_s=0.3, generation=1)
    emit(t + 1.2, "checkpoint_committed", step=8, save_s=1.0, stall_s=1.0, commit_s=0.2, generation=1)
    emit(t + 1.2, "state", state="FINISHED", previous="RUNNING", generation=1)
    emit(t + 1.5, "job_end", state="FINISHED")
    return events


def test_async_checkpoint_stall_is_counted_once_in_the_breakdown() -> None:
    from elastic.commands.report import report_from_events

    events = _async_run()
    report = report_from_events(events)
    assert report["checkpoint_stall_s"] == pytest.approx(1.5)  # the ranks' waits: 0.5 inside step 5, 1.0 after step 8
    assert report["checkpoint_commit_s"] == pytest.approx(0.5)  # the controller's background commits
    parts = analyse(report, events).breakdown
    assert report["wall_s"] == pytest.approx(11.0)
    assert parts["training"] == pytest.approx(8.5 - 0.5)  # the kept steps without the stall inside step 5
    assert parts["checkpoint stall"] == pytest.approx(1.5)
    assert (parts["start-up"], parts["shutdown"]) == (pytest.approx(1.0), pytest.approx(0.3))
    assert parts["other"] == pytest.approx(0.2)  # the last commit, which nothing else holds
    assert sum(parts.values()) == pytest.approx(report["wall_s"])
    rows = dict(summary_rows(report))
    assert rows["checkpoint time"] == "ranks stalled 1.50 s for their saves; commits took 0.50 s in the background"


def test_plots_are_valid_pngs_of_a_sensible_size(run_dir: Path, capsys) -> None:
    assert main(["report", str(run_dir)]) == 0
    assert "plots:" in capsys.readouterr().out
    for name in ("loss.png", "world_size.png", "time_breakdown.png"):
        width, height = png_size(run_dir / name)
        assert width >= 400 and height >= 300, (name, width, height)
        assert (run_dir / name).stat().st_size > 5_000, f"{name} looks empty"


def test_held_out_losses_are_plotted_once_per_step(run_dir: Path, monkeypatch) -> None:
    """Eval events make the loss plot's held-out series; an evaluation that a recovery ran again is drawn once, the later."""
    from elastic import plots

    path = run_dir / "events.jsonl"
    events = []
    for e in (json.loads(line) for line in path.read_text().splitlines()):
        events.append(e)
        if e["event"] == "step" and e["step"] % 5 == 0:  # eval_every 5: step 35 is evaluated by generation 1, then again by 2
            events.append({"t": e["t"], "event": "eval", "step": e["step"], "loss": _loss(e["step"]) + 0.1 * e["generation"],
                           "samples": 16, "generation": e["generation"]})
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    report, events = load_run(run_dir)
    tl = analyse(report, events)
    assert tl.eval_steps == list(range(5, 61, 5))
    assert tl.eval_losses[tl.eval_steps.index(35)] == _loss(35) + 0.2 and tl.eval_losses[0] == _loss(5) + 0.1
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig) or out)
    plots.plot_loss(report, tl, run_dir / "loss.png")
    (held,) = [line for line in figures[0].axes[0].get_lines() if line.get_label() == "held-out loss"]
    assert list(held.get_xdata()) == tl.eval_steps and list(held.get_ydata()) == tl.eval_losses


def test_rich_table_on_a_terminal(run_dir: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    for text in ("run synthetic", "failures", "time breakdown", "lost work", "dead", "0.300"):
        assert text in out


def test_a_run_without_failures(tmp_path: Path, capsys) -> None:
    run_dir = make_run(tmp_path / "clean", steps=30)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kept = [e for e in events if e["event"] not in ("fault_injected", "failure_detected", "recovering", "recovered")]
    kept = [e for e in kept if not (e["event"] == "generation_start" and e["generation"] == 2)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    report = json.loads((run_dir / "report.json").read_text())
    report.update(failures=[], failures_detected=0, faults_injected=0, world_sizes=[4], layouts=[LAYOUT4], generations=1)
    (run_dir / "report.json").write_text(json.dumps(report))
    assert main(["report", str(run_dir)]) == 0
    assert "failures:\nnone" in capsys.readouterr().out
    assert png_size(run_dir / "loss.png")[0] >= 400


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.rename(d.with_name("elsewhere")), "no such run directory"),
    (lambda d: [(d / "report.json").unlink(), (d / "events.jsonl").unlink()], "no events.jsonl and no report.json: not a run directory"),
    (lambda d: (d / "report.json").write_text("{not json"), "invalid JSON (line 1)"),
    (lambda d: (d / "report.json").write_text('{"name": "x"}'), "not a run report, missing state"),
    (lambda d: (d / "events.jsonl").unlink(), "no events.jsonl"),
])
def test_bad_run_dir_is_a_one_line_usage_error(run_dir: Path, capsys, damage, message) -> None:
    damage(run_dir)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_event_line_is_named_but_a_cut_off_last_line_is_tolerated(run_dir: Path, capsys) -> None:
    path = run_dir / "events.jsonl"
    good = path.read_text()
    path.write_text(good + '{"t": 1, "event": "st')  # the driver died mid-write
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    path.write_text("garbage\n" + good)
    assert main(["report", str(run_dir), "--no-plots"]) == 2
    assert "events.jsonl: line 1 is not JSON" in capsys.readouterr().err



def test_a_run_whose_driver_was_killed_is_rebuilt_from_its_events(run_dir: Path, capsys) -> None:
    (run_dir / "report.json").unlink()
    events = (run_dir / "events.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(events) if '"step": 46' in line)
    (run_dir / "events.jsonl").write_text("\n".join(events[:cut]) + "\n")  # killed during step 45
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "synthetic (UNFINISHED: no report.json: the run did not finish" in out.splitlines()[0]
    assert any(line.split()[:4] == ["steps", "45", "/", "?"] or line.split()[:2] == ["steps", "45"] for line in out.splitlines())
    assert "1 detected, 1 faults injected" in out and "4 (dp_shard=4) -> 2 (dp_shard=2)" in out


def test_goodput_over_the_training_window_leaves_out_start_up_and_shutdown(run_dir: Path, capsys) -> None:
    (run_dir / "report.json").unlink()  # rebuilt from the events: the controller's builder shares the helper
    report, _ = load_run(run_dir)
    # The 60 kept steps over the wall time less the 1.0 s before the first step and, after the last, its save's
    # 0.01 s and the 0.1 s of shutdown; the failure's detection, recovery and the 6 steps run twice stay inside the
    # window, as time not kept.
    assert report["goodput_training"] == pytest.approx(60 * STEP_S / (report["wall_s"] - 1.11))
    assert report["goodput"] < report["goodput_training"] < 1
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    assert f"{report['goodput_training']:.1%} of the training window" in capsys.readouterr().out


def test_every_attempt_of_a_run_is_shown_in_order(tmp_path: Path, capsys) -> None:
    run_dir = make_run(tmp_path / "runs" / "synthetic")
    make_run(run_dir / "attempts" / "1", steps=40)
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    first, second = out.index("== attempt 1 of 2"), out.index("== attempt 2 of 2")
    assert first < second
    assert "40 / 40" in " ".join(out[first:second].split()) and "60 / 60" in " ".join(out[second:].split())
