"""Compose the strategies over the layout's mesh, and run one step's forward/backward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from elastic.config import ParallelConfig
from elastic.model import token_loss_sum
from strategies.fsdp import apply_fsdp


@dataclass
class ParallelModel:
    """The local part(s) of a parallelized model and how to run a step on them."""

    model_parts: list[nn.Module]
    mesh: DeviceMesh
    micro_batch: int
    extra: dict = field(default_factory=dict)

    def parameters(self):
        for part in self.model_parts:
            yield from part.parameters()

    def named_parameters(self):
        for part in self.model_parts:
            yield from part.named_parameters()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """Forward and backward over the local batch in micro-batches; gradients accumulate.

        Each micro-batch's summed token loss is multiplied by `loss_scale` before
        backward. Returns the unscaled summed loss of the local batch (detached).
        """
        (model,) = self.model_parts
        chunks = list(zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)))
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(chunks):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == len(chunks) - 1)
            loss = token_loss_sum(model(x), y)
            (loss * loss_scale).backward()
            total += loss.detach()
        return total


def parallelize(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig, *, micro_batch: int) -> ParallelModel:
    """Apply the strategies to `model` (on meta) in the order the package docstring gives."""
    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    apply_fsdp(model, dp_mesh, reshard_after_forward=parallel.reshard_after_forward)
    return ParallelModel(model_parts=[model], mesh=mesh, micro_batch=micro_batch)


def load_full_state(pm: ParallelModel, full: dict[str, torch.Tensor]) -> None:
    """Fill every local parameter from full (unsharded) tensors: each rank slices what it owns, no communication."""
    with torch.no_grad():
        for name, param in pm.named_parameters():
            src = full[name]
            if isinstance(param, DTensor):
                local = distribute_tensor(src, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(src)


def clip_grad_norm(pm: ParallelModel, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm across every shard and stage; returns that norm."""
    params = [p for p in pm.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
