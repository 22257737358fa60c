"""The planner's inputs from a job config: the model's profile and constraints from its builder, the step options, the resize choice.

`strategies.planner` is arithmetic over a `ModelProfile` and a `ModelCheck`;
here they come from the job's model (built on meta through `model.builder`):
exact parameter counts from the module, and the layouts the model allows
from `strategies.compose.model_problems`, which asks the model's own
`ModelSpec.check`. The controller calls `choose_layout` on every resize.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from elastic.config import JobConfig
from elastic.layout import Layout
from elastic.recipe import build_model
from strategies.compose import model_problems
from strategies.planner import Hardware, ModelCheck, ModelProfile, StepOptions
from strategies.planner import choose_layout as plan_resize

_models: dict[str, tuple[ModelProfile, ModelCheck]] = {}


def step_options(cfg: JobConfig) -> StepOptions:
    p = cfg.parallel
    return StepOptions(global_batch=cfg.training.global_batch, schedule=p.pp_schedule, virtual_stages=p.pp_virtual_stages,
                       activation_checkpointing=p.activation_checkpointing, reshard_after_forward=p.reshard_after_forward)


def configured_layout(cfg: JobConfig) -> Layout:
    """The configured degrees without dp_shard (that one is re-derived from the world on each resize)."""
    p = cfg.parallel
    return Layout(pp=p.pp, dp_replicate=p.dp_replicate, tp=p.tp)


def model_inputs(cfg: JobConfig, *, seq_len: int | None = None, micro_batch: int | None = None) -> tuple[ModelProfile, ModelCheck]:
    """The job's model as the planner sees it: its profile and the check of a layout against it (cached per config)."""
    seq_len = seq_len or cfg.data.seq_len
    micro_batch = micro_batch or cfg.training.micro_batch
    key = json.dumps([cfg.model.model_dump(mode="json"), cfg.parallel.model_dump(mode="json"), seq_len, micro_batch], sort_keys=True)
    if key not in _models:
        model, spec = build_model(cfg.model)
        profile = ModelProfile.from_model(model, spec, seq_len=seq_len, micro_batch=micro_batch)
        seen: dict[tuple[int, int], str | None] = {}

        def check(layout: Layout) -> str | None:
            if (layout.tp, layout.pp) not in seen:
                options = SimpleNamespace(**{**cfg.parallel.model_dump(), "tp": layout.tp, "pp": layout.pp})
                problems = model_problems(model, spec, options, seq_len)
                seen[layout.tp, layout.pp] = problems[0] if problems else None
            return seen[layout.tp, layout.pp]

        _models[key] = (profile, check)
    return _models[key]


def choose_layout(world: int, cfg: JobConfig, previous: Layout | None = None, hardware: Hardware | None = None) -> tuple[Layout, str]:
    """The layout for `world` available workers and the reason (`strategies.planner.choose_layout` on this job)."""
    profile, check = model_inputs(cfg)
    return plan_resize(
        world, profile, step_options(cfg), configured=configured_layout(cfg), min_workers=cfg.scaling.min_workers,
        workers_per_node=cfg.scaling.workers_per_node or None, previous=previous, hardware=hardware, check=check,
    )
