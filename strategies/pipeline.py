"""Pipeline parallelism: cost-balanced stage split, stage modules, schedules.

A stage module is a copy of the whole (meta) model with the blocks it does not
own deleted and the first/last-only parts set to None, so its parameter names
are the full model's: a checkpoint does not depend on where the pipeline was cut.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from strategies.spec import ModelSpec

# torch.distributed.pipelining is imported only when a pipeline is built: it pulls in torch._dynamo,
# seconds of start-up that every restarted worker without pipeline parallelism would pay.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def param_cost(module: nn.Module | None) -> float:
    """Parameter count: a proxy for a module's matmul FLOPs per token and its memory (works on meta)."""
    return float(sum(p.numel() for p in module.parameters())) if module is not None else 0.0


def balance_stages(block_costs: Sequence[float], n_stages: int, *, first_cost: float = 0.0, last_cost: float = 0.0) -> list[int]:
    """Blocks per stage (contiguous, at least one each) minimising the costliest stage.

    The first stage also pays `first_cost` (the embedding) and the last
    `last_cost` (final norm and head). Exact dynamic programme over the split
    points, O(stages * blocks^2). Ties go to the earliest cut, which keeps early
    stages light: under 1F1B they hold the most micro-batches' activations.
    """
    n = len(block_costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {n_stages} pipeline stages (need 1 <= stages <= blocks)")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + float(c))

    def stage_cost(j: int, i: int, s: int) -> float:
        return prefix[i] - prefix[j] + (first_cost if s == 0 else 0.0) + (last_cost if s == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][i]: smallest max cost putting blocks [0, i) into stages 0..s; cut[s][i]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for i in range(1, n + 1):
        best[0][i] = stage_cost(0, i, 0)
    for s in range(1, n_stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], stage_cost(j, i, s))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(n_stages - 1, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    sizes.append(i)
    return sizes[::-1]


def _blocks(model: nn.Module, spec: ModelSpec) -> nn.ModuleDict:
    container = model.get_submodule(spec.blocks)
    if not isinstance(container, nn.ModuleDict):
        raise TypeError(
            f"{spec.blocks} must be an nn.ModuleDict when the model's own forward runs a pipeline stage (an nn.ModuleList "
            "renumbers its blocks when one is removed); or set ModelSpec.run_parts=True and the library runs the stages"
        )
    return container


def _optional(model: nn.Module, fqn: str) -> nn.Module | None:
    parent, _, leaf = fqn.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, leaf, None)


def split_blocks(model: nn.Module, spec: ModelSpec, n_stages: int) -> list[list[str]]:
    """Block names per stage: the spec's split points if given, else balanced by cost."""
    names = list(_blocks(model, spec).keys())
    points = spec.split_points(n_stages) if callable(spec.split_points) else spec.split_points
    if points is not None:
        starts = []
        for point in points:
            name = point.removeprefix(spec.blocks + ".")
            if name not in names:
                raise ValueError(f"pipeline split point {point!r} is not a block of {spec.blocks}")
            starts.append(names.index(name))
        if len(starts) != n_stages - 1 or starts != sorted(set(starts)) or (starts and starts[0] == 0):
            raise ValueError(f"{len(points)} split points {list(points)} do not cut {len(names)} blocks into {n_stages} stages")
        bounds = [0, *starts, len(names)]
        return [names[a:b] for a, b in zip(bounds, bounds[1:])]
    cost = spec.block_cost or param_cost
    blocks = _blocks(model, spec)
    sizes = balance_stages(
        [cost(blocks[n]) for n in names],
        n_stages,
        first_cost=sum(param_cost(_optional(model, f)) for f in spec.first),
        last_cost=sum(param_cost(_optional(model, f)) for f in spec.last),
    )
    out, start = [], 0
    for size in sizes:
        out.append(names[start : start + size])
        start += size
    return out


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Stages this pp rank runs: its rank, then every pp-th ("looped", as interleaved 1F1B expects)."""
    return [pp_rank + k * pp for k in range(virtual)]


def build_stage_module(model: nn.Module, spec: ModelSpec, owned: Sequence[str], *, first: bool, last: bool) -> nn.Module:
    """A copy of `model` with only the `owned` blocks (and the first/last parts where they belong)."""
    stage = copy.deepcopy(model)
    blocks = _blocks(stage, spec)
    for name in list(blocks.keys()):
        if name not in owned:
            del blocks[name]
    for fqn in (() if first else spec.first) + (() if last else spec.last):
        parent, _, leaf = fqn.rpartition(".")
        setattr(stage.get_submodule(parent) if parent else stage, leaf, None)
    return stage


def split_model(model: nn.Module, spec: ModelSpec, pp_rank: int, pp: int, virtual: int = 1) -> tuple[list[int], list[nn.Module]]:
    """This pp rank's stage indices and stage modules, out of `pp * virtual` stages."""
    n_stages = pp * virtual
    per_stage = split_blocks(model, spec, n_stages)
    ids = stage_ids(pp_rank, pp, virtual)
    modules = [build_stage_module(model, spec, per_stage[i], first=i == 0, last=i == n_stages - 1) for i in ids]
    return ids, modules


def default_microbatches(pp: int, schedule: str) -> int:
    return 2 * pp if schedule == "interleaved_1f1b" else pp


def build_schedule(
    modules: Sequence[nn.Module],
    ids: Sequence[int],
    n_stages: int,
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
):
    """`PipelineStage`s over the pp axis and the schedule that runs them.

    `scale_grads=False`: the loss is already scaled by the caller (summed token
    loss times `loss_scale`), so gradients must not be divided again by the
    number of micro-batches.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    import torch.distributed.pipelining as pipelining

    group = pp_mesh.get_group()
    stages = [pipelining.PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids)]
    cls = getattr(pipelining, SCHEDULES[schedule])
    if schedule == "interleaved_1f1b":
        return stages, cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, got {len(stages)}")
    return stages, cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
