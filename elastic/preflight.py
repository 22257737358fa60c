"""Checks of a whole job, done before any worker starts.

The pydantic config checks each field and the sections against each other;
`check_job` checks what only the planner knows: which layout the job starts
with and how many workers that leaves idle, that an explicit
`parallel.dp_shard` is the layout that runs, and that every injected fault
can fire (its rank exists in the job's largest layout, its step is reached).
`check_start` adds what needs the job's files: the model, the checkpoint
URI, the data and the initial weights. `elastic config validate` and
`elastic run` (through `elastic.job.prepare`) run the same `check_start`, so
what validates is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.config import ConfigError, JobConfig
from elastic.faults import Fault, FaultSpecError, parse_faults
from elastic.layout import Layout, LayoutError

if TYPE_CHECKING:
    from elastic.data import DataInfo


@dataclass(frozen=True)
class JobCheck:
    """What a checked job will do: its faults, its starting layout, and one line saying so."""

    faults: list[Fault]
    layout: Layout
    """The layout at scaling.num_workers."""
    max_world: int
    """The most ranks any layout of the job has (at scaling.max_workers)."""
    summary: str
    """`layout ...`: the starting layout, how the global batch splits, any idle workers and why, growth up to max_workers,
    and a memory tier that would take no snapshot."""


def check_job(cfg: JobConfig, inject: list[str] | None = None) -> JobCheck:
    """Resolve the job's layouts and parse its faults (`fault.inject`, then `inject` from the command line).

    Raises ConfigError, one line naming the field or the spec, when no layout
    runs scaling.num_workers, when an explicit parallel.dp_shard is not the
    layout that would run, or when a fault spec is malformed or can never fire.
    """
    from elastic.planning import choose_layout  # builds the model on meta: imported when used

    s = cfg.scaling
    try:
        layout, reason = choose_layout(s.num_workers, cfg)
        largest, grown = choose_layout(s.upper, cfg) if s.upper > s.num_workers else (layout, reason)
    except LayoutError as exc:
        raise ConfigError(f"scaling.num_workers ({s.num_workers}): {exc}") from None
    p = cfg.parallel
    wanted = Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp) if p.dp_shard > 0 else None
    if wanted is not None and layout != wanted:
        raise ConfigError(f"parallel.dp_shard ({p.dp_shard}): {wanted} cannot run this job, the planner would run {reason}; "
                          "set parallel.dp_shard to -1 to let it")
    summary = reason
    if s.upper > s.num_workers:
        summary += f"; at scaling.max_workers ({s.upper}): {grown.removeprefix('layout ')}"
    if layout.world_size < s.num_workers or largest.world_size < s.upper:
        summary += "; the idle workers' slots stay reserved and unused"
    c = cfg.checkpoint
    if c.memory and c.memory_every_steps >= cfg.training.steps:
        summary += (f"; checkpoint.memory_every_steps ({c.memory_every_steps}) is not below training.steps "
                    f"({cfg.training.steps}): the memory tier takes no snapshot")
    faults: list[Fault] = []
    for field, specs in (("fault.inject", cfg.fault.inject), ("--inject", inject or [])):
        try:
            faults += parse_faults(specs, first_id=len(faults), steps=cfg.training.steps, max_world=largest.world_size)
        except FaultSpecError as exc:
            raise ConfigError(f"{field} {exc}") from None
    return JobCheck(faults=faults, layout=layout, max_world=largest.world_size, summary=summary)


@dataclass(frozen=True)
class StartCheck:
    """A job that passed every check `elastic run` makes before it claims its run directory."""

    cfg: JobConfig
    """The job's config with its local paths (checkpoint.uri, model.init_from) absolute: workers may run elsewhere."""
    job: JobCheck
    data: DataInfo
    """The job's data, resolved and indexed once."""


def check_start(cfg: JobConfig, inject: list[str] | None = None, *, fresh: bool = False) -> StartCheck:
    """Everything that can fail before a worker starts, changing nothing: what `elastic config validate` and `elastic run` both check.

    After `check_job`: the model builds and allows the layout, checkpoint.uri
    is writable (a probe that leaves nothing behind but, on S3, the bucket it
    creates when missing, as a run would), the data resolves and
    its token ids fit the model, and model.init_from holds a tensor of the
    right shape for every parameter when the job starts from it (no
    checkpoint to resume from, or `fresh`, which deletes them). It takes no
    lease, claims no run directory (`elastic.rundir.open_run` does, for a
    run) and starts no Ray. Every problem is a ConfigError naming the field.
    """
    import storage  # these build the model and read the data: imported when used, not by every CLI command
    from elastic.data import describe
    from elastic.recipe import check_init_from, check_model

    job = check_job(cfg, inject)
    check_model(cfg)
    cfg = cfg.model_copy(deep=True)
    cfg.checkpoint.uri = _absolute_local_uri(cfg.checkpoint_uri)
    if cfg.model.init_from:
        cfg.model.init_from = _absolute_local_uri(cfg.model.init_from)
    try:
        storage.check_writable(cfg.checkpoint.uri, what="checkpoint.uri")
    except storage.CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    data = describe(cfg)
    if cfg.model.init_from and (fresh or not (cfg.checkpoint.resume and storage.list_checkpoints(cfg.checkpoint.uri))):
        check_init_from(cfg)  # the job starts from these weights: find out now, not on every rank
    return StartCheck(cfg, job, data)


def _absolute_local_uri(uri: str) -> str:
    """Relative paths are resolved against the driver's directory: workers may run elsewhere."""
    if "://" in uri:
        return uri
    return str(Path(uri).resolve())
