"""What `parallelize()` needs to know about a model besides the `nn.Module` itself.

Bring your own model
--------------------
Build the module on the meta device and describe it with a `ModelSpec`::

    spec = ModelSpec(
        blocks="layers",                 # an nn.ModuleDict of the repeated blocks, run in order
        first=("embed",),                # top-level parts only the first pipeline stage keeps
        last=("head",),                  # parts only the last stage keeps
        tp_plan={"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()},
        split_points=None,               # or ["layers.2"] / a callable(n_stages) -> block names
    )
    pm = parallelize(model, mesh, parallel_cfg, micro_batch=4, spec=spec)

The contract the module keeps (the built-in transformer keeps it too):

- the blocks are an `nn.ModuleDict`, so a pipeline stage deletes the blocks it
  does not own and the remaining ones keep their full-model names;
- `forward(x)` runs the modules it still has: a part in `first`/`last` may be
  None (then `forward` passes its input through) and the loop goes over the
  blocks left in the ModuleDict; it takes one tensor and returns one tensor;
- `loss_fn(output, labels)` returns the *summed* loss of the micro-batch
  (the caller scales it by `loss_scale`).

Blocks are the FSDP units, the activation-checkpointing units and the pipeline
granularity. `tp_plan` maps module FQN patterns (`*` = one name atom) to DTensor
`ParallelStyle`s; give a callable `tp_plan(sequence_parallel=...)` to honour the
`parallel.sequence_parallel` switch. Without `split_points`, stages are balanced
by `block_cost` (default: parameter count), the first stage also paying for
`first` and the last for `last`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from elastic.model import token_loss_sum

TPPlan = dict[str, ParallelStyle]


@dataclass
class ModelSpec:
    blocks: str = "layers"
    first: tuple[str, ...] = ("tok_embeddings",)
    last: tuple[str, ...] = ("norm", "output")
    tp_plan: TPPlan | Callable[..., TPPlan] | None = None
    split_points: Sequence[str] | Callable[[int], Sequence[str]] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum
    block_cost: Callable[[nn.Module], float] | None = None  # default: parameter count

    def plan(self, *, sequence_parallel: bool) -> TPPlan | None:
        """The TP plan to apply (None: the model cannot be tensor-parallel)."""
        if callable(self.tp_plan):
            return self.tp_plan(sequence_parallel=sequence_parallel)
        return self.tp_plan


def builtin_spec() -> ModelSpec:
    """The spec of `elastic.model.Transformer`."""
    from strategies.tp import transformer_tp_plan

    return ModelSpec(tp_plan=transformer_tp_plan)
