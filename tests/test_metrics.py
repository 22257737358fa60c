"""A run's metrics, read back from the Ray node's Prometheus endpoint.

The job joins a cluster the test owns (started with `ray.cluster_utils.Cluster`
on loopback, Ray's default 10 s metrics report interval, as on a real
cluster), so the endpoint outlives the job and the test reads what a
Prometheus scraping the node would read once the job has ended. The job flushes
its metrics before it leaves Ray; gauges stay served for two report intervals
after the driver's last export, counters and histograms for good.
"""

from __future__ import annotations

import json
import os

import pytest

from elastic.config import load_config
from elastic.job import run_job
from elastic.metrics import parse_prometheus, scrape


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        c.add_node(num_cpus=2)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def test_parse_prometheus_text():
    text = (
        "# HELP ray_elastic_loss Mean training loss.\n# TYPE ray_elastic_loss gauge\n"
        'ray_elastic_loss{job="a",note="say \\"hi\\""} 2.5\n'
        "up 1\n"
    )
    assert parse_prometheus(text) == [("ray_elastic_loss", {"job": "a", "note": 'say "hi"'}, 2.5), ("up", {}, 1.0)]


def test_metrics_of_a_run_with_a_failure(cluster, tmp_path):
    cfg = load_config("deploy/examples/demo.yaml", [
        "name=metrics-run", f"run_root={tmp_path / 'runs'}", f"checkpoint.uri={tmp_path / 'ckpt'}",
        "scaling.num_workers=2", "scaling.min_workers=1", "training.steps=20", "training.global_batch=16",
        "checkpoint.every_steps=5", "fault.inject=[]", "training.eval_every=10", "data.eval_samples=16",
    ])
    report = run_job(cfg, ["kill:rank=1,step=12"], address=cluster.address, quiet=True)
    assert report["state"] == "FINISHED"
    events = [json.loads(line) for line in (tmp_path / "runs" / "metrics-run" / "events.jsonl").read_text().splitlines()]
    (endpoint,) = [e["url"] for e in events if e["event"] == "metrics_endpoint"]
    assert endpoint.startswith("http://127.0.0.1:")
    assert not [e for e in events if e["event"] == "warning" and e["kind"] == "metrics_not_flushed"]

    series = {}
    for name, labels, value in scrape(endpoint):
        if labels.get("job") == "metrics-run":
            key = (name, *sorted((k, v) for k, v in labels.items() if k in ("event", "kind", "detected_as", "le", "tier")))
            series[key] = series.get(key, 0) + value

    def of(e):
        return [x for x in events if x["event"] == e]

    steps, commits = of("step"), of("checkpoint_committed")
    # Counters and histogram counts: exact.
    assert series[("ray_elastic_steps_total",)] == len(steps) >= 20
    assert series[("ray_elastic_step_seconds_count",)] == len(steps)
    for kind in {e["event"] for e in events}:
        assert series[("ray_elastic_events_total", ("event", kind))] == len(of(kind)), kind
    assert series[("ray_elastic_failures_total", ("detected_as", "rank_died"), ("kind", "kill"))] == 1
    assert series[("ray_elastic_failure_detect_seconds_count",)] == 1
    assert series[("ray_elastic_failure_recover_seconds_count",)] == 1
    assert series[("ray_elastic_checkpoint_save_seconds_count",)] == len(commits) >= 4
    assert series[("ray_elastic_checkpoint_bytes_total",)] == sum(e["bytes"] for e in commits) > 0
    # Histogram buckets are cumulative and end in +Inf.
    assert series[("ray_elastic_step_seconds_bucket", ("le", "+Inf"))] == len(steps)
    # Gauges: the last value of the run.
    last = steps[-1]
    assert series[("ray_elastic_loss",)] == pytest.approx(last["loss"])
    assert series[("ray_elastic_grad_norm",)] == pytest.approx(last["grad_norm"])
    assert [e["step"] for e in of("eval")] == [10, 20]
    assert series[("ray_elastic_eval_loss",)] == pytest.approx(of("eval")[-1]["loss"]) == pytest.approx(report["final_eval_loss"])
    assert series[("ray_elastic_tokens_per_second",)] == pytest.approx(16 * 16 / last["step_s"])
    assert series[("ray_elastic_world_size",)] == 2
    assert series[("ray_elastic_generation",)] == 2
    assert series[("ray_elastic_checkpoint_step",)] == commits[-1]["step"] == 20
    # The memory tier (on in the demo config): its newest snapshot, its size, and which tier the recovery used.
    memory = of("memory_committed")
    assert series[("ray_elastic_memory_step",)] == memory[-1]["step"] and series[("ray_elastic_memory_bytes",)] == memory[-1]["bytes"] > 0
    (recovering,) = of("recovering")
    assert series[("ray_elastic_restores_total", ("tier", recovering["restored_from"]))] == 1
