"""The built-in decoder-only transformer, free of distributed code.

Strategies shard it from the outside (see `strategies/`). Three properties
make that possible:
- blocks live in a `ModuleDict` keyed "0".."n-1", so a pipeline stage that
  drops the other blocks keeps the full model's parameter names;
- `tok_embeddings`, `norm` and `output` may be None (pipeline stages without
  them), and `forward` skips what is missing;
- attention infers the head count from the projection's output, so it runs
  unchanged on the local heads of a tensor-parallel shard.
Rotary position encoding is computed in `forward`: no buffers to shard.

`transformer(**shape)` is its builder (the default `model.builder`): the
module on meta and its `ModelSpec`, which holds its tensor-parallel plan,
its initialiser and the checks of its shape against a layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from elastic.config import ModelConfig
from strategies import ModelSpec, ParallelOptions, SequenceGather


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels by position-dependent angles; x is (batch, seq, heads, head_dim)."""
    seq, head_dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos()[None, :, None, :].to(x.dtype), angles.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = (w(x).view(bsz, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotary(q), _rotary(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Transformer:
    """The model with uninitialised storage on `device` (meta by default): shard first, then fill."""
    with torch.device(device):
        return Transformer(cfg)


def transformer_tp_plan(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of `Transformer`.

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
        plan.update(
            {
                "norm": SequenceParallel(use_local_output=False),
                "layers.*.attention_norm": SequenceParallel(),
                "layers.*.ffn_norm": SequenceParallel(),
                "layers.*.attention": SequenceGather(),
                "layers.*.feed_forward": SequenceGather(),
            }
        )
    return plan


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The `ModelSpec` of the transformer of shape `cfg`."""

    def init_weights(module: nn.Module, fqn: str, generator: torch.Generator) -> None:
        """Norms at one; other weights normal(0, 0.02), the projections back into the residual scaled by 1/sqrt(2 layers)."""
        if isinstance(module, nn.RMSNorm):
            module.weight.fill_(1.0)
            return
        std = 0.02 / (2 * cfg.n_layers) ** 0.5 if fqn.endswith(("attention.wo", "feed_forward.w2")) else 0.02
        for param in module.parameters(recurse=False):
            param.copy_(torch.randn(param.shape, generator=generator) * std)

    def check(parallel: ParallelOptions, seq_len: int) -> list[str]:
        problems = [
            f"{name} ({value}) must be divisible by parallel.tp ({parallel.tp})"
            for name, value in (("model.n_heads", cfg.n_heads), ("model.ffn_dim", cfg.ffn_dim), ("model.vocab_size", cfg.vocab_size))
            if value % parallel.tp
        ]
        if seq_len > cfg.max_seq_len:
            problems.append(f"data.seq_len ({seq_len}) exceeds model.max_seq_len ({cfg.max_seq_len})")
        return problems

    return ModelSpec(
        blocks="layers",
        first=("tok_embeddings",),
        last=("norm", "output"),
        tp_plan=transformer_tp_plan,
        init_weights=init_weights,
        check=check,
        vocab_size=cfg.vocab_size,
    )


def transformer(**shape) -> tuple[Transformer, ModelSpec]:
    """The built-in builder: `shape` is the built-in fields of the `model` section (vocab_size, dim, ...)."""
    cfg = ModelConfig(**shape)
    return build_model(cfg), model_spec(cfg)
