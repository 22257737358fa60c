"""Pure functions that turn a model and a device mesh into a parallel model.

`parallelize()` composes the strategies in one documented order over the
layout's named mesh `("pp", "dp_replicate", "dp_shard", "tp")`:

1. pipeline split over `pp` (stage modules keep the full model's parameter
   names; `pp * pp_virtual_stages` stages for interleaved 1F1B),
2. tensor parallel (+ sequence parallel) over `tp` on each stage,
3. activation checkpointing per block,
4. FSDP / HSDP over `("dp_replicate", "dp_shard")` last, so it shards the
   TP-local pieces.

A user model comes with a `ModelSpec` (blocks, first/last-stage parts, TP plan,
pipeline split points, loss); see `strategies/spec.py` and `strategies/README.md`.
"""

from strategies.ac import apply_ac
from strategies.fsdp import apply_fsdp
from strategies.parallelize import ParallelModel, clip_grad_norm, load_full_state, parallelize
from strategies.pipeline import balance_stages, split_model
from strategies.spec import ModelSpec, builtin_spec
from strategies.tp import apply_tp, transformer_tp_plan

__all__ = [
    "ModelSpec",
    "ParallelModel",
    "apply_ac",
    "apply_fsdp",
    "apply_tp",
    "balance_stages",
    "builtin_spec",
    "clip_grad_norm",
    "load_full_state",
    "parallelize",
    "split_model",
    "transformer_tp_plan",
]
