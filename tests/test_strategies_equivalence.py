"""Every layout trains exactly like one process: same losses, same gradient norms, same weights.

K steps of the same tiny model on the same data run under each layout (real
gloo ranks, CPU, fp32) and against a plain single-process reference that uses
none of `strategies/`. Losses, clipped gradient norms and the final full
parameters must match within 1e-5 relative error (norm of the difference over
the norm of the reference, per tensor). Layouts that need the same world size
share one spawned run to keep the suite fast.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distributed import run_distributed
from elastic.config import ModelConfig, ParallelConfig
from elastic.layout import Layout
from elastic.model import build_model, model_spec
from strategies import initial_state, token_loss_sum

TOL = 1e-5
STEPS = 3
SEQ = 8
GLOBAL_BATCH = 8
LR = 1e-2
MAX_NORM = 0.05  # below the gradient norms of these steps, so clipping is active
MODEL = ModelConfig(vocab_size=32, dim=16, n_layers=4, n_heads=2, ffn_dim=32, max_seq_len=SEQ)


def make_batches(vocab: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)


# -- the single-process reference: no strategies code at all -------------------------------------------
def reference_train(model: nn.Module, full: dict[str, torch.Tensor], loss_fn=token_loss_sum, forward=None) -> dict:
    """STEPS plain steps; `forward(model, inputs)` gives the logits (default: `model(inputs)`)."""
    model.load_state_dict(full, strict=True)
    opt = make_optimizer(model.parameters())
    inputs, labels = make_batches(_vocab(model))
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        logits = forward(model, inputs[step]) if forward is not None else model(inputs[step])
        loss = loss_fn(logits, labels[step])
        (loss / (GLOBAL_BATCH * SEQ)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "norms": torch.stack(norms), "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _vocab(model: nn.Module) -> int:
    for owner in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
        if hasattr(owner, "vocab_size"):
            return owner.vocab_size
    raise AttributeError(f"{type(model).__name__} has no vocab_size")


# -- one layout on real ranks ----------------------------------------------------------------------------
def train_layout(rank: int, layout: Layout, parallel: ParallelConfig, make_model, spec, micro_batch: int) -> dict:
    """Train STEPS steps as the training loop does; return this rank's losses, norms and full parameters."""
    from strategies import clip_grad_norm, init_weights, parallelize

    pm = parallelize(make_model(), layout.build_mesh("cpu"), parallel, micro_batch=micro_batch, spec=spec)
    pm.materialize("cpu")
    init_weights(pm, make_model(), seed=0)
    opt = make_optimizer(pm.parameters())
    inputs, labels = make_batches(_vocab(make_model()))
    local = layout.local_batch(GLOBAL_BATCH)
    d = layout.dp_rank(rank)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = inputs[step, d * local : (d + 1) * local], labels[step, d * local : (d + 1) * local]
        losses.append(pm.forward_backward(x, y, loss_scale=layout.dp / (GLOBAL_BATCH * SEQ)))
        norms.append(clip_grad_norm(pm, MAX_NORM))
        opt.step()
    # Every rank of a stage joins each full_tensor() (a collective on the parameter's mesh).
    params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for name, p in pm.named_parameters()}
    c = layout.coords(rank)
    keep = c["tp"] == 0 and c["dp_replicate"] == 0 and c["dp_shard"] == 0
    return {
        "losses": torch.stack(losses),
        "norms": torch.stack(norms),
        "reporter": layout.is_data_reporter(rank),
        "params": params if keep else {},
    }


def merge_ranks(results: list[dict], layout: Layout) -> dict:
    """Total loss over the data slices (one reporter each), rank 0's norms, parameters merged over stages."""
    losses = sum(r["losses"] for r in results if r["reporter"])
    params: dict[str, torch.Tensor] = {}
    for r in results:
        params.update(r["params"])
    return {"losses": losses, "norms": results[0]["norms"], "params": params}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(got: dict, ref: dict, initial: dict[str, torch.Tensor]) -> list[str]:
    """Human-readable mismatches (empty when the layout matches the reference)."""
    bad = []
    for key in ("losses", "norms"):
        if (e := rel_err(got[key], ref[key])) > TOL:
            bad.append(f"{key}: rel err {e:.2e} ({got[key].tolist()} vs {ref[key].tolist()})")
    if set(got["params"]) != set(ref["params"]):
        bad.append(f"parameter names differ: {sorted(set(got['params']) ^ set(ref['params']))}")
    for name in sorted(set(got["params"]) & set(ref["params"])):
        g, r = got["params"][name], ref["params"][name]
        if g.shape != r.shape:
            bad.append(f"{name}: shape {tuple(g.shape)} vs {tuple(r.shape)}")
        elif (e := rel_err(g, r)) > TOL:
            bad.append(f"{name}: rel err {e:.2e}")
    # The check is only meaningful if training moved the weights far more than the tolerance.
    moved = rel_err(torch.cat([p.flatten() for p in ref["params"].values()]), torch.cat([initial[k].flatten() for k in ref["params"]]))
    assert moved > 1000 * TOL, f"reference barely trained (moved {moved:.2e}): the comparison could not fail"
    return bad


