"""The library's own forward for a model or pipeline stage (`ModelSpec.run_parts`): first parts, blocks, last parts.

A Hugging Face causal LM's `forward` builds masks, caches and position
embeddings for the whole model and indexes its `nn.ModuleList` of layers, so
it cannot run a pipeline stage that holds some of the layers and neither the
embedding nor the head. `install_stage_forward` replaces the module's
`forward` on the instance (names and hooks stay as they are) by a loop over
what the stage holds, described by the `ModelSpec`.
"""

from __future__ import annotations

import torch
from torch import nn

from strategies.spec import ModelSpec


def blocks_as_dict(model: nn.Module, spec: ModelSpec) -> nn.ModuleDict:
    """The blocks container as an `nn.ModuleDict` keyed "0".."n-1": an `nn.ModuleList` is swapped for one, in place.

    Parameter names do not change (`layers.3.mlp...` either way), and a
    pipeline stage can then delete blocks without renumbering the rest.
    """
    container = model.get_submodule(spec.blocks)
    if isinstance(container, nn.ModuleDict):
        return container
    if not isinstance(container, nn.ModuleList):
        raise TypeError(f"ModelSpec.blocks {spec.blocks!r} is a {type(container).__name__}, not an nn.ModuleList or nn.ModuleDict")
    as_dict = nn.ModuleDict({str(i): block for i, block in enumerate(container)})
    parent, _, leaf = spec.blocks.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, as_dict)
    return as_dict


def _part(module: nn.Module, fqn: str) -> nn.Module | None:
    parent, _, leaf = fqn.rpartition(".")
    return getattr(module.get_submodule(parent) if parent else module, leaf, None)


class StageForward:
    """`forward(x)` of a model or stage under `run_parts` (see `strategies.spec`).

    `seq_shards` is how many pieces the sequence of a stage's input is cut
    into when the stage does not start with the `first` parts (tp under
    sequence parallelism, else 1): `block_inputs` always gets the full length.
    """

    def __init__(self, module: nn.Module, spec: ModelSpec, seq_shards: int):
        self.module = module
        self.spec = spec
        self.seq_shards = seq_shards

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module, spec = self.module, self.spec
        firsts = [p for p in (_part(module, f) for f in spec.first) if p is not None]
        seq_len = x.shape[1] if firsts or not spec.first else x.shape[1] * self.seq_shards
        h = x
        for part in firsts:
            h = part(h)
        kwargs = spec.block_inputs(module, h, seq_len) if spec.block_inputs is not None else {}
        for block in module.get_submodule(spec.blocks).values():
            out = block(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        for fqn in spec.last:
            part = _part(module, fqn)
            if part is not None:
                h = part(h)
        return h


def install_stage_forward(module: nn.Module, spec: ModelSpec, seq_shards: int = 1) -> nn.Module:
    """Make `module(x)` run the parts it holds, as `StageForward` describes."""
    module.forward = StageForward(module, spec, seq_shards)
    return module
