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

# Submodules load on first use (PEP 562): `strategies.layout` is pure arithmetic that the command line validates
# configs with, and importing the package must not import torch for it (2 s of a 3 s `elastic --help`). No submodule
# is named as what it exports (`parallelize` lives in `compose`): once imported, a submodule would shadow that name.
_WHERE = {
    "apply_ac": "ac",
    "apply_fsdp": "fsdp",
    "init_weights": "init",
    "initial_state": "init",
    "ParallelModel": "compose",
    "clip_grad_norm": "compose",
    "clip_grad_norm_and_count": "compose",
    "load_full_state": "compose",
    "parallelize": "compose",
    "balance_stages": "pipeline",
    "split_model": "pipeline",
    "ModelSpec": "spec",
    "ParallelOptions": "spec",
    "token_loss_sum": "spec",
    "SequenceGather": "tp",
    "apply_tp": "tp",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"strategies.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = sorted(_WHERE)
