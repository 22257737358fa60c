"""Bring-your-own-model API: a model defined here, its TP plan and PP split, trained under tp=2 and pp=2.

It must match the same model trained in one process, with the same check as the
built-in transformer's layouts (losses, gradient norms, final weights within 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from distributed import run_distributed
from elastic.config import ParallelConfig
from elastic.layout import Layout
from strategies import ModelSpec, initial_state
from test_strategies_equivalence import compare, merge_ranks, reference_train, train_layout


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TinyMLPLM(nn.Module):
    """A token MLP language model: embed -> residual MLP blocks -> head. Not the built-in transformer."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 32, n_blocks: int = 4):
        super().__init__()
        self.vocab_size = vocab
        self.embed: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({str(i): MLPBlock(dim, hidden) for i in range(n_blocks)})
        self.head: nn.Linear | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


SPEC = ModelSpec(
    blocks="blocks",
    first=("embed",),
    last=("head",),
    tp_plan={
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    },
    split_points=["blocks.1"],  # uneven on purpose: stage 0 = embed + block 0, stage 1 = blocks 1-3 + head
)

LAYOUTS = {
    "tp2": (Layout(tp=2), ParallelConfig(tp=2, sequence_parallel=False), 4),
    "pp2": (Layout(pp=2), ParallelConfig(pp=2, pp_schedule="1f1b"), 4),
}


def _meta_model() -> TinyMLPLM:
    with torch.device("meta"):
        return TinyMLPLM()


def _run(rank: int, world: int) -> dict:
    out = {name: train_layout(rank, layout, parallel, _meta_model, SPEC, micro) for name, (layout, parallel, micro) in LAYOUTS.items()}
    return out


@pytest.fixture(scope="module")
def results():
    full = initial_state(_meta_model(), SPEC, seed=0)
    torch.manual_seed(0)
    ref = reference_train(TinyMLPLM(), {k: v.clone() for k, v in full.items()})
    return ref, full, run_distributed(_run, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_user_model_matches_single_process(name, results):
    ref, full, ranks = results
    layout = LAYOUTS[name][0]
    got = merge_ranks([r[name] for r in ranks], layout)
    bad = compare(got, ref, full)
    assert not bad, f"user model under {name} differs:\n" + "\n".join(bad)


def test_user_model_pipeline_cut_where_asked(results):
    _, _, ranks = results
    stage0, stage1 = (set(r["pp2"]["params"]) for r in ranks)
    assert not stage0 & stage1
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in stage0 if n.startswith("blocks")} == {"blocks.0"}
    assert "embed.weight" in stage0 and "head.weight" in stage1
