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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastic.config import ModelConfig


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


def initial_state(full_model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full initial weights from the seed, in name order, so every layout starts identical.

    `full_model` is the whole unsharded model (on meta is enough: only names and
    shapes are read). Drawn on the CPU from one generator whatever the layout:
    any rank can slice the piece it owns out of the same tensors.
    """
    model = full_model
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.named_parameters()):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            std = 0.02 if not name.endswith(("wo.weight", "w2.weight")) else 0.02 / (2 * max(1, len(getattr(model, "layers", [])))) ** 0.5
            out[name] = torch.randn(shape, generator=gen) * std
    return out


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over every position (callers divide by the global token count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
