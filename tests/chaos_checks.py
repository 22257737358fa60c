"""What a chaos run must prove: every fault detected and named, nothing lost, the same model as a clean run."""

from __future__ import annotations

import re

import torch

from ckpt_utils import full_tensors
from elastic.events import read_events

DETECTED_AS = {"kill": "rank_died", "kill_during_save": "rank_died", "node": "node_died", "hang": "hang"}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(b.norm(), 1e-30))


def check_chaos_run(report: dict, run_dir, ckpt_uri: str, ref_uri: str) -> dict:
    events = read_events(run_dir / "events.jsonl")
    assert report["state"] == "FINISHED", report["reason"]
    injected = [e for e in events if e["event"] == "fault_injected"]
    by_fault = {i: f for f in report["failures"] for i in f["fault_ids"]}  # faults that fire together end in one failure
    t_fault = {e["fault_id"]: e.get("t_fault") for e in injected}
    skipped = {e["step"] for e in events if e["event"] == "checkpoint_skipped"}
    memory_skips = [e for e in events if e["event"] == "memory_snapshot_skipped"]
    for fault in injected:
        if fault["kind"] == "corrupt" and fault.get("where") == "memory":
            assert any(e["t"] >= fault["t"] for e in memory_skips), f"corrupted memory snapshots were not detected: {fault}"
            continue
        if fault["kind"] == "corrupt":
            step = int(re.search(r"step_(\d+)", fault["target"]).group(1))
            assert step in skipped, f"corrupted checkpoint {step} was not detected"
            continue
        failure = by_fault.get(fault["fault_id"])
        assert failure is not None, f"fault {fault} was never detected"
        if failure["fault_id"] == fault["fault_id"]:  # the failure's own fault; the others hit the ranks it took with it
            assert failure["kind"] == fault["kind"] and failure["detected_as"] == DETECTED_AS[fault["kind"]], failure
            assert failure["culprit"] == fault["rank"], (failure, fault)
        assert failure["node"] and failure["detect_s"] is not None and failure["recover_s"] is not None, failure
        detected_at = t_fault[failure["fault_id"]] + failure["detect_s"]
        assert detected_at - fault["t_fault"] < (1.0 if fault["kind"] != "hang" else 30.0), (failure, fault)
        assert failure["lost_steps"] is not None
        if failure.get("restored_from") == "memory":
            assert failure["lost_steps"] <= 1, failure  # the memory tier's promise
    bad: set[int] = set()  # corrupted and not committed again since
    for e in events:
        if e["event"] == "fault_injected" and e["kind"] == "corrupt" and e.get("where") != "memory":
            bad.add(int(re.search(r"step_(\d+)", e["target"]).group(1)))
        elif e["event"] == "checkpoint_committed":
            bad.discard(e["step"])
        elif e["event"] == "generation_start" and e.get("resume_tier") != "memory":  # memory restores are checked above
            assert e["resume_step"] not in bad, f"generation {e['generation']} loaded corrupt checkpoint {e['resume_step']}"
    assert report["faults_injected"] == len(injected)
    assert report["goodput"] < report["goodput_training"] < 1  # start-up is outside the window; failures inside it
    assert report["failures_detected"] == len(report["failures"]) >= len({f["fault_id"] for f in report["failures"] if f["fault_ids"]})
    samples = report["samples"]
    assert samples["missing"] == 0 and samples["duplicated"] == 0 and samples["seen_once"] == samples["expected"] > 0

    steps = report["steps_completed"]
    got, ref = full_tensors(ckpt_uri, steps), full_tensors(ref_uri, steps)
    assert got.keys() == ref.keys()
    same_world = len(set(report["world_sizes"])) == 1
    worst = 0.0
    for key in ref:
        if same_world:
            assert torch.equal(got[key], ref[key]), key
        else:
            worst = max(worst, rel_diff(got[key], ref[key]))
    assert worst <= 1e-5, worst
    return {"injected": injected, "worst_rel_diff": worst, "same_world": same_world}
