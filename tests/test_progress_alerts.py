"""The progress line (plain and rich) and the gradient-norm spike rule."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from elastic.alerts import GradSpikeRule
from elastic.config import ConfigError, load_config
from elastic.events import EventLog
from elastic.job import run_job
from elastic.progress import ProgressPrinter


def _step(step, t, loss=3.0, grad=1.0, world=4, gen=1, step_s=0.1):
    return {"t": t, "event": "step", "step": step, "loss": loss, "generation": gen, "world_size": world, "step_s": step_s, "grad_norm": grad}


def _run_events():
    """A small run: 10 steps, a checkpoint at 5, a failure and a recovery, a grad spike warning."""
    gen = {"event": "generation_start", "generation": 1, "world_size": 4, "layout": {"dp_shard": 4}, "resume_step": None, "reason": "start"}
    yield {"t": 0.0, **gen}
    for i in range(1, 6):  # step events count completed steps: the first step is step 1
        yield _step(i, i)
    yield {"t": 6.0, "event": "checkpoint_committed", "step": 5, "commit_s": 0.1, "save_s": 0.2, "stall_s": 0.2, "bytes": 100}
    yield {"t": 6.5, "event": "failure_detected", "kind": "kill", "detected_as": "rank_died", "rank": 1, "culprit": 1, "detect_s": 0.05}
    yield {"t": 6.6, "event": "recovering", "resume_step": 5, "lost_steps": 0}
    yield {"t": 7.0, **gen, "generation": 2, "world_size": 2, "resume_step": 5}
    for i in range(6, 11):
        yield _step(i, 7.0 + i, world=2, gen=2, loss=2.0)
    yield {"t": 17.5, "event": "warning", "kind": "grad_spike", "step": 10, "value": 30.0, "threshold": 10.0, "message": "grad norm 30 at step 10"}
    yield {"t": 18.0, "event": "state", "state": "FINISHED", "previous": "RUNNING", "generation": 2}
    yield {"t": 18.1, "event": "job_end", "state": "FINISHED"}


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    printer = ProgressPrinter(10, 512, every_s=4.0, console=Console(file=out))
    assert not printer.live_mode
    for e in _run_events():
        printer(e)
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    step_lines = [l for l in lines if l.startswith("step ")]
    # The first step, then every 4 s of event time (steps at t=1..5, 13..17), and the last step.
    assert [l.split()[1] for l in step_lines] == ["1/10", "5/10", "6/10", "10/10"]
    assert step_lines[-1] == "step    10/10  loss 2.0000  grad 1.000  tok/s 5,120  world 2  gen 2  ckpt 5  failures 1"
    assert "[failure] rank_died rank 1 (culprit 1) detected in 0.050s" in lines
    assert "[gen 1] 4 workers, layout {'dp_shard': 4}, start from scratch: start" in lines
    assert "[recover] resume from step 5, lost 0 steps" in lines and "[gen 2] 2 workers, layout {'dp_shard': 4}, start from step 5: start" in lines
    assert "[warning] grad_spike: grad norm 30 at step 10" in lines
    assert lines[-1] == "[finished] last checkpoint at 5 steps"


def test_a_memory_tier_without_a_replica_says_so():
    out = io.StringIO()
    printer = ProgressPrinter(10, 512, console=Console(file=out))
    printer({"t": 1.0, "event": "replica_ring", "generation": 1, "ring": ["n1"], "reason": "no other node of the job is up"})
    printer({"t": 2.0, "event": "replica_ring", "generation": 1, "ring": ["n1", "n2"], "reason": "node n2 holds the replicas"})
    assert out.getvalue() == "[memory] no other node of the job is up\n[memory] node n2 holds the replicas\n"


def test_a_recovery_without_a_checkpoint_resumes_from_scratch():
    out = io.StringIO()
    printer = ProgressPrinter(10, 512, console=Console(file=out))
    printer({"t": 3.0, "event": "recovering", "resume_step": None, "lost_steps": 3})  # failed before the first checkpoint
    assert out.getvalue() == "[recover] resume from scratch, lost 3 steps\n"


def test_rich_live_line_on_a_terminal():
    out = io.StringIO()
    printer = ProgressPrinter(10, 512, console=Console(file=out, force_terminal=True, width=160))
    assert printer.live_mode
    for e in _run_events():
        printer(e)
    text = out.getvalue()
    assert "\x1b[2K" in text  # the line is erased and redrawn in place
    # The notes are printed above the live line, as lines of their own, with their brackets (no markup).
    assert "[failure] rank_died rank 1" in text and "[gen 2] 2 workers" in text and "[warning] grad_spike" in text
    # The last drawing of the live line holds the final numbers and stays on the screen.
    last = text[text.rindex("step "):]
    for part in ("step    10/10", "loss 2.0000", "tok/s 5,120", "world 2", "gen 2", "ckpt 5", "failures 1"):
        assert part in last, part
    assert text.rstrip().endswith("[finished] last checkpoint at 5 steps")
    assert printer._live is None


def _rule(factor=10.0, window=5, warmup=3):
    warnings = []
    rule = GradSpikeRule(lambda event, **f: warnings.append({"event": event, **f}), factor, window, warmup)
    return rule, warnings


def test_spike_rule_warns_on_a_jump_over_the_recent_median():
    rule, warnings = _rule()
    for i, g in enumerate([50.0, 1.0, 1.2, 0.9, 1.1, 1.0, 9.0, 12.0, 1.0, 1.1, 30.0, math.inf]):
        rule(_step(i, float(i), grad=g))
        rule({"t": float(i), "event": "checkpoint_committed", "step": i})  # other events are ignored
    # Step 0 (50) falls in the warm-up; 9.0 is under 10 x the median; the median
    # shrugs off the earlier spike, so 30.0 still warns; a non-finite norm always does.
    assert [w["step"] for w in warnings] == [7, 10, 11]
    w = warnings[0]
    assert w["event"] == "warning" and w["kind"] == "grad_spike"
    assert w["value"] == 12.0 and w["median"] == pytest.approx(1.1) and w["threshold"] == pytest.approx(11.0)
    assert "12" in w["message"]


def test_spike_rule_factor_is_validated():
    with pytest.raises(ValueError):
        GradSpikeRule(print, 1.0)
    with pytest.raises(ConfigError, match="grad_spike_factor"):
        load_config("deploy/examples/demo.yaml", ["fault.grad_spike_factor=0.5"])
    assert load_config("deploy/examples/demo.yaml", ["fault.grad_spike_factor=0"]).fault.grad_spike_factor == 0


def test_spike_warning_goes_through_the_event_log(tmp_path):
    seen = []
    log = EventLog(tmp_path / "events.jsonl", [seen.append])
    log.sinks.append(GradSpikeRule(log.emit, 10.0, 5, 2))
    for i, g in enumerate([1.0, 1.0, 1.0, 20.0]):
        fields = _step(i, float(i), grad=g)
        log.emit(fields.pop("event"), **fields)
    log.close()
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in written] == ["step"] * 4 + ["warning"]
    assert written[-1]["step"] == 3 and seen[-1] == written[-1]


def test_huge_learning_rate_raises_a_spike_warning_before_the_loss_diverges(tmp_path):
    cfg = load_config("deploy/examples/demo.yaml", [
        "name=spike", f"run_root={tmp_path}", f"checkpoint.uri={tmp_path / 'ckpt'}", "fault.inject=[]",
        "scaling.num_workers=2", "scaling.min_workers=1", "training.global_batch=16", "training.steps=8",
        "checkpoint.every_steps=8", "training.lr=5", "training.grad_clip=0",
        # The first update at this lr already blows up: judge from the second step on.
        "fault.grad_spike_warmup=1",
    ])
    report = run_job(cfg, quiet=True)
    events = [json.loads(line) for line in (tmp_path / "spike" / "events.jsonl").read_text().splitlines()]
    spikes = [e for e in events if e["event"] == "warning" and e["kind"] == "grad_spike"]
    assert spikes, [e["grad_norm"] for e in events if e["event"] == "step"]
    first = spikes[0]
    assert first["value"] > first["threshold"] == pytest.approx(10 * first["median"])
    # Diverged: the loss ends far above where it started, and it got there after the warning.
    losses = report["losses"]
    diverged = next(step for step, loss in enumerate(losses) if loss > 10 * losses[0])
    assert first["step"] < diverged
