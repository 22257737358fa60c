"""A `ModelSpec` for Hugging Face causal language models, derived from the model's own config.

`causal_lm_spec(model)` describes a `transformers` decoder laid out like
Llama (Llama, Mistral, Qwen2, Qwen3, ...): `<base>.embed_tokens`,
`<base>.layers` (an `nn.ModuleList` of decoder layers), `<base>.norm`,
`<base>.rotary_emb` and `lm_head`, where `<base>` is the model's
`base_model_prefix`. It reads the pipeline order from
`config.base_model_pp_plan` and the tensor-parallel plan from
`config.base_model_tp_plan`, and absorbs what training such a model on
every layout needs:

- the library runs each stage (`run_parts`): embedding, decoder layers,
  final norm and head, and passes every layer the rotary position embeddings
  of the full sequence, computed once per forward (under sequence
  parallelism a stage holds a sequence shard; positions still run 0..seq_len);
- attention goes through SDPA with causal masking (`is_causal`): no mask is
  passed, and the eager implementation without a mask would not be causal;
- under sequence parallelism the norms run on sequence shards and the
  attention and MLP inputs are all-gathered, the attention's even though
  Hugging Face passes it by keyword (`strategies.tp.SequenceGather`);
- the rotary `inv_freq` buffers, garbage after `to_empty`, are re-created;
- `init_weights` draws as Hugging Face's `_init_weights` does (normal with
  `initializer_range`, zero biases, unit norms);
- per-head norms (Qwen3's `q_norm`, `k_norm`: `replicated_with_grad_allreduce`)
  keep their weight whole on every tp rank and sum its gradient over tp;
- `check` refuses what would train wrongly or crash: tp not dividing the
  heads, the kv heads, the MLP or the vocabulary; a style of the model's TP
  plan this module does not know; sliding-window attention over sequences
  longer than the window. Tied input/output embeddings are refused by
  `parallelize` (set `tie_word_embeddings=False`); a checkpoint of a tied
  model still loads: `lm_head.weight` then starts as the embedding.

`transformers` itself is not imported here: the spec is derived from the
model object the builder made.
"""

from __future__ import annotations

import json
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from strategies.init import reset_from
from strategies.spec import ModelSpec, ParallelOptions
from strategies.tp import SequenceGather

CAUSAL_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Attention implementations that are causal without a mask; anything else is switched to sdpa."""


def read_config(uri: str) -> dict:
    """The `config.json` of a Hugging Face model directory, local or any fsspec URI."""
    import fsspec

    with fsspec.open(f"{uri.rstrip('/')}/config.json", "rt") as f:
        return json.load(f)


def _pipeline_order(model: nn.Module, base: str) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """(first parts, blocks, last parts) from `base_model_pp_plan`: the module list is the blocks, before it first, after it last."""
    plan = getattr(model.config, "base_model_pp_plan", None) or {"embed_tokens": None, "layers": None, "norm": None}
    names = [f"{base}.{name}" for name in plan]
    lists = [n for n in names if isinstance(model.get_submodule(n), (nn.ModuleList, nn.ModuleDict))]
    if len(lists) != 1:
        raise ValueError(f"{type(model).__name__}: base_model_pp_plan {list(plan)} does not name exactly one list of layers")
    at = names.index(lists[0])
    head = [n for n, _ in model.named_children() if n != base]
    return tuple(names[:at]), lists[0], tuple(names[at + 1 :]) + tuple(head)


def _norm_names(block: nn.Module) -> list[str]:
    """The block's own norms: direct children whose class is some RMSNorm or LayerNorm."""
    return [name for name, child in block.named_children() if type(child).__name__.endswith(("RMSNorm", "LayerNorm"))]


