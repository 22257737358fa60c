"""Save at one layout, load at another, on real gloo processes: every tensor bitwise equal, training continues.

Three process groups in all (4, 3 and 2 ranks) to keep the suite fast:
the 4-rank run saves FSDP dp_shard=4, HSDP 2x2, tp=2 x dp_shard=2,
pp=2 x dp_shard=2 and pp=2 x tp=2 checkpoints, checks a same-layout resume against a run that
never stopped, and loads the TP checkpoint at pp=2 x dp_shard=2 and back; the
3- and 2-rank runs load them at dp_shard=3, dp_shard=2 and tp=2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch.distributed.tensor import DTensor

import storage
from elastic.config import DataConfig, ModelConfig, ParallelConfig
from elastic.data import GlobalSampler, SyntheticTokens
from elastic.layout import Layout
from elastic.model import build_model, model_spec
from strategies import init_weights, parallelize

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=8)
DATA = DataConfig(num_samples=1024, seq_len=8, seed=3)
GLOBAL_BATCH = 12


def _build(layout: Layout):
    """A parallel model at `layout` with the seed-0 initial weights, and its AdamW."""
    mesh = layout.build_mesh("cpu")
    pm = parallelize(build_model(MODEL), mesh, ParallelConfig(**layout.as_dict()), micro_batch=GLOBAL_BATCH, spec=model_spec(MODEL))
    pm.materialize("cpu")
    init_weights(pm, build_model(MODEL), seed=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    return pm, opt


def _step(pm, opt, layout: Layout, rank: int, step: int) -> float:
    """One optimizer step on the step's global batch; returns the mean token loss over the global batch."""
    sampler = GlobalSampler(DATA.num_samples, DATA.seed, GLOBAL_BATCH)
    x, y = SyntheticTokens(DATA, MODEL.vocab_size).batch(sampler.rank_indices(step, layout.dp_rank(rank), layout.dp))
    tokens = GLOBAL_BATCH * DATA.seq_len
    loss = pm.forward_backward(x, y, 1.0 / tokens)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.double() if layout.is_data_reporter(rank) else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(loss)
    return loss.item() / tokens


