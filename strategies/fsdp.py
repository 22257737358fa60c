"""FSDP2 over the data-parallel axes: plain sharding or hybrid (HSDP)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    blocks: str = "layers",
) -> nn.Module:
    """Shard each transformer block, then the root, over `dp_mesh`.

    A 1-D mesh (`dp_shard`) is ZeRO-3 style sharding; a 2-D mesh
    (`dp_replicate`, `dp_shard`) is HSDP: sharded within a replica group,
    replicated (all-reduced) across groups. Gradients are averaged over all
    data-parallel ranks. Works on pipeline stages too: missing blocks are skipped.
    `blocks` names the container of the repeated blocks (the FSDP units).
    """
    kwargs = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    layers = model.get_submodule(blocks) if blocks else None
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers or []):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root keeps its parameters gathered after forward: backward needs them at once.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model
