"""Pure functions that turn a model and a device mesh into a parallel model.

`parallelize()` composes the strategies in one documented order over the
layout's named mesh `("pp", "dp_replicate", "dp_shard", "tp")`:

1. pipeline split (keeps the full model's parameter names),
2. tensor parallel (+ sequence parallel) over `tp`,
3. activation checkpointing per block,
4. FSDP / HSDP over `("dp_replicate", "dp_shard")`.
"""

from strategies.fsdp import apply_fsdp
from strategies.parallelize import ParallelModel, clip_grad_norm, load_full_state, parallelize

__all__ = ["ParallelModel", "apply_fsdp", "clip_grad_norm", "load_full_state", "parallelize"]
