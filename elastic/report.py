"""report.json: what happened in a run and what it cost.

Built from the controller's own record at the end of a run. Every failure is
matched to the injected fault it detected (when there was one), with the
time from fault to detection and from detection to the first completed step
of the next generation. `samples` is the ledger: every kept step's samples
against the ones the global order assigned it; `data` says where in that
order the run started and ended (a resumed job starts where its checkpoint
left off); `eval_losses` are the held-out losses, by step.
"""

from __future__ import annotations

import json
from pathlib import Path


def build_report(ctrl, attempt: int = 1) -> dict:
    """The report of one invocation (`attempt` of the run: 1, or more after reruns under the same name).

    `checkpoint_stall_s` is what the ranks waited for their saves (the
    `stall_s` of each committed save); `checkpoint_commit_s` the controller's
    commits, which run in the background while training goes on.
    """
    cfg = ctrl.cfg
    steps = sorted(ctrl.losses)
    wall = ctrl.clock() - ctrl.started_at
    last_run = {e["step"]: kept_step_s(e) for e in ctrl.events.of("step")}  # a re-run step overwrites its rolled-back run
    kept_time = sum(last_run[s + 1] for s in steps)  # events number steps from 1, the loss table by their index
    injected = ctrl.events.of("fault_injected")
    return {
        "name": cfg.name,
        "attempt": attempt,
        "state": ctrl.state.value,
        "reason": ctrl.failed_reason,
        "steps_completed": len(steps),
        "steps_planned": cfg.training.steps,
        "initial_loss": ctrl.losses[steps[0]] if steps else None,
        "final_loss": ctrl.losses[steps[-1]] if steps else None,
        "losses": [ctrl.losses[s] for s in steps],
        "world_sizes": [e["world_size"] for e in ctrl.events.of("generation_start")],
        "layouts": [e["layout"] for e in ctrl.events.of("generation_start")],
        "generations": ctrl.generation,
        "failures": [
            {**{k: v for k, v in f.items() if k not in ("detected_at", "detail")}, "error": _last_line(f["detail"])} for f in ctrl.failures
        ],
        "failures_detected": len(ctrl.failures),
        "faults_injected": len(injected),
        "faults": [{k: e.get(k) for k in ("fault_id", "kind", "rank", "step", "node", "t_fault")} for e in injected],
        "samples": ctrl.ledger.summary(),
        "data": {
            "kind": cfg.data.kind,
            "train_samples": ctrl.data.train_samples,
            "eval_samples": ctrl.data.eval_samples,
            "start_position": ctrl.sampler.cursor(steps[0]) if steps else None,
            "end_position": ctrl.sampler.cursor(steps[-1] + 1) if steps else None,
        },
        "eval_losses": [{"step": s, "loss": ctrl.eval_losses[s]} for s in sorted(ctrl.eval_losses)],
        "final_eval_loss": ctrl.eval_losses[max(ctrl.eval_losses)] if ctrl.eval_losses else None,
        "checkpoints_committed": [e["step"] for e in ctrl.events.of("checkpoint_committed")],
        "checkpoints_skipped": [{"step": e["step"], "reason": e["reason"]} for e in ctrl.events.of("checkpoint_skipped")],
        "last_committed_step": ctrl.last_committed,
        "checkpoint_stall_s": sum(e.get("stall_s") or 0.0 for e in ctrl.events.of("checkpoint_committed")),
        "checkpoint_commit_s": sum(e.get("commit_s") or 0.0 for e in ctrl.events.of("checkpoint_committed")),
        "memory_tier": memory_tier(cfg.checkpoint.memory, cfg.checkpoint.memory_replicas, ctrl.events.events),
        "wall_s": wall,
        "goodput": kept_time / wall if wall > 0 else 0.0,
        "goodput_training": training_goodput(ctrl.events.of("step"), kept_time),
    }


def kept_step_s(step_event: dict) -> float:
    """What a step event adds to kept time: `kept_s`, the slowest rank's step time capped by the wall time since the
    step before ended (`elastic.controller`); an older log's events have only `step_s`."""
    return step_event.get("kept_s", step_event["step_s"])


def training_goodput(step_events: list[dict], kept_time: float) -> float | None:
    """Kept step time over the training window, from the first step's start to the last step's end (None before a
    step). `goodput` divides by the whole wall time, so a short run reads low for its start-up (Ray, the rank
    processes, imports) and its final save alone; this is what failures, recoveries and checkpoints cost training."""
    if not step_events:
        return None
    window = step_events[-1]["t"] - (step_events[0]["t"] - step_events[0]["step_s"])
    return kept_time / window if window > 0 else None


def memory_tier(enabled: bool, replicas: int, events: list[dict]) -> dict | None:
    """What the memory tier did (None when it is off): snapshots committed, the newest, what waiting for them cost
    the ranks (inside their step times), the state's size, and the most the nodes held for it together."""
    if not enabled:
        return None
    committed = [e for e in events if e["event"] == "memory_committed"]
    state_bytes = committed[-1]["bytes"] if committed else 0
    return {
        "snapshots_committed": len(committed),
        "snapshots_replicated": sum(bool(e.get("replicated")) for e in committed),  # with a copy on another node too
        "last_committed_step": committed[-1]["step"] if committed else None,
        "stall_s": sum(e.get("memory_stall_s") or 0.0 for e in events if e["event"] == "step"),
        "state_bytes": state_bytes,
        "held_bytes_bound": state_bytes * (1 + replicas) * 2,
        "restores": sum(e["event"] == "recovering" and e.get("restored_from") == "memory" for e in events),
        "snapshots_failed": sum(e["failed"] for e in events if e["event"] == "memory_snapshots_failed"),  # rank by rank
    }


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def write_report(report: dict, run_dir: Path) -> Path:
    path = Path(run_dir) / "report.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path
