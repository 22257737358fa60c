"""Prometheus metrics of a run, published through Ray's metrics API.

`RayMetrics` is an event sink: the controller's events become Ray metrics
(`ray.util.metrics`), which every Ray node's metrics agent serves in the
Prometheus text format on `MetricsExportPort` (see `ray.nodes()`), where a
cluster's Prometheus already scrapes Ray's own metrics. Ray prefixes each name
with `ray_` and suffixes counters with `_total`: `elastic_loss` is scraped as
`ray_elastic_loss`, `elastic_failures` as `ray_elastic_failures_total`.
Every series carries the job name as the `job` label.

Ray pushes a process's metrics to its node's agent only every
`metrics_report_interval_ms` (10 s by default) and has no flush call, so the
last values of a run would be lost if the driver disconnected right after its
last event. `flush()` waits until the agent serves everything recorded so far;
`run_job` calls it before the driver leaves a cluster it joined (an embedded
cluster goes away with the job: there is nothing left to scrape).

The agent keeps counters and histograms after the driver has gone, but drops
a gauge two report intervals after its last export: gauges (loss, world size)
describe a running job, counters and histograms also a finished one.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request

import ray
from ray.util.metrics import Counter, Gauge, Histogram

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = {k: v.encode().decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
            samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def scrape(url: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode())


def local_metrics_url() -> str | None:
    """The Prometheus endpoint of the Ray node this process is connected to (None if it exports none)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


class RayMetrics:
    """Event sink publishing a run's vital numbers as Ray metrics (Prometheus format)."""

    def __init__(self, job: str, tokens_per_step: int):
        self.tags = {"job": job}
        self.tokens_per_step = tokens_per_step
        self.recorded = 0  # events counted into `elastic_events`, the marker flush() waits for
        self.url = local_metrics_url()
        self.worker_id = ray.get_runtime_context().get_worker_id()
        job_tag = ("job",)
        self.events = Counter("elastic_events", "Controller events, by kind.", tag_keys=job_tag + ("event",))
        self.steps = Counter("elastic_steps", "Optimizer steps completed by every data-parallel rank.", tag_keys=job_tag)
        self.step_seconds = Histogram(
            "elastic_step_seconds", "Duration of one optimizer step (slowest rank).",
            boundaries=[0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100], tag_keys=job_tag,
        )
        self.tokens_per_s = Gauge("elastic_tokens_per_second", "Training throughput of the last step.", tag_keys=job_tag)
        self.loss = Gauge("elastic_loss", "Mean training loss of the last step.", tag_keys=job_tag)
        self.eval_loss = Gauge("elastic_eval_loss", "Mean loss on the held-out split at the last evaluation.", tag_keys=job_tag)
        self.grad_norm = Gauge("elastic_grad_norm", "Global gradient norm of the last step, before clipping.", tag_keys=job_tag)
        self.world_size = Gauge("elastic_world_size", "Ranks in the current generation.", tag_keys=job_tag)
        self.generation = Gauge("elastic_generation", "Current generation (restarts and resizes so far + 1).", tag_keys=job_tag)
        self.failures = Counter(
            "elastic_failures", "Failures detected, by injected or detected kind.", tag_keys=job_tag + ("kind", "detected_as")
        )
        self.detect_seconds = Histogram(
            "elastic_failure_detect_seconds", "From an injected fault to its detection.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60], tag_keys=job_tag,
        )
        self.recover_seconds = Histogram(
            "elastic_failure_recover_seconds", "From a detection to the first completed step after it.",
            boundaries=[1, 2, 5, 10, 20, 30, 60, 120, 300, 600], tag_keys=job_tag,
        )
        self.save_seconds = Histogram(
            "elastic_checkpoint_save_seconds", "Time the slowest rank took to write its shards of a checkpoint.",
            boundaries=[0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300], tag_keys=job_tag,
        )
        self.checkpoint_bytes = Counter("elastic_checkpoint_bytes", "Tensor bytes written in committed checkpoints.", tag_keys=job_tag)
        self.checkpoint_step = Gauge("elastic_checkpoint_step", "Step of the newest committed checkpoint.", tag_keys=job_tag)
        self.warnings = Counter("elastic_warnings", "Warnings raised by the alert rules, by kind.", tag_keys=job_tag + ("kind",))
        self.memory_step = Gauge("elastic_memory_step", "Step of the newest committed memory-tier snapshot.", tag_keys=job_tag)
        self.memory_bytes = Gauge(
            "elastic_memory_bytes", "Bytes of one memory-tier snapshot of the whole state (one copy; the nodes hold at most "
            "x (1 + replicas) x 2).", tag_keys=job_tag,
        )
        self.restores = Counter("elastic_restores", "Recoveries, by the tier they restored from.", tag_keys=job_tag + ("tier",))

    def __call__(self, e: dict) -> None:
        tags = self.tags
        kind = e["event"]
        if kind == "step":
            self.steps.inc(1, tags)
            self.step_seconds.observe(e["step_s"], tags)
            if e["step_s"] > 0:
                self.tokens_per_s.set(self.tokens_per_step / e["step_s"], tags)
            self.loss.set(e["loss"], tags)
            if math.isfinite(e["grad_norm"]):
                self.grad_norm.set(e["grad_norm"], tags)
            self.world_size.set(e["world_size"], tags)
            self.generation.set(e["generation"], tags)
        elif kind == "eval":
            self.eval_loss.set(e["loss"], tags)
        elif kind == "generation_start":
            self.world_size.set(e["world_size"], tags)
            self.generation.set(e["generation"], tags)
        elif kind == "failure_detected":
            self.failures.inc(1, {**tags, "kind": e["kind"], "detected_as": e["detected_as"]})
            if e.get("detect_s") is not None:
                self.detect_seconds.observe(e["detect_s"], tags)
        elif kind == "recovered":
            self.recover_seconds.observe(e["recover_s"], tags)
        elif kind == "checkpoint_committed":
            self.save_seconds.observe(e["save_s"], tags)
            self.checkpoint_bytes.inc(e["bytes"], tags)
            self.checkpoint_step.set(e["step"], tags)
        elif kind == "warning":
            self.warnings.inc(1, {**tags, "kind": e["kind"]})
        elif kind == "memory_committed":
            self.memory_step.set(e["step"], tags)
            self.memory_bytes.set(e["bytes"], tags)
        elif kind == "recovering":
            self.restores.inc(1, {**tags, "tier": e.get("restored_from") or "none"})
        self.events.inc(1, {**tags, "event": kind})
        self.recorded += 1

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until this node's agent serves every event recorded so far; False if it did not in time.

        Ray has no flush call: this waits for the next periodic export (at most
        one report interval) and checks that it arrived, by the count of
        `elastic_events` this process has exported.
        """
        if self.url is None or self.recorded == 0:
            return self.recorded == 0
        interval = max(ray._config.metrics_report_interval_ms(), 1000) / 1000
        deadline = time.time() + (timeout_s if timeout_s is not None else 2 * interval + 5)
        while True:
            try:
                exported = sum(
                    value for name, labels, value in scrape(self.url)
                    if name == "ray_elastic_events_total" and labels.get("WorkerId") == self.worker_id and labels.get("job") == self.tags["job"]
                )
            except OSError:
                exported = -1
            if exported >= self.recorded:
                return True
            if time.time() >= deadline:
                return False
            time.sleep(min(0.25, interval / 4))
