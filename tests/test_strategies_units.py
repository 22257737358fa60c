"""Single-process checks of the strategy pieces: stage balance, stage modules, names under AC, plan matching."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.config import ModelConfig
from elastic.model import build_model, model_spec, transformer_tp_plan
from strategies import ModelSpec, apply_ac, balance_stages, split_model
from strategies.pipeline import default_microbatches, split_blocks, stage_ids
from strategies.tp import unmatched_plan_keys

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=64, dim=16, n_layers=6, n_heads=2, ffn_dim=32, max_seq_len=8)


def test_balance_equal_blocks():
    assert balance_stages([1] * 8, 4) == [2, 2, 2, 2]
    assert balance_stages([1] * 8, 8) == [1] * 8
    assert balance_stages([1] * 5, 1) == [5]


def test_balance_counts_embedding_and_head():
    # A heavy head (3 blocks' worth) pushes blocks off the last stage: costs 1+2 | 4 | 1+3
    # (ties go to the earliest cut: lighter early stages, which hold the most activations under 1F1B).
    assert balance_stages([1] * 7, 3, first_cost=1, last_cost=3) == [2, 4, 1]
    # A heavy embedding does the same at the front.
    assert balance_stages([1] * 6, 2, first_cost=4) == [1, 5]


def test_balance_optimal_on_uneven_costs():
    assert balance_stages([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]
    assert balance_stages([4, 1, 1, 1, 1, 1, 1, 4], 2) == [4, 4]
    with pytest.raises(ValueError):
        balance_stages([1, 1], 3)


def test_stage_modules_keep_full_names():
    model = build_model(CFG)
    full = {n for n, _ in model.named_parameters()}
    seen: list[str] = []
    for pp_rank in range(2):
        ids, parts = split_model(model, model_spec(CFG), pp_rank, pp=2, virtual=2)
        assert ids == stage_ids(pp_rank, 2, 2) == [pp_rank, pp_rank + 2]
        for stage, part in zip(ids, parts):
            names = [n for n, _ in part.named_parameters()]
            assert set(names) <= full
            assert (part.tok_embeddings is not None) == (stage == 0)
            assert (part.output is not None) == (part.norm is not None) == (stage == 3)
            seen += names
    assert sorted(seen) == sorted(full)  # every parameter lives on exactly one stage
    assert len(list(model.layers)) == CFG.n_layers  # the original model is untouched


def test_split_points():
    model = build_model(CFG)
    spec = ModelSpec(split_points=["layers.1", "layers.4"])
    assert split_blocks(model, spec, 3) == [["0"], ["1", "2", "3"], ["4", "5"]]
    assert split_blocks(model, ModelSpec(split_points=lambda n: [f"layers.{3 * i}" for i in range(1, n)]), 2) == [["0", "1", "2"], ["3", "4", "5"]]
    for bad in (["layers.9"], ["layers.0"], ["layers.4", "layers.1"], ["layers.2"]):
        with pytest.raises(ValueError):
            split_blocks(model, ModelSpec(split_points=bad), 3)


def test_default_microbatches():
    assert default_microbatches(4, "1f1b") == 4 and default_microbatches(4, "interleaved_1f1b") == 8


def test_activation_checkpointing_keeps_names_and_numerics():
    torch.manual_seed(0)
    model = build_model(CFG, device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    model(x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    model.zero_grad()
    apply_ac(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == names
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=0)


def test_tp_plan_matches_model():
    model = build_model(CFG)
    for sp in (False, True):
        assert unmatched_plan_keys(model, transformer_tp_plan(sequence_parallel=sp)) == []
    assert unmatched_plan_keys(model, {"layers.*.attention.wz": None}) == ["layers.*.attention.wz"]


def test_the_package_loads_its_parts_on_first_use_and_no_part_shadows_an_export():
    # In a fresh interpreter: the layout arithmetic without torch, then every export after every submodule is imported.
    script = (
        "import importlib, sys, types\n"
        "import strategies.layout\n"
        "assert 'torch' not in sys.modules, 'strategies.layout imported torch'\n"
        "import strategies\n"
        "for module in set(strategies._WHERE.values()):\n"
        "    importlib.import_module('strategies.' + module)\n"
        "shadowed = [n for n in strategies.__all__ if isinstance(getattr(strategies, n), types.ModuleType)]\n"
        "assert not shadowed, shadowed\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
