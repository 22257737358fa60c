"""End-to-end elastic runs on an embedded multi-node Ray cluster (loopback), with real process and node kills."""

import torch

from ckpt_utils import full_tensors
from elastic.config import load_config
from elastic.job import run_job


def _cfg(tmp_path, name, **over):
    sets = {
        "name": name,
        "run_root": str(tmp_path / "runs"),
        "checkpoint.uri": str(tmp_path / name / "ckpt"),
        "checkpoint.every_steps": 8,
        "training.steps": 32,
        "training.global_batch": 16,
        "training.micro_batch": 4,
        "fault.inject": "[]",
        "checkpoint.memory": "false",  # the durable tier alone (tests/test_memory_tier.py has the memory tier)
        **over,
    }
    return load_config("deploy/examples/demo.yaml", [f"{k}={v}" for k, v in sets.items()])


def _clean_ledger(report):
    s = report["samples"]
    assert s["missing"] == 0 and s["duplicated"] == 0
    assert s["seen_once"] == s["expected"] == report["steps_completed"] * 16


def test_node_loss_shrinks_and_keeps_every_sample(tmp_path):
    report = run_job(_cfg(tmp_path, "node"), ["node:rank=3,step=13"], quiet=True)
    assert report["state"] == "FINISHED"
    assert report["world_sizes"] == [4, 2]
    (failure,) = report["failures"]
    assert failure["kind"] == "node" and failure["detected_as"] == "node_died"
    assert failure["detect_s"] < 1.0 and failure["recover_s"] > 0
    assert failure["lost_steps"] == 13 - 8
    _clean_ledger(report)
    assert report["final_loss"] < report["initial_loss"]


def test_killed_worker_replaced_same_world_bitwise_pp_tp_async(tmp_path):
    # A 2-stage pipeline of tensor-parallel pairs; the resumed run also saves asynchronously.
    layout = {"parallel.pp": 2, "parallel.tp": 2}
    ref = run_job(_cfg(tmp_path, "ref", **layout), quiet=True)
    hit = run_job(_cfg(tmp_path, "kill", **layout, **{"checkpoint.async_save": "true"}), ["kill:rank=1,step=19"], quiet=True)
    assert ref["state"] == hit["state"] == "FINISHED"
    assert hit["world_sizes"] == [4, 4]
    (failure,) = hit["failures"]
    assert failure["kind"] == "kill" and failure["rank"] == 1 and failure["detect_s"] < 1.0
    _clean_ledger(hit)
    assert hit["losses"] == ref["losses"]
    a = full_tensors(str(tmp_path / "ref" / "ckpt"), 32)
    b = full_tensors(str(tmp_path / "kill" / "ckpt"), 32)
    assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_worker_that_cannot_start_is_reported_not_hung(tmp_path):
    report = run_job(_cfg(tmp_path, "nocuda", device="cuda", **{"fault.max_failures": 0}), quiet=True)
    assert report["state"] == "FAILED" and "max_failures" in report["reason"]
    (failure,) = report["failures"]
    assert failure["detected_as"] == "worker_error"
    assert "CUDA" in failure["error"] or "cuda" in failure["error"]


def test_one_node_runs_on_the_head_unless_nodes_are_removed():
    import ray

    from elastic.cluster import connect

    for removes_nodes, want_nodes, head_cpus in ((False, 1, 2.0), (True, 2, 0.0)):
        cluster = connect(None, 1, 2, 0, removes_nodes=removes_nodes)
        try:
            alive = [n for n in ray.nodes() if n["Alive"]]
            head = [n for n in alive if n["NodeID"] not in cluster.nodes]
            assert len(alive) == want_nodes and len(head) == 1
            assert head[0]["Resources"].get("CPU", 0.0) == head_cpus
            assert sum(n["Resources"].get("CPU", 0.0) for n in alive) == 2.0
        finally:
            cluster.shutdown()


def test_node_agent_lost_between_prepare_and_start_is_retried(tmp_path, monkeypatch):
    # The agent dies after its rank processes came up, before they get their ranks (its node going away at
    # that moment): a start failure for the failure policy, not an exception out of the controller.
    import elastic.job
    from agent_faults import KilledBeforeStart
    from elastic.worker_group import RayWorkerGroup

    class LosesItsFirstAgent(RayWorkerGroup):
        lost = 0

        def _agent(self, node_id, slots):
            agent = super()._agent(node_id, slots)
            if LosesItsFirstAgent.lost:
                return agent
            LosesItsFirstAgent.lost += 1
            return KilledBeforeStart(agent)

    monkeypatch.setattr(elastic.job, "RayWorkerGroup", LosesItsFirstAgent)
    sets = {"training.steps": 4, "scaling.num_workers": 2, "scaling.workers_per_node": 2, "training.micro_batch": 8}
    report = run_job(_cfg(tmp_path, "lost", **sets), quiet=True)
    assert report["state"] == "FINISHED" and report["steps_completed"] == 4
    (failure,) = report["failures"]
    assert failure["detected_as"] == "start_failed" and "ActorDiedError" in failure["error"]
    _clean_ledger(report)