def _full(tensors: dict) -> dict[str, torch.Tensor]:
    """Every state tensor gathered to its full global value (a collective: all ranks call it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sorted(tensors.items())}


def _save(uri: str, step: int, rank: int, layout: Layout, pm, opt) -> None:
    tensors = storage.state_tensors(pm.model_parts, opt)
    rows = storage.write_shards(uri, step, rank, storage.snapshot(tensors), generation=1)
    storage.gather_and_commit(uri, step, rows, layout=layout.as_dict(), train_state={"step": step, "cursor": step * GLOBAL_BATCH}, generation=1)


def _save_at_four(rank: int, world: int, root: str) -> dict:
    out = {}
    # FSDP dp_shard=4: train 2 steps, save, then a third step uninterrupted ...
    fsdp = Layout(dp_shard=4)
    pm, opt = _build(fsdp)
    for step in range(2):
        _step(pm, opt, fsdp, rank, step)
    _save(f"{root}/fsdp4", 2, rank, fsdp, pm, opt)
    out["fsdp4"] = _full(storage.state_tensors(pm.model_parts, opt))
    out["fsdp4_loss2"] = torch.tensor(_step(pm, opt, fsdp, rank, 2), dtype=torch.float64)
    uninterrupted = _full(storage.state_tensors(pm.model_parts, opt))
    # ... and the same third step after a resume at the same layout: bitwise the same.
    pm2, opt2 = _build(fsdp)
    manifest = storage.load_shards(f"{root}/fsdp4", 2, storage.state_tensors(pm2.model_parts, opt2))
    assert manifest["train_state"] == {"step": 2, "cursor": 24}
    resumed_loss = _step(pm2, opt2, fsdp, rank, 2)
    resumed = _full(storage.state_tensors(pm2.model_parts, opt2))
    out["resume_same"] = torch.tensor(
        resumed_loss == out["fsdp4_loss2"].item() and all(torch.equal(uninterrupted[k], resumed[k]) for k in resumed)
    )
    # HSDP 2x2, TP within FSDP (strided shards), and a pipeline
    for name, layout in SAVED.items():
        if name != "fsdp4":
            pm3, opt3 = _build(layout)
            for step in range(2):
                _step(pm3, opt3, layout, rank, step)
            _save(f"{root}/{name}", 2, rank, layout, pm3, opt3)
            out[name] = _full(storage.state_tensors(pm3.model_parts, opt3))
    out.update(_load_at(rank, world, root, {"tp2": Layout(pp=2, dp_shard=2), "pp2": Layout(tp=2, dp_shard=2)}))
    out["state_init_same"] = torch.tensor(_state_init_matches_the_step_on_dtensors(Layout(tp=2, dp_shard=2)))
    return out


def _state_init_matches_the_step_on_dtensors(layout: Layout) -> bool:
    """The optimizer state a load's template gets (made on local tensors, then placed) is what the zero-lr step on the
    DTensors makes: the same placements, shapes, dtypes and values, and the parameters unchanged."""
    from storage.state import _zero_lr_step

    (pm, opt), (ref_pm, ref_opt) = _build(layout), _build(layout)
    before = _full(storage.state_tensors(pm.model_parts))
    fast = storage.state_tensors(pm.model_parts, opt)
    _zero_lr_step(ref_opt, list(ref_pm.parameters()), {})
    ref = storage.state_tensors(ref_pm.model_parts, ref_opt)
    same_layout = fast.keys() == ref.keys() and all(
        type(fast[k]) is type(ref[k]) and fast[k].shape == ref[k].shape and fast[k].dtype == ref[k].dtype
        and (not isinstance(ref[k], DTensor) or fast[k].placements == ref[k].placements)
        for k in ref
    )
    fast_full, ref_full = _full(fast), _full(ref)
    return same_layout and all(torch.equal(fast_full[k], ref_full[k]) for k in ref) and all(torch.equal(before[k], fast_full[k]) for k in before)


SAVED = {
    "fsdp4": Layout(dp_shard=4),
    "hsdp": Layout(dp_replicate=2, dp_shard=2),
    "tp2": Layout(tp=2, dp_shard=2),
    "pp2": Layout(pp=2, dp_shard=2),
    "pp2tp2": Layout(pp=2, tp=2),
}


def _load_at(rank: int, world: int, root: str, loads: dict[str, Layout]) -> dict:
    out = {}
    for name, layout in loads.items():
        pm, opt = _build(layout)
        storage.load_shards(f"{root}/{name}", 2, storage.state_tensors(pm.model_parts, opt))
        out[f"{name}@{layout}"] = _full(storage.state_tensors(pm.model_parts, opt))
        out[f"{name}@{layout}_loss2"] = torch.tensor(_step(pm, opt, layout, rank, 2), dtype=torch.float64)
    return out


def _merged(results: list[dict], name: str) -> dict[str, torch.Tensor]:
    """One result's tensors from every rank (pipeline stages each hold their own keys); copies must agree."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r[name].items():
            assert k not in out or torch.equal(out[k], v), f"{name}: ranks disagree on {k}"
            out[k] = v
    return out


def _assert_bitwise(saved: dict, loaded: dict, what: str) -> None:
    assert saved.keys() == loaded.keys(), what
    assert any(k.endswith(".exp_avg_sq") for k in saved) and any(k.endswith(".step") for k in saved)
    for k, want in saved.items():
        assert want.dtype == loaded[k].dtype and torch.equal(want, loaded[k]), f"{what}: {k} differs"