def causal_lm_spec(model: nn.Module, *, split_points: Sequence[str] | None = None) -> ModelSpec:
    """The spec of a Hugging Face causal LM (on meta); see the module docstring for what it covers.

    `split_points` (block names such as `model.layers.8`) cut the pipeline
    there; by default stages are balanced by parameter count.
    """
    config = model.config
    base = model.base_model_prefix
    first, blocks, last = _pipeline_order(model, base)
    if getattr(config, "_attn_implementation", None) not in CAUSAL_ATTENTION:
        config._attn_implementation = "sdpa"
    rotary = f"{base}.rotary_emb"
    has_rotary = isinstance(getattr(model.get_submodule(base), "rotary_emb", None), nn.Module)
    hf_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    unknown = {k: v for k, v in hf_plan.items() if v not in ("colwise", "rowwise", "replicated_with_grad_allreduce")}
    block = next(iter(model.get_submodule(blocks).children()))
    norms = _norm_names(block)
    sublayers = sorted({key.split(".")[2] for key in hf_plan if key.startswith("layers.*.") and key.count(".") >= 3})

    def tp_plan(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        act = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {}
        for key, style in hf_plan.items():
            if style == "colwise":
                plan[f"{base}.{key}"] = ColwiseParallel()
            elif style == "rowwise":
                plan[f"{base}.{key}"] = RowwiseParallel(output_layouts=act)
            elif style == "replicated_with_grad_allreduce":
                # A norm over each head (Qwen3's q_norm, k_norm): its input is split by heads (dim -2) across tp, its weight
                # replicated; DTensor sums the weight's gradient over tp, which the heads' partial gradients need.
                plan[f"{base}.{key}"] = SequenceParallel(sequence_dim=-2, use_local_output=True)
        for fqn in first:
            plan[fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
        *norms_last, head = last
        plan[head] = ColwiseParallel(input_layouts=act, output_layouts=Replicate(), use_local_output=True)
        if sequence_parallel:
            for fqn in norms_last:
                plan[fqn] = SequenceParallel(use_local_output=False)
            for name in norms:
                plan[f"{blocks}.*.{name}"] = SequenceParallel()
            for name in sublayers:
                plan[f"{blocks}.*.{name}"] = SequenceGather("hidden_states")
        return plan

    def block_inputs(stage: nn.Module, hidden: torch.Tensor, seq_len: int) -> dict:
        if not has_rotary:
            return {}
        positions = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        return {"position_embeddings": stage.get_submodule(rotary)(hidden, positions)}

    def init_buffers(stage: nn.Module) -> None:
        for name, module in stage.named_modules():
            own = dict(module.named_buffers(recurse=False))
            if not own:
                continue
            if not hasattr(module, "config"):
                raise ValueError(f"{name} ({type(module).__name__}) holds buffers but no config to re-create them from")
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for key, value in fresh.named_buffers(recurse=False):
                own[key].copy_(value)

    std = getattr(config, "initializer_range", 0.02)

    def init_weights(module: nn.Module, fqn: str, generator: torch.Generator) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if getattr(module, "padding_idx", None) is not None:
                module.weight[module.padding_idx].zero_()
        elif type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
            for pname, param in module.named_parameters(recurse=False):
                param.fill_(0.0 if pname == "bias" else 1.0)
        else:
            reset_from(module, generator)

    def checkpoint_key(fqn: str, keys: frozenset) -> str:
        if fqn == "lm_head.weight" and fqn not in keys:  # saved from a model with tied embeddings
            return f"{first[0]}.weight"
        return fqn

    def check(parallel: ParallelOptions, seq_len: int) -> list[str]:
        problems = []
        if parallel.tp > 1:
            sizes = {
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                "intermediate_size": getattr(config, "intermediate_size", None),
                "vocab_size": config.vocab_size,
            }
            problems += [f"model.args {name} ({size}) must be divisible by parallel.tp ({parallel.tp})"
                         for name, size in sizes.items() if size and size % parallel.tp]
            problems += [f"tensor-parallel style {style!r} of {key} (config.base_model_tp_plan) is not supported: "
                         "give ModelSpec.tp_plan yourself" for key, style in unknown.items()]
        window = getattr(config, "sliding_window", None)
        sliding = getattr(config, "use_sliding_window", True) or "sliding_attention" in (getattr(config, "layer_types", None) or ())
        if window and sliding and seq_len > window:
            problems.append(f"sliding-window attention (window {window}) is not supported: data.seq_len ({seq_len}) must be at "
                            "most the window, where attention is plain causal")
        return problems

    def export_files(dtype: torch.dtype) -> dict[str, bytes]:
        saved = config.to_dict()
        saved.update(architectures=[type(model).__name__], dtype=str(dtype).removeprefix("torch."), tie_word_embeddings=False)
        files = {"config.json": json.dumps(saved, indent=2, sort_keys=True).encode()}
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            files["generation_config.json"] = generation.to_json_string().encode()
        return files

    return ModelSpec(
        blocks=blocks,
        first=first,
        last=last,
        tp_plan=tp_plan,
        split_points=split_points,
        run_parts=True,
        block_inputs=block_inputs,
        init_weights=init_weights,
        init_buffers=init_buffers,
        checkpoint_key=checkpoint_key,
        check=check,
        export_files=export_files,
        vocab_size=config.vocab_size,
    )
