"""Pure functions that turn a model and a device mesh into a parallel model.

`parallelize()` composes the strategies in one documented order over the
layout's named mesh `("pp", "dp_replicate", "dp_shard", "tp")`:

1. pipeline split over `pp` (stage modules keep the full model's parameter
   names; `pp * pp_virtual_stages` stages for interleaved 1F1B),
2. tensor parallel (+ sequence parallel) over `tp` on each stage,
3. activation checkpointing per block,
4. FSDP / HSDP over `("dp_replicate", "dp_shard")` last, so it shards the
   TP-local pieces.

A model comes with a `ModelSpec` (blocks, first/last-stage parts, TP plan,
pipeline split points, loss, initialisation hooks); see `strategies/spec.py`
and `strategies/README.md`. `strategies.hf` derives one for Hugging Face
causal LMs. This package never imports `elastic`: the job manager uses it,
not the reverse.
"""

from strategies.ac import apply_ac
from strategies.fsdp import apply_fsdp
from strategies.init import init_weights, initial_state
from strategies.parallelize import ParallelModel, clip_grad_norm, load_full_state, parallelize
from strategies.pipeline import balance_stages, split_model
from strategies.spec import ModelSpec, ParallelOptions, token_loss_sum
from strategies.tp import SequenceGather, apply_tp

__all__ = [
    "ModelSpec",
    "ParallelModel",
    "ParallelOptions",
    "SequenceGather",
    "apply_ac",
    "apply_fsdp",
    "apply_tp",
    "balance_stages",
    "clip_grad_norm",
    "init_weights",
    "initial_state",
    "load_full_state",
    "parallelize",
    "split_model",
    "token_loss_sum",
]
