"""Checks of a whole job that need the layout planner, done before any worker starts.

The pydantic config checks each field and the sections against each other;
this module checks what only the planner knows: which layout the job starts
with and how many workers that leaves idle, that an explicit
`parallel.dp_shard` is the layout that runs, and that every injected fault
can fire (its rank exists in the job's largest layout, its step is reached).
`elastic config validate` and `elastic run` (through `elastic.job.prepare`)
run the same `check_job`, so what validates is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config import ConfigError, JobConfig
from elastic.faults import Fault, FaultSpecError, parse_faults
from elastic.layout import Layout, LayoutError


@dataclass(frozen=True)
class JobCheck:
    """What a checked job will do: its faults, its starting layout, and one line saying so."""

    faults: list[Fault]
    layout: Layout
    """The layout at scaling.num_workers."""
    max_world: int
    """The most ranks any layout of the job has (at scaling.max_workers)."""
    summary: str
    """`layout ...`: the starting layout, how the global batch splits, any idle workers and why, growth up to max_workers."""


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
    faults: list[Fault] = []
    for field, specs in (("fault.inject", cfg.fault.inject), ("--inject", inject or [])):
        try:
            faults += parse_faults(specs, first_id=len(faults), steps=cfg.training.steps, max_world=largest.world_size)
        except FaultSpecError as exc:
            raise ConfigError(f"{field} {exc}") from None
    return JobCheck(faults=faults, layout=layout, max_world=largest.world_size, summary=summary)
