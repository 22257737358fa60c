"""Held-out evaluation on real gloo ranks: `ParallelModel.evaluate` under FSDP, TP and PP gives the single-process loss and leaves training as it was."""

from __future__ import annotations

import torch

import storage
from distributed import run_distributed
from elastic.config import ModelConfig, ParallelConfig
from elastic.layout import Layout
from elastic.model import build_model, model_spec
from strategies import initial_state, token_loss_sum

SEQ, BATCH = 8, 4
MODEL = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=SEQ)
CASES = {
    "dp_shard=2": (Layout(dp_shard=2), ParallelConfig(dp_shard=2)),
    "tp=2": (Layout(dp_shard=1, tp=2), ParallelConfig(dp_shard=1, tp=2)),
    "pp=2 1f1b": (Layout(pp=2, dp_shard=1), ParallelConfig(pp=2, dp_shard=1, pp_schedule="1f1b")),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _layouts(rank: int, world: int) -> dict:
    from strategies import init_weights, parallelize

    out = {}
    inputs, labels = _batch()
    spec = model_spec(MODEL)
    for name, (layout, parallel) in CASES.items():
        pm = parallelize(build_model(MODEL), layout.build_mesh("cpu"), parallel, micro_batch=2, spec=spec)
        pm.materialize("cpu")
        init_weights(pm, build_model(MODEL), seed=0)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        local = layout.local_batch(BATCH)
        d = layout.dp_rank(rank)
        x, y = inputs[d * local : (d + 1) * local], labels[d * local : (d + 1) * local]
        evaluated = pm.evaluate(x, y)
        grads = [p.grad for p in pm.parameters()]
        storage.state_tensors(pm.model_parts, opt)  # raises if evaluation left other tensors in the modules' parameters
        trained = pm.forward_backward(x, y, loss_scale=layout.dp / (BATCH * SEQ))
        opt.step()
        reporter = layout.is_data_reporter(rank)
        out[name] = {"eval": evaluated if reporter else None, "train": trained if reporter else None, "grads_none": all(g is None for g in grads)}
    return out


def test_evaluate_matches_one_process_and_leaves_training_alone():
    model = build_model(MODEL, device="cpu")
    model.load_state_dict(initial_state(build_model(MODEL), model_spec(MODEL), seed=0))
    inputs, labels = _batch()
    with torch.no_grad():
        want = float(token_loss_sum(model(inputs), labels))
    results = run_distributed(_layouts, 2)
    for name in CASES:
        evals = [r[name]["eval"] for r in results if r[name]["eval"] is not None]
        trains = [r[name]["train"] for r in results if r[name]["train"] is not None]
        assert abs(float(sum(evals)) - want) <= 1e-5 * want, name
        assert abs(float(sum(trains)) - float(sum(evals))) <= 1e-5 * want, name  # the first step saw the weights eval saw
        assert all(r[name]["grads_none"] for r in results), name  # no gradients from evaluation