# -- the matrix --------------------------------------------------------------------------------------------
def P(**kw) -> ParallelConfig:
    return ParallelConfig(**kw)


GROUPS: dict[int, dict[str, tuple[Layout, ParallelConfig, int]]] = {
    2: {
        "tp2": (Layout(tp=2), P(tp=2, sequence_parallel=False), 2),
        "tp2_sp": (Layout(tp=2), P(tp=2, sequence_parallel=True), 4),
        "pp2_gpipe": (Layout(pp=2), P(pp=2, pp_schedule="gpipe"), 4),
        "pp2_1f1b": (Layout(pp=2), P(pp=2, pp_schedule="1f1b", pp_microbatches=4), 4),
        "pp2_interleaved_1f1b": (Layout(pp=2), P(pp=2, pp_schedule="interleaved_1f1b"), 4),
    },
    4: {
        "dp_shard4": (Layout(dp_shard=4), P(dp_shard=4), 1),
        "hsdp2x2": (Layout(dp_replicate=2, dp_shard=2), P(dp_replicate=2, dp_shard=2, reshard_after_forward=False), 2),
        "pp2_tp2": (Layout(pp=2, tp=2), P(pp=2, tp=2, pp_schedule="1f1b", activation_checkpointing=True), 4),
    },
    8: {
        "pp2_dp2_tp2": (
            Layout(pp=2, dp_shard=2, tp=2),
            P(pp=2, dp_shard=2, tp=2, pp_schedule="interleaved_1f1b", activation_checkpointing=True),
            2,
        ),
    },
}


def _builtin_model():
    return build_model(MODEL)


def _run_group(rank: int, world: int, names: list[str] | None = None) -> dict:
    return {
        name: train_layout(rank, layout, parallel, _builtin_model, model_spec(MODEL), micro)
        for name, (layout, parallel, micro) in GROUPS[world].items()
        if names is None or name in names
    }


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu")
    full = initial_state(build_model(MODEL), model_spec(MODEL), seed=0)
    return {"ref": reference_train(model, {k: v.clone() for k, v in full.items()}), "initial": full}


_cache: dict[int, list[dict]] = {}


def _group_results(world: int) -> list[dict]:
    if world not in _cache:
        _cache[world] = run_distributed(_run_group, world)
    return _cache[world]


@pytest.mark.parametrize("world,name", [(w, n) for w, group in GROUPS.items() for n in group])
def test_layout_matches_single_process(world, name, reference):
    layout = GROUPS[world][name][0]
    assert layout.world_size == world
    ranks = [r[name] for r in _group_results(world)]
    stage_sets = [set(r["params"]) for r in ranks if r["params"]]
    assert len(stage_sets) == layout.pp  # one collecting rank per stage ...
    assert sum(map(len, stage_sets)) == len(set().union(*stage_sets))  # ... and each parameter on one stage only
    got = merge_ranks(ranks, layout)
    bad = compare(got, reference["ref"], reference["initial"])
    assert not bad, f"{name} ({layout}) differs from the single-process reference:\n" + "\n".join(bad)


def test_clipping_is_active(reference):
    assert (reference["ref"]["norms"] > MAX_NORM).all(), "raise the gradient norm or lower MAX_NORM: clipping must be exercised"


def test_comparison_detects_small_differences(reference):
    """A 1e-4 relative change in one tensor, or a dropped parameter, must fail the check."""
    ref = reference["ref"]
    got = {"losses": ref["losses"].clone(), "norms": ref["norms"].clone(), "params": dict(ref["params"])}
    assert compare(got, ref, reference["initial"]) == []
    name = "layers.1.attention.wq.weight"
    got["params"][name] = ref["params"][name] * (1 + 1e-4)
    assert any(name in m for m in compare(got, ref, reference["initial"]))
    del got["params"]["output.weight"]
    assert any("names differ" in m for m in compare(got, ref, reference["initial"]))
    got = {"losses": ref["losses"] * (1 + 1e-4), "norms": ref["norms"], "params": ref["params"]}
    assert any(m.startswith("losses") for m in compare(got, ref, reference["initial"]))