def test_reshard_matrix(tmp_path):
    root = str(tmp_path)
    four = run_distributed(_save_at_four, 4, root)
    saved = {name: _merged(four, name) for name in SAVED}
    assert bool(four[0]["resume_same"]), "a resume at the same layout must continue bitwise like a run that never stopped"
    assert all(bool(r["state_init_same"]) for r in four), "a load's optimizer state template must be what a step on the DTensors makes"
    for name, layout in SAVED.items():
        manifest = storage.verify(f"{root}/{name}", 2)
        assert manifest["layout"] == layout.as_dict()
    # Replicated pieces (across dp_replicate; norm weights across tp) are written once, spread over the ranks.
    assert len(storage.read_manifest(f"{root}/hsdp", 2)["files"]) == 4

    three = run_distributed(_load_at, 3, root, {name: Layout(dp_shard=3) for name in SAVED})
    two = run_distributed(_load_at, 2, root, {"fsdp4": Layout(dp_shard=2), "pp2": Layout(tp=2)})
    checks = [(four, "tp2", "pp=2xdp_shard=2"), (four, "pp2", "dp_shard=2xtp=2"), (two, "fsdp4", "dp_shard=2"),
              (two, "pp2", "tp=2")] + [(three, name, "dp_shard=3") for name in SAVED]
    for results, name, target in checks:
        _assert_bitwise(saved[name], _merged(results, f"{name}@{target}"), f"{SAVED[name]} -> {target}")
    # Training goes on from the same state: the next loss matches the uninterrupted run's up to summation order.
    for got in (three[0]["fsdp4@dp_shard=3_loss2"], two[0]["fsdp4@dp_shard=2_loss2"]):
        assert torch.allclose(got, four[0]["fsdp4_loss2"], rtol=1e-5, atol=0)


# -- 8 ranks: pp=2 x dp_shard=2 x tp=2 -> dp_shard=4 and back ------------------------------------------
EIGHT = Layout(pp=2, dp_shard=2, tp=2)
FOUR = Layout(dp_shard=4)


def _save_at_eight(rank: int, world: int, root: str) -> dict:
    """Train 2 steps at pp x dp_shard x tp, save, then take the third step uninterrupted (its loss is the reference)."""
    pm, opt = _build(EIGHT)
    for step in range(2):
        _step(pm, opt, EIGHT, rank, step)
    _save(f"{root}/eight", 2, rank, EIGHT, pm, opt)
    out = {"eight": _full(storage.state_tensors(pm.model_parts, opt))}
    out["eight_loss2"] = torch.tensor(_step(pm, opt, EIGHT, rank, 2), dtype=torch.float64)
    return out


def _four_from_eight(rank: int, world: int, root: str) -> dict:
    """Load the 8-rank checkpoint at dp_shard=4, take step 2, save that state at dp_shard=4 (step 3)."""
    out = _load_at(rank, world, root, {"eight": FOUR})  # loads, records the full state, takes step 2
    pm, opt = _build(FOUR)
    storage.load_shards(f"{root}/eight", 2, storage.state_tensors(pm.model_parts, opt))
    _step(pm, opt, FOUR, rank, 2)
    _save(f"{root}/four", 3, rank, FOUR, pm, opt)
    out["four"] = _full(storage.state_tensors(pm.model_parts, opt))
    return out


def _eight_from_four(rank: int, world: int, root: str) -> dict:
    pm, opt = _build(EIGHT)
    storage.load_shards(f"{root}/four", 3, storage.state_tensors(pm.model_parts, opt))
    return {"four@eight": _full(storage.state_tensors(pm.model_parts, opt))}


@pytest.mark.slow
def test_reshard_eight_ranks_pp_tp_fsdp_to_fsdp_and_back(tmp_path):
    """pp=2 x dp_shard=2 x tp=2 (8 ranks) -> dp_shard=4 -> pp=2 x dp_shard=2 x tp=2, bitwise at each load.

    Slow: three process groups (8, 4 and 8 ranks); the default suite covers
    pp x tp and pp x dp_shard at 4 ranks above.
    """
    root = str(tmp_path)
    eight = run_distributed(_save_at_eight, 8, root)
    saved = _merged(eight, "eight")
    assert storage.verify(f"{root}/eight", 2)["layout"] == EIGHT.as_dict()
    four = run_distributed(_four_from_eight, 4, root)
    _assert_bitwise(saved, _merged(four, f"eight@{FOUR}"), f"{EIGHT} -> {FOUR}")
    assert torch.allclose(four[0][f"eight@{FOUR}_loss2"], eight[0]["eight_loss2"], rtol=1e-5, atol=0)
    back = run_distributed(_eight_from_four, 8, root)
    _assert_bitwise(_merged(four, "four"), _merged(back, "four@eight"), f"{FOUR} -> {EIGHT}")
