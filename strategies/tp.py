"""Tensor parallelism (Megatron style) with optional sequence parallelism, via DTensor.

A TP plan is a dict `{module FQN pattern: ParallelStyle}` as `parallelize_module`
takes it; a `*` matches one name atom (`layers.*.attention.wq`). `apply_tp`
applies it to whatever modules the (possibly pipeline-cut) model still has, so
one plan serves every pipeline stage.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


class SequenceGather(ParallelStyle):
    """All-gather a sub-layer's sequence-sharded input before it runs (sequence parallelism); backward reduce-scatters.

    The input is the first positional argument or, when the caller passes it
    by keyword (Hugging Face calls `self_attn(hidden_states=...)`), the keyword
    argument `name`. It may be a plain tensor (the local sequence shard along
    dim 1) or a DTensor; the sub-layer receives the full sequence as a plain tensor.
    """

    def __init__(self, name: str = "hidden_states"):
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x: torch.Tensor) -> torch.Tensor:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),)).to_local()

        def hook(_module, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if self.name not in kwargs:
                raise TypeError(f"{type(module).__name__} was called without its input (positional, or keyword {self.name!r})")
            return args, {**kwargs, self.name: gather(kwargs[self.name])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _matches(plan_key: str, fqn: str) -> bool:
    want, have = plan_key.split("."), fqn.split(".")
    return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w) for w, h in zip(want, have))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Shard `model` (on meta or real) over the 1-D `tp_mesh` with `plan`.

    Patterns that match no module
    are skipped (a pipeline stage lacks the embedding, the head or some blocks);
    a pattern that matches nothing on a model that has everything is the
    caller's typo, which `parallelize` checks for user plans on the full model.
    Parameters are sliced locally (`src_data_rank=None`): no communication.
    """
    modules = dict(model.named_modules())
    for key, style in plan.items():
        for fqn in [name for name in modules if name and _matches(key, name)]:
            parallelize_module(modules[fqn], tp_mesh, style, src_data_rank=None)
    return model


def unmatched_plan_keys(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Plan keys that match no module of `model` (a typo in a user plan)."""
    names = [name for name, _ in model.named_modules() if name]
    return [key for key in plan if not any(_matches(key, name) for name in names)]
