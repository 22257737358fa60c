"""Tensor parallelism (Megatron style) with optional sequence parallelism, via DTensor.

A TP plan is a dict `{module FQN pattern: ParallelStyle}` as `parallelize_module`
takes it; a `*` matches one name atom (`layers.*.attention.wq`). `apply_tp`
applies it to whatever modules the (possibly pipeline-cut) model still has, so
one plan serves every pipeline stage.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def transformer_tp_plan(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for the built-in transformer (`elastic.model.Transformer`).

    Attention is split by heads (wq/wk/wv column-parallel, wo row-parallel) and
    the MLP column-then-row, so each block needs one reduction in forward per
    sub-layer. The embedding is split on the vocabulary (row-parallel) and the
    output head on the vocabulary too (column-parallel), gathering the logits so
    the loss is the ordinary one on every tp rank.

    With `sequence_parallel`, activations between the sub-layers stay sharded
    on the sequence dim (dim 1): the norms run on their sequence shard
    (`SequenceParallel`), the sub-layer inputs are all-gathered on entry and the
    row-parallel outputs reduce-scattered back to sequence shards, which saves
    activation memory at the same communication volume.
    """
    seq = Shard(1)
    act = seq if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Replicate(), use_local_output=True),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=act),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=act),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
        plan.update(
            {
                "norm": SequenceParallel(use_local_output=False),
                "layers.*.attention_norm": SequenceParallel(),
                "layers.*.ffn_norm": SequenceParallel(),
                "layers.*.attention": gather,
                "layers.*.feed_forward": gather,
            }
        )
    return plan


def _matches(plan_key: str, fqn: str) -> bool:
    want, have = plan_key.split("."), fqn.split(".")
    return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w) for w, h in zip(want, have))


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    plan: dict[str, ParallelStyle] | None = None,
) -> nn.Module:
    """Shard `model` (on meta or real) over the 1-D `tp_mesh` with `plan`.

    `plan` defaults to the built-in transformer's. Patterns that match no module
    are skipped (a pipeline stage lacks the embedding, the head or some blocks);
    a pattern that matches nothing on a model that has everything is the
    caller's typo, which `parallelize` checks for user plans on the full model.
    Parameters are sliced locally (`src_data_rank=None`): no communication.
    """
    if plan is None:
        plan = transformer_tp_plan(sequence_parallel=sequence_parallel)
    modules = dict(model.named_modules())
    for key, style in plan.items():
        for fqn in [name for name in modules if name and _matches(key, name)]:
            parallelize_module(modules[fqn], tp_mesh, style, src_data_rank=None)
    return model


def unmatched_plan_keys(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Plan keys that match no module of `model` (a typo in a user plan)."""
    names = [name for name, _ in model.named_modules() if name]
    return [key for key in plan if not any(_matches(key, name) for name in names)]
