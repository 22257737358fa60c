"""Run one elastic job: connect to Ray, host the store, drive the controller, write the report."""

from __future__ import annotations

import time

import ray

import storage
from elastic.alerts import GradSpikeRule
from elastic.cluster import cluster_address, connect
from elastic.config import MAX_SIMULATED_NODES, ConfigError, JobConfig
from elastic.controller import Controller, State
from elastic import rundir
from elastic.data import DataInfo, resume_position
from elastic.events import EventLog
from elastic.metrics import RayMetrics
from elastic.preflight import check_start
from elastic.progress import ProgressPrinter
from elastic.rendezvous import open_store
from elastic.report import build_report, write_report
from elastic.sched import batch_what_starts_here
from elastic.worker_group import RayWorkerGroup


def prepare(cfg: JobConfig, inject: list[str] | None = None, fresh: bool = False) -> tuple[JobConfig, list, DataInfo, rundir.RunClaim]:
    """Check everything that can fail before any worker starts, then claim the run directory and the checkpoint URI.

    The checks are `elastic.preflight.check_start`'s, the ones `elastic
    config validate` runs (layout, faults, model, checkpoint URI, data,
    initial weights; the data is indexed once, `DataInfo`); the run directory
    and the checkpoint URI are then claimed for this invocation
    (`elastic.rundir.open_run`: leases, the marker, `fresh`, no mixing with
    an earlier run). Every problem is a ConfigError naming the field; the
    caller releases the claim.
    """
    checked = check_start(cfg, inject, fresh=fresh)
    cfg = checked.cfg
    try:
        claim = rundir.open_run(cfg, fresh=fresh)
    except OSError as exc:
        raise ConfigError(f"checkpoint.uri: cannot delete the checkpoints under {cfg.checkpoint.uri} (--fresh): {exc}") from None
    return cfg, checked.job.faults, checked.data, claim


def run_job(cfg: JobConfig, inject: list[str] | None = None, *, address: str | None = None, fresh: bool = False, quiet: bool = False) -> dict:
    """Run the job to the end and return its report (also written to the run directory).

    The controller and every thread and process the job starts from here run
    on SCHED_BATCH (`elastic.sched`): their wake-ups never preempt a rank.
    """
    with batch_what_starts_here():
        return _run_job(cfg, inject, address=address, fresh=fresh, quiet=quiet)


def _refuse_too_many_simulated_nodes(cfg: JobConfig, address: str | None) -> None:
    """The embedded Ray simulates every node on this machine, and runs only so many; a real cluster's nodes are its own, any number.

    Checked before anything is claimed or written, only where the job would start the embedded Ray.
    """
    s = cfg.scaling
    if cluster_address(address) is None and s.nodes > MAX_SIMULATED_NODES:
        raise ConfigError(
            f"scaling.workers_per_node ({s.workers_per_node}): scaling.num_workers ({s.num_workers}) / scaling.workers_per_node = "
            f"{s.nodes} simulated nodes, more than the {MAX_SIMULATED_NODES} the embedded Ray runs on one machine; "
            "to run on a Ray cluster, give its address (--address or RAY_ADDRESS)"
        )


def _run_job(cfg: JobConfig, inject: list[str] | None, *, address: str | None, fresh: bool, quiet: bool) -> dict:
    _refuse_too_many_simulated_nodes(cfg, address)
    cfg, faults, data, claim = prepare(cfg, inject, fresh)
    try:
        return _run_claimed(cfg, faults, data, claim, address=address, quiet=quiet)
    finally:
        claim.release()


def _run_claimed(cfg: JobConfig, faults: list, data: DataInfo, claim: rundir.RunClaim, *, address: str | None, quiet: bool) -> dict:
    skipped: list[tuple[int, str]] = []
    resume_step = None
    if cfg.checkpoint.resume:
        resume_step = storage.latest_valid(cfg.checkpoint.uri, on_skip=lambda step, reason: skipped.append((step, str(reason))))
        if resume_step is not None:
            resume_position(cfg.checkpoint.uri, resume_step, data)  # refuses other data before any worker starts
    s = cfg.scaling
    per_node = s.workers_per_node or s.upper
    removes_nodes = any(f.kind == "node" for f in faults)
    t_start = time.time()
    cluster = connect(address, s.nodes, per_node * s.cpus_per_worker, per_node * s.gpus_per_worker, removes_nodes=removes_nodes,
                      memory_dir=cfg.checkpoint.memory_dir)
    cluster_s = time.time() - t_start
    if removes_nodes and cluster is None:
        raise ConfigError("node faults remove Ray nodes: they need the embedded cluster, not a real one")
    run_dir = claim.run_dir
    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    progress = None if quiet else ProgressPrinter(cfg.training.steps, tokens_per_step)
    metrics = RayMetrics(cfg.name, tokens_per_step)
    events = EventLog(run_dir / "events.jsonl", [s for s in (progress, metrics) if s is not None])
    f = cfg.fault
    if f.grad_spike_factor:
        events.sinks.append(GradSpikeRule(events.emit, f.grad_spike_factor, f.grad_spike_window, f.grad_spike_warmup))
    host = "127.0.0.1" if cluster is not None else ray.util.get_node_ip_address()
    store = open_store(host)
    group = RayWorkerGroup(cfg, host, store.port)
    ctrl = Controller(cfg, group, events, faults=faults, cluster=cluster, fault_store=store, data=data)
    ctrl.started_at = t_start  # the run's wall time includes Ray's start
    claim.start_renewing(on_lost=ctrl.abort)  # another job took over our run directory or checkpoints: stop writing
    try:
        events.emit("job_start", name=cfg.name, attempt=claim.attempt, cluster_s=cluster_s, config=cfg.model_dump(mode="json"), faults=[f.as_dict() for f in faults])
        events.emit("metrics_endpoint", url=metrics.url)
        for step, reason in skipped:
            events.emit("checkpoint_skipped", step=step, reason=reason)
        ctrl.resume_step = ctrl.checkpoints.last_committed = resume_step
        ctrl.run()
    finally:
        group.shutdown()
        ctrl.checkpoints.close()
        ctrl.fault_store = store = None  # the store's server thread and socket go now, not at the next garbage collection
        report = build_report(ctrl, attempt=claim.attempt)
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
