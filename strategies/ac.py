"""Activation checkpointing per block: recompute a block's activations in backward."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_ac(model: nn.Module, *, blocks: str = "layers") -> nn.Module:
    """Make every block under `model.<blocks>` recompute its forward during backward.

    The block's `forward` is replaced on the instance rather than wrapping the
    module in a `CheckpointWrapper`, so parameter names stay the full model's
    (a checkpoint does not depend on whether AC was on). Non-reentrant
    checkpointing composes with DTensor TP hooks inside the block and with an
    FSDP unit around it (FSDP gathers the block's parameters before backward,
    which is when the recompute runs).
    """
    container = model.get_submodule(blocks) if blocks else None
    for block in (container.values() if isinstance(container, nn.ModuleDict) else container or []):
        if "forward" not in block.__dict__:  # idempotent
            block.forward = functools.partial(_checkpointed, block.forward)
    return model
