"""Run one elastic job: connect to Ray, host the store, drive the controller, write the report."""

from __future__ import annotations

import math
import shutil
from datetime import timedelta
from pathlib import Path

import ray
import torch.distributed as dist

import storage
from elastic.alerts import GradSpikeRule
from elastic.cluster import connect
from elastic.config import ConfigError, JobConfig
from elastic.controller import Controller, State
from elastic.events import EventLog
from elastic.faults import FaultSpecError, parse_faults
from elastic.metrics import RayMetrics
from elastic.progress import ProgressPrinter
from elastic.recipe import check_init_from, check_model
from elastic.report import build_report, write_report
from elastic.sched import batch_what_starts_here
from elastic.worker_group import RayWorkerGroup


def _absolute_local_uri(uri: str) -> str:
    """Relative paths are resolved against the driver's directory: workers may run elsewhere."""
    if "://" in uri:
        return uri
    return str(Path(uri).resolve())


def prepare(cfg: JobConfig, inject: list[str] | None = None, fresh: bool = False) -> tuple[JobConfig, list]:
    """Validate everything that can fail before any worker starts (the model too: built on meta, checked at the layout)."""
    try:
        faults = parse_faults(list(cfg.fault.inject) + list(inject or []))
    except FaultSpecError as exc:
        raise ConfigError(str(exc)) from None
    check_model(cfg)
    cfg = cfg.model_copy(deep=True)
    cfg.checkpoint.uri = _absolute_local_uri(cfg.checkpoint_uri)
    if cfg.model.init_from:
        cfg.model.init_from = _absolute_local_uri(cfg.model.init_from)
    run_dir = cfg.run_dir
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
        storage.remove_all(cfg.checkpoint.uri)
    try:
        storage.check_writable(cfg.checkpoint.uri)
    except Exception as exc:  # noqa: BLE001 - any reason the URI cannot be written is a config problem
        raise ConfigError(f"checkpoint.uri {cfg.checkpoint.uri!r} is not writable: {exc}") from None
    if cfg.model.init_from and not (cfg.checkpoint.resume and storage.list_checkpoints(cfg.checkpoint.uri)):
        check_init_from(cfg)  # the job starts from these weights: find out now, not on every rank
    return cfg, faults


def run_job(cfg: JobConfig, inject: list[str] | None = None, *, address: str | None = None, fresh: bool = False, quiet: bool = False) -> dict:
    """Run the job to the end and return its report (also written to the run directory).

    The controller and every thread and process the job starts from here run
    on SCHED_BATCH (`elastic.sched`): their wake-ups never preempt a rank.
    """
    with batch_what_starts_here():
        return _run_job(cfg, inject, address=address, fresh=fresh, quiet=quiet)


def _run_job(cfg: JobConfig, inject: list[str] | None, *, address: str | None, fresh: bool, quiet: bool) -> dict:
    cfg, faults = prepare(cfg, inject, fresh)
    s = cfg.scaling
    per_node = s.workers_per_node or s.upper
    nodes = math.ceil(s.num_workers / per_node)
    removes_nodes = any(f.kind == "node" for f in faults)
    cluster = connect(address, nodes, per_node * s.cpus_per_worker, per_node * s.gpus_per_worker, removes_nodes=removes_nodes)
    if removes_nodes and cluster is None:
        raise ConfigError("node faults remove Ray nodes: they need the embedded cluster, not a real one")
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    progress = None if quiet else ProgressPrinter(cfg.training.steps, tokens_per_step)
    metrics = RayMetrics(cfg.name, tokens_per_step)
    events = EventLog(run_dir / "events.jsonl", [s for s in (progress, metrics) if s is not None])
    f = cfg.fault
    if f.grad_spike_factor:
        events.sinks.append(GradSpikeRule(events.emit, f.grad_spike_factor, f.grad_spike_window, f.grad_spike_warmup))
    host = "127.0.0.1" if cluster is not None else ray.util.get_node_ip_address()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    group = RayWorkerGroup(cfg, host, store.port)
    ctrl = Controller(cfg, group, events, faults=faults, cluster=cluster, fault_store=store)
    try:
        events.emit("job_start", name=cfg.name, config=cfg.model_dump(mode="json"), faults=[f.as_dict() for f in faults])
        events.emit("metrics_endpoint", url=metrics.url)
        if cfg.checkpoint.resume:
            ctrl.resume_step = storage.latest_valid(
                cfg.checkpoint.uri, on_skip=lambda step, reason: events.emit("checkpoint_skipped", step=step, reason=str(reason))
            )
        ctrl.run()
    finally:
        group.shutdown()
        report = build_report(ctrl)
        write_report(report, run_dir)
        events.emit("job_end", state=ctrl.state.value)
        # Before the driver leaves a cluster that outlives the job, or its last values would be lost.
        if cluster is None and not metrics.flush():
            events.emit("warning", kind="metrics_not_flushed", message=f"the metrics agent at {metrics.url} did not show this run's last values")
        events.close()
        if cluster is not None:
            cluster.shutdown()
        else:
            ray.shutdown()
    return report


def succeeded(report: dict) -> bool:
    return report["state"] == State.FINISHED.value
